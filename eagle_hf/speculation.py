"""One speculation round, as named steps, for chain mode and tree mode alike.

    begin_round -> commit (real rows for the drafter) -> choose_depth -> draft (catch up, grow the tree)
        -> [the target verifies: transformers' assisted loop for chains, `eagle_hf.hf.tree_loop` for trees]
        -> record (stats, the adaptive controller, listeners, timings)

The `Speculator` owns everything on the drafter's side of a `generate()` call: the drafter's cache of real rows,
the rows it has not read yet, the schedule (adaptive controller or fixed depth) and the bookkeeping. The two
decoding loops only move tokens, target features and the target's cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from .adaptive import DraftLengthController
from .drafting import Chooser, DraftState, draft_tree
from .settings import MAX_DEPTH, DraftSettings
from .stats import SpecDecodeStats
from .timing import Clock
from .tree import DraftTree

logger = logging.getLogger(__name__)

#: ``listener(drafts, accepted, last_token)`` after every round: the drafts shown for the round (the accepted
#: path and the best rejected continuation; [] for a plain step), how many were accepted, the round's last token
DraftListener = Callable[[list[int], int, int], None]


class Speculator:
    """The drafter's side of one `generate()` call. Rounds are ``"prefill"``, ``"draft"`` (a draft-and-verify
    cycle), ``"fallback"`` (a plain step chosen by the schedule, or a fully pruned tree) or ``"final"`` (a plain
    step because no room is left for a draft)."""

    def __init__(
        self,
        drafter,
        settings: DraftSettings,
        stats: SpecDecodeStats,
        controller: DraftLengthController | None = None,
        listeners: Sequence[DraftListener] = (),
        clock: Clock | None = None,
    ):
        self.drafter, self.settings, self.stats, self.controller = drafter, settings, stats, controller
        self.listeners = list(listeners)
        self.clock = clock or Clock(drafter.fc.weight.device)
        self.state = DraftState()
        self.depth = settings.depth  # the fixed (or heuristic) schedule's depth
        self.round = "prefill"
        self.tree: DraftTree | None = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # real rows the drafter has not read yet
        self._round_start: float | None = None
        self._after_cycle = False  # the last round was a cycle: this round's catch-up is a regular round's cost

    # ------------------------------------------------------------------ the steps of a round
    def begin_round(self) -> None:
        """Start timing a round; a plain round that just ended teaches the controller the loop's own cost."""
        if self.controller is None:
            return
        now = self.clock()
        if self.round == "fallback" and self._round_start is not None:
            self.controller.observe_plain_round(now - self._round_start)
        self._round_start = now

    def commit(self, aux: torch.Tensor, next_tokens: torch.Tensor, position: int) -> None:
        """Real rows for the drafter: target taps ``[1, n, A*H_t]`` at positions ``position..position+n-1`` and the
        token after each ``[1, n]``. They are read at the next draft (plain steps pile up; nothing runs now)."""
        if self.state.length == 0 and not self._pending:
            self.state.start = position
        self._pending.append((aux, next_tokens))

    def choose_depth(self, room: int) -> int:
        """This round's depth; 0 decodes plainly. `room`: drafts that still fit before the length limit."""
        wanted = self.controller.choose() if self.controller is not None else self.depth
        depth = max(min(wanted, room), 0)
        self.round = "draft" if depth > 0 else ("fallback" if wanted <= 0 else "final")
        return depth

    def draft(self, root_token: int, depth: int, total_tokens: int, choose: Chooser | None = None) -> DraftTree:
        """Catch up on the committed rows, then grow this round's draft tree (a chain when top_k is 1)."""
        start = self.clock()
        logits, hidden = self._catch_up()
        caught_up = self.clock()
        s = self.settings
        tree = draft_tree(self.drafter, self.state, root_token, logits, hidden, depth, s.branching, total_tokens,
                          s.confidence_threshold, choose=choose, prune=s.mode == "tree")
        end = self.clock()
        self.stats.drafter_time += end - start
        if self.controller is not None and self._after_cycle:  # a backlog after plain steps is not a round's cost
            self.controller.observe_drafter(caught_up - start, end - caught_up, depth)
        self.tree = tree
        if tree.num_drafts == 0:  # every branch was below the confidence threshold: a plain step
            self.round = "fallback"
        return tree

    def record(self, accepted: int, last_token: int, path: list[int] | None = None, cut: bool = False) -> None:
        """After the target verified (or decoded plainly): stats, schedule, listeners.

        path: the accepted node path (default: the first `accepted` drafts of a chain); cut: the round's tokens
        were cut at EOS or the length limit, so nothing after the accepted drafts was rejected."""
        if self.round == "prefill":
            return
        drafts: list[int] = []
        if self.round == "draft":
            tree = self.tree
            drafted = int(tree.depths().max())
            self.stats.record_cycle(drafted, accepted)
            if self.controller is not None:
                self.controller.update(drafted, accepted, None if self.controller.seeded else tree.confidences())
            if self.settings.schedule.startswith("heuristic"):
                self.depth = min(self.depth + 2, MAX_DEPTH) if accepted == drafted else max(1, self.depth - 1)
            if self.listeners:  # only displays need the rejected continuation
                drafts = shown_drafts(tree, path if path is not None else list(range(accepted + 1)))
                drafts = drafts[:accepted] if cut else drafts
        elif self.round == "fallback":
            self.stats.fallback_steps += 1
        else:
            self.stats.final_steps += 1
        self._after_cycle = self.round == "draft"
        for listener in self.listeners:
            listener(drafts, accepted, last_token)

    # ------------------------------------------------------------------ helpers
    def _catch_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the pending real rows through the drafter: its last row's logits [1, Vd] and hidden [1, 1, H]."""
        w = self.drafter.fc.weight
        aux = torch.cat([a for a, _ in self._pending], 1).to(w.device, w.dtype)  # [1, n, A*H_t]
        tokens = torch.cat([t for _, t in self._pending], 1).to(w.device)  # [1, n]
        self._pending.clear()
        return self.state.extend(self.drafter, aux, tokens)


def shown_drafts(tree: DraftTree, path: list[int]) -> list[int]:
    """For displays: the accepted drafts, then the best-scoring rejected continuation below the last accepted
    node (for a chain: every draft)."""
    drafts = [int(tree.tokens[n]) for n in path[1:]]
    node = path[-1]
    while children := tree.children(node):
        node = max(children, key=lambda i: float(tree.scores[i]))
        drafts.append(int(tree.tokens[node]))
    return drafts
