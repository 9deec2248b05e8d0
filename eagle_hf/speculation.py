"""One speculation round, as named steps, for chain mode and tree mode alike.

    begin_round -> commit (real rows for the drafter) -> choose_depth (the drafter's depth, the copy branches)
        -> draft (catch up, grow the tree, graft the copy branches)
        -> [the target verifies: transformers' assisted loop for chains, `eagle_hf.hf.tree_loop` for trees]
        -> record (stats per source, the adaptive controller and the copy source's estimates, listeners, timings)

The `Speculator` owns everything on the drafting side of a `generate()` call: the drafter's cache of real rows,
the rows it has not read yet, the copy source's index of the context, the schedule (adaptive controller or fixed
depth) and the bookkeeping. The two decoding loops only move tokens, target features and the target's cache.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Sequence

import torch

from . import copying
from .adaptive import DraftLengthController
from .copying import CopySource
from .drafting import Chooser, DraftState, draft_trees
from .settings import MAX_DEPTH, DraftSettings
from .stats import SpecDecodeStats
from .timing import Timer
from .tree import EAGLE, SOURCE_NAMES, DraftTree

logger = logging.getLogger(__name__)

#: ``listener(drafts, accepted, last_token)`` after every round: the drafts shown for the round (the accepted
#: path and the best rejected continuation; [] for a plain step), how many were accepted, the round's last token.
#: A listener with a ``sources`` parameter also gets who proposed each shown draft ("eagle", "copy", "eagle+copy");
#: one with a ``row`` parameter gets the batch row of the round (None for batch size 1).
DraftListener = Callable[[list[int], int, int], None]

#: extra verify cost per token assumed when no cost model was measured (fixed schedules), in one-token forwards
DEFAULT_MARGINAL_COST = 0.05


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
        timer: Timer | None = None,
        row: int | None = None,
        state: DraftState | None = None,
        stop_tokens: Sequence[int] = (),
    ):
        self.drafter, self.settings, self.stats, self.controller = drafter, settings, stats, controller
        self.row = row  # the batch row this speculator drafts for (None: batch size 1)
        self.listeners = [(f, _keywords(f)) for f in listeners]
        # marks on the device's queue, measured after the round's read-back (no synchronisation); shared by a batch
        self.timer = timer or Timer(drafter.fc.weight.device if drafter is not None else "cpu")
        # the drafter's cache, shared by a batch's rows (one row: its own); this row is `slot` in it
        self.state = state or DraftState()
        self.slot = 0 if row is None else row
        self._started = False  # whether a real row was committed yet
        self.copy = CopySource(settings.copy_ngram, settings.copy_length, settings.copy_branch_count,
                               self._marginal_cost, settings.probe_every,
                               stop_tokens=stop_tokens) if settings.uses_copy else None
        self._room, self._copy_paying = 0, False  # this round's room for drafts; whether copy branches may grow
        self.depth = settings.depth  # the fixed (or heuristic) schedule's depth
        self.round = "prefill"
        self.eagle_depth = 0  # the drafter's depth this round (0: only copy branches, or a plain step)
        self.tree: DraftTree | None = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # real rows the drafter has not read yet
        self._round_start = None  # the timer's mark where this round began
        self._after_cycle = False  # the last round was a cycle: this round's catch-up is a regular round's cost

    # ------------------------------------------------------------------ the steps of a round
    def begin_round(self) -> None:
        """Start timing a round; a plain round that just ended teaches the controller the loop's own cost (a
        batch's loop times its whole rounds itself: one row's round is not the row's cost)."""
        if self.controller is None or self.row is not None:
            return
        now = self.timer.mark()
        if self.round == "fallback" and self._round_start is not None:
            self.timer.measure([self._round_start, now], self.controller.observe_plain_round)
        self._round_start = now

    def commit(self, aux: torch.Tensor, next_tokens: torch.Tensor, position: int) -> None:
        """Real rows for the drafter: target taps ``[1, n, A*H_t]`` at positions ``position..position+n-1`` and the
        token after each ``[1, n]``. They are read at the next draft (plain steps pile up; nothing runs now)."""
        if not self.settings.uses_eagle:
            return
        if not self._started:  # the first real row: where the drafter's positions start
            self.state.positions[self.slot], self._started = position, True
        self._pending.append((aux, next_tokens))

    def extend_context(self, tokens: Sequence[int]) -> None:
        """Tokens appended to the sequence (the prompt first): the copy source's index reads them."""
        if self.copy is not None:
            self.copy.index.extend(tokens)

    def choose_depth(self, room: int, planned: int | None = None) -> int:
        """This round's drafter depth (returned; 0: the drafter rests) and copy branches; the round is a plain
        step when neither drafts. `room`: drafts that still fit before the length limit; `planned`: the depth
        the controller chose for a whole batch this round (once per round, not once per row)."""
        wanted = self.depth
        if not self.settings.uses_eagle:
            wanted = 0
        elif planned is not None:
            wanted = planned
        elif self.controller is not None:
            wanted = self.controller.choose()
        depth = max(min(wanted, room), 0)
        branches = []
        rest = planned == 0 and self.controller is not None and self.controller.rest  # (the batch times a plain
        # round, or has spent its loss budget: no copy branches either)
        if self.copy is not None and not rest:
            s = self.settings
            eagle_size = 0 if depth == 0 else (depth + 1 if s.branching == 1 else s.total_tokens)
            paying = self.controller is None or self.controller.drafting_pays()
            # a batch where drafting does not pay probes its rows' copies together, in the controller's probe
            # rounds: one row's probe widens every row's round
            probe = None if paying or planned is None else planned > 0
            branches = self.copy.propose(room, max(eagle_size, 1), probe_only=not paying, probe=probe)
            self._room, self._copy_paying = room, paying
            if depth > 0 and branches and probe is None and not self._drafter_pays_beside_copy(depth):  # (a
                # batch's probe round probes the drafter too)
                depth = 0
        self.round = "draft" if depth > 0 or branches else ("fallback" if wanted <= 0 else "final")
        return depth

    def draft(self, root_token: int, depth: int, total_tokens: int, choose: Chooser | None = None) -> DraftTree:
        """Catch up on the committed rows, grow this round's draft tree (a chain when top_k is 1), then graft
        the copy branches onto it (`draft_round` for a single row)."""
        return draft_round([self], [root_token], [depth], [total_tokens], [choose])[0]

    @property
    def backlog(self) -> bool:
        """Whether this round's drafter caught up on plain steps' rows (not a regular round's cost)."""
        return self.eagle_depth > 0 and not self._after_cycle

    def graft_copy(self, tree: DraftTree) -> DraftTree:
        """This round's tree with the copy branches grafted on: those from the root, then those continuing the
        drafter's best first drafts (`copying.ANCHORS` of them, none by default: the drafter guesses the token
        that starts a copied span, the copy source copies the span). Each copy token is scored by the copy's
        acceptance estimate."""
        below_drafts = self.copy is not None and copying.ANCHORS > 0 and self._copy_paying
        if not below_drafts and (self.copy is None or not self.copy.branches):
            return tree
        tree = self._graft(tree, self.copy.branches)
        drafts = [n for n in tree.children(0) if tree.source(n) & EAGLE] if below_drafts else []
        for anchor in sorted(drafts, key=lambda n: -float(tree.scores[n]))[: copying.ANCHORS]:
            branch = self.copy.propose_after(int(tree.tokens[anchor]), math.exp(float(tree.scores[anchor])),
                                             self._room, tree.size)
            if branch is not None:
                tree = self._graft(tree, [branch], at=anchor)
        return tree

    def _graft(self, tree: DraftTree, branches: list, at: int = 0) -> DraftTree:
        if not branches:
            return tree
        a = self.copy.acceptance if at == 0 else self.copy.acceptance_after
        return tree.graft([b.tokens for b in branches],
                          [[math.log(max(a.first[b.match - 1] if i == 0 else a.later, 1e-6))
                            for i in range(len(b.tokens))] for b in branches], at=[at] * len(branches))

    def record(self, accepted: int, last_token: int, path: list[int] | None = None, cut: bool = False) -> None:
        """After the target verified (or decoded plainly): stats, schedule, listeners.

        path: the accepted node path (default: the first `accepted` drafts of a chain); cut: the round's tokens
        were cut at EOS or the length limit, so nothing after the accepted drafts was rejected."""
        if self.round == "prefill":
            return
        drafts: list[int] = []
        sources: list[str] = []
        if self.round == "draft":
            tree = self.tree
            path = path if path is not None else list(range(accepted + 1))
            depths = tree.depths()
            self.stats.record_cycle(int(depths.max()), accepted)
            self.stats.record_sources(_per_source(tree, depths, path))
            if self.eagle_depth > 0:
                self._record_eagle(tree, depths, path, accepted)
            drafter_ran = self.eagle_depth > 0 and copying.ANCHORS > 0  # (what copying below drafts adds)
            if self.copy is not None and (self.copy.branches or drafter_ran):
                self.copy.update([int(tree.tokens[n]) for n in path[1:]], drafter_ran=drafter_ran)
            if self.listeners:  # only displays need the rejected continuation
                nodes = shown_nodes(tree, path)
                nodes = nodes[:accepted] if cut else nodes
                drafts = [int(tree.tokens[n]) for n in nodes]
                sources = [_source_name(tree.source(n)) for n in nodes]
        elif self.round == "fallback":
            self.stats.fallback_steps += 1
        else:
            self.stats.final_steps += 1
        self._after_cycle = self.round == "draft" and self.eagle_depth > 0
        for listener, keywords in self.listeners:
            extra = {"sources": sources, "row": self.row}
            listener(drafts, accepted, last_token, **{k: v for k, v in extra.items() if k in keywords})

    def _record_eagle(self, tree: DraftTree, depths: torch.Tensor, path: list[int], accepted: int) -> None:
        """The drafter's own outcome (its nodes only) for the adaptive controller and the heuristic schedule."""
        if tree.sources is None:
            drafted, mine = int(depths.max()), accepted
        else:
            eagle = (tree.sources & EAGLE).bool()
            drafted = int(depths[eagle].max()) if bool(eagle.any()) else 0
            mine = next((i for i, n in enumerate(path[1:]) if not tree.source(n) & EAGLE), accepted)
        if self.controller is not None and drafted:
            self.controller.update(drafted, mine, None if self.controller.seeded else tree.confidences())
        if self.settings.schedule.startswith("heuristic"):
            self.depth = min(self.depth + 2, MAX_DEPTH) if mine == drafted else max(1, self.depth - 1)

    def _drafter_pays_beside_copy(self, depth: int) -> bool:
        """Whether the drafter's tree is worth its cost next to this round's copy branches: its own drafts add
        tokens when the copy's first token is rejected, and copying after its first draft adds what it has
        been adding (tokens and costs in one-token target forwards)."""
        c = self.controller
        if c is None:
            return True
        copy_first = max(self.copy.acceptance.first[b.match - 1] for b in self.copy.branches)
        gain = (1.0 - copy_first) * (c.expected_tokens(depth) - 1.0) + self.copy.anchor_yield
        return gain > c.cycle_cost(depth) - c.verify_cost(1)

    def _marginal_cost(self, verified: int) -> float:
        """Extra cost of verifying one more token on top of `verified`, in tokens a plain step yields for the
        same cost. In a batch a longer tree pads every row's to its size: the whole batch pays for it."""
        if self.controller is None:
            return DEFAULT_MARGINAL_COST
        c = self.controller  # a secant over 8 tokens: single-token steps of measured times are noisy
        step = max((c.verify_cost(verified + 8) - c.verify_cost(verified)) / 8, 0.0)
        return step * c.rows / c.verify_cost(1)

    # ------------------------------------------------------------------ helpers


def draft_round(speculators: Sequence[Speculator], roots: list[int], depths: list[int], total_tokens: list[int],
                choosers: list[Chooser | None] | None = None) -> list[DraftTree]:
    """Step "draft" of one round for the rows of a batch that share a drafter cache, in its row order (a single
    row: `Speculator.draft`). Every row with committed rows catches them up in one drafter forward; the rows with
    a depth grow their trees together, one drafter forward per level; then each row grafts its copy branches.
    A row not in a drafting round (`round` is not ``"draft"``) keeps the root alone."""
    first = speculators[0]
    state, timer, s = first.state, first.timer, first.settings
    drafting = [i for i, sp in enumerate(speculators) if sp.round == "draft" and depths[i] > 0]
    trees = [DraftTree.root(r) for r in roots]
    if drafting:
        start = timer.mark()
        logits, hidden = _catch_up(speculators)  # [B, Vd], [B, 1, H]
        caught_up = timer.mark()
        slots = [speculators[i].slot for i in drafting]
        grown = draft_trees(first.drafter, state, [roots[i] for i in drafting], logits, hidden,
                            [depths[i] for i in drafting], s.branching, [total_tokens[i] for i in drafting],
                            s.confidence_threshold, [choosers[i] for i in drafting] if choosers else None,
                            prune=s.mode == "tree", rows=slots)
        end = timer.mark()
        for i, tree in zip(drafting, grown):
            trees[i] = tree
        rows = [speculators[i] for i in drafting]
        c = first.controller  # each row's share; a backlog after plain steps is not a round's cost
        learn = c is not None and not any(sp.backlog for sp in rows)
        depth = max(depths[i] for i in drafting)
        timer.measure([start, caught_up, end], lambda catch_up, steps: _drafter_timed(
            rows, c if learn else None, catch_up, steps, depth))
    for i, sp in enumerate(speculators):
        sp.eagle_depth = depths[i] if i in drafting else 0
        if sp.round != "draft":
            continue
        sp.tree = trees[i] = sp.graft_copy(trees[i])
        if sp.tree.num_drafts == 0:  # every branch was below the confidence threshold: a plain step
            sp.round = "fallback"
    return trees


def _drafter_timed(rows: Sequence[Speculator], controller, catch_up: float, steps: float, depth: int) -> None:
    """A drafting round's drafter time, once measured: each row's share in its stats, and the controller's
    estimates of the catch-up and of a draft step (None: the round teaches it nothing)."""
    for sp in rows:
        sp.stats.drafter_time += (catch_up + steps) / len(rows)
    if controller is not None:
        controller.observe_drafter(catch_up / len(rows), steps / len(rows), depth)


def _catch_up(speculators: Sequence[Speculator]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' pending real rows through the drafter in one forward (padded to the longest): each row's last
    row's draft logits [B, Vd] and fed-back hidden state [B, 1, H]."""
    w = speculators[0].drafter.fc.weight
    counts = [sum(t.shape[1] for _, t in sp._pending) for sp in speculators]
    width = max(counts)
    aux = w.new_zeros(len(speculators), width, speculators[0].drafter.fc.weight.shape[1])  # [B, n, A*H_t]
    tokens = torch.zeros(len(speculators), width, dtype=torch.long, device=w.device)  # [B, n]
    for b, sp in enumerate(speculators):
        if sp._pending:
            aux[b, : counts[b]] = torch.cat([a for a, _ in sp._pending], 1)[0].to(w.device, w.dtype)
            tokens[b, : counts[b]] = torch.cat([t for _, t in sp._pending], 1)[0].to(w.device)
            sp._pending.clear()
    return speculators[0].state.extend(speculators[0].drafter, aux, tokens, counts)


def shown_nodes(tree: DraftTree, path: list[int]) -> list[int]:
    """For displays: the accepted draft nodes, then the best-scoring rejected continuation below the last
    accepted node (for a chain: every draft)."""
    nodes = list(path[1:])
    node = path[-1]
    while children := tree.children(node):
        node = max(children, key=lambda i: float(tree.scores[i]))
        nodes.append(node)
    return nodes


def _per_source(tree: DraftTree, depths: torch.Tensor, path: list[int]) -> dict[str, tuple[int, list[int], list[int]]]:
    """Per source: (nodes drafted, depths it drafted at, depths of accepted nodes it proposed); depths from 1."""
    out = {}
    for bit, name in SOURCE_NAMES.items():
        mine = [n for n in range(1, tree.size) if tree.source(n) & bit]
        if mine:
            reached = sorted({int(depths[n]) for n in mine})
            out[name] = (len(mine), reached, [i + 1 for i, n in enumerate(path[1:]) if tree.source(n) & bit])
    return out


def _source_name(bits: int) -> str:
    return "+".join(name for bit, name in SOURCE_NAMES.items() if bits & bit)


def _keywords(listener) -> set[str]:
    """The optional keywords (``sources``, ``row``) a listener takes."""
    try:
        return set(inspect.signature(listener).parameters) & {"sources", "row"}
    except (TypeError, ValueError):
        return set()
