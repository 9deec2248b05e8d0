"""One speculation round, as named steps, for chain mode and tree mode alike.

    commit (real rows for the drafter) -> begin_round (this row's part of the round's plan, `plan_round`: the
        drafter's depth, the copy branches) -> draft (catch up, grow the tree, graft the copy branches)
        -> [the target verifies: transformers' assisted loop for chains, `eagle_hf.hf.tree_loop` for trees]
        -> end_round (one `RoundRecord` for the stats, the adaptive controller, the copy source, the listeners;
           the round's timings follow as one `RoundTiming`)

The `Speculator` owns everything on the drafting side of a `generate()` call: the drafter's cache of real rows,
the rows it has not read yet, the copy source's index of the context, the schedule (adaptive controller or fixed
depth) and the bookkeeping. The two decoding loops only move tokens, target features and the target's cache.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .copying import Branch, CopySource, Proposal, Wait, cut_branches
from .drafting import Chooser, DraftState, PendingTrees, TreeRequest, draft_trees
from .rounds import Round, RoundRecord, Timer
from .schedule import CopyAction, DraftLengthController
from .settings import MAX_DEPTH, DraftSettings
from .stats import SpecDecodeStats
from .tree import COPY, DraftTree

logger = logging.getLogger(__name__)

#: ``listener(drafts, accepted, last_token)`` after every round: the drafts shown for the round (the accepted
#: path and the best rejected continuation; [] for a plain step), how many were accepted, the round's last token.
#: A listener with a ``sources`` parameter also gets who proposed each shown draft ("eagle", "copy", "eagle+copy");
#: one with a ``row`` parameter gets the batch row of the round (None for batch size 1).
DraftListener = Callable[[list[int], int, int], None]

#: extra verify cost per token assumed when no cost model was measured (fixed schedules), in one-token forwards
DEFAULT_MARGINAL_COST = 0.05


@dataclass
class CacheRow:
    """A row in the drafter's cache (`DraftState`, shared by a batch's rows): its `slot` there; the real rows
    committed that the drafter has not read yet (`pending`: target taps ``[1, n, A*H_t]`` and the token after each
    ``[1, n]``); whether one was committed yet (`started`: the first says where the row's positions start); whether
    the last round was a drafting one (`after_cycle`: this round's catch-up is then a regular round's cost); the
    rows this round's catch-up read (`caught_up`)."""

    slot: int = 0
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    started: bool = False
    after_cycle: bool = False
    caught_up: int = 0


@dataclass
class CurrentRound:
    """A row's round as its steps write it: its `kind`; the drafter's depth in it (`eagle_depth`, 0: only copy
    branches, or a plain step); the drafter forwards its levels took (`drafter_levels`: fewer than the depth where
    pruned); its `tree` (the copy branches grafted on)."""

    kind: Round = Round.PREFILL
    eagle_depth: int = 0
    drafter_levels: int = 0
    tree: DraftTree | None = None


class Speculator:
    """The drafter's side of one `generate()` call. Its round (`this_round`, a `CurrentRound`) is of a kind of
    `Round` (prefill, a draft-and-verify cycle, a plain step the schedule chose or one without room for drafts, a
    finished batch row kept as a padding row: its root alone, never drafting again). Only this class writes its round
    and its row in the drafter's cache (`cache_row`, a `CacheRow`); it executes its part of the round's plan
    (`begin_round`, from `plan_round`); the loops say what happened (`prefill`, `keep_as_padding`, `move_to`) and
    read the round's kind and drafter depth (`round`, `eagle_depth`)."""

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
        # the drafter's cache, shared by a batch's rows (one row: its own), and this row in it
        self.state = state or (DraftState.for_drafter(drafter) if drafter is not None else DraftState())
        self.cache_row = CacheRow(slot=0 if row is None else row)
        self.copy = CopySource(settings.copy_ngram, settings.copy_length, settings.copy_branch_count,
                               functools.partial(marginal_cost, controller), settings.probe_every,
                               stop_tokens=stop_tokens) if settings.uses_copy else None
        self.depth = settings.depth  # the fixed (or heuristic) schedule's depth
        self.this_round = CurrentRound()

    # ------------------------------------------------------------------ the steps of a round
    def commit(self, aux: torch.Tensor, next_tokens: torch.Tensor, position: int) -> None:
        """Real rows for the drafter: target taps ``[1, n, A*H_t]`` at positions ``position..position+n-1`` and the
        token after each ``[1, n]``. They are read at the next draft (plain steps pile up; nothing runs now)."""
        if not self.settings.uses_eagle:
            return
        row = self.cache_row
        if not row.started:  # the first real row: where the drafter's positions start
            self.state.positions[row.slot], row.started = position, True
        row.pending.append((aux, next_tokens))

    def extend_context(self, tokens: Sequence[int]) -> None:
        """Tokens appended to the sequence (the prompt first): the copy source's index reads them."""
        if self.copy is not None:
            self.copy.index.extend(tokens)

    def begin_round(self, plan: RowPlan) -> None:
        """Execute this row's part of the round's plan (`plan_round`): the round's kind, and the copy branches the
        copy source grafts and learns from this round."""
        r = self.this_round
        r.kind, r.eagle_depth, r.drafter_levels = plan.kind, 0, 0  # (the drafter's, once it drafts: `draft_round`)
        if self.copy is not None:
            self.copy.begin_round(plan.branches, plan.copy_wait)
        if plan.refresh_drafter:
            self.controller.drafts_with_copies()

    def draft(self, root_token: int, depth: int, total_tokens: int, choose: Chooser | None = None,
              marks: dict | None = None) -> DraftTree:
        """Catch up on the committed rows, grow this round's draft tree (a chain when top_k is 1), then graft
        the copy branches onto it, read on the host (`draft_round` for a single row)."""
        out = draft_round([self], [root_token], [depth], [total_tokens], marks, choose=choose)
        self.this_round.tree = out[0] if isinstance(out, list) else out.settle(out.read())[0][0]
        return self.this_round.tree

    @property
    def round(self) -> Round:
        """This round's kind."""
        return self.this_round.kind

    @property
    def eagle_depth(self) -> int:
        """The drafter's depth this round (0: only copy branches, or a plain step)."""
        return self.this_round.eagle_depth

    @property
    def copying(self) -> bool:
        """Whether this round verifies copy branches."""
        return self.this_round.kind == Round.DRAFT and self.copy is not None and bool(self.copy.branches)

    @property
    def drafter_prefill(self) -> bool:
        """Whether this round's catch-up is a prefill of the drafter: it reads rows of rounds it did not draft in
        (the prompt, plain steps), not a regular round's accepted tokens (nor its cost)."""
        return self.this_round.eagle_depth > 0 and not self.cache_row.after_cycle

    def prefill(self) -> None:
        """The target reads the prompt this round: nothing to draft."""
        self.this_round.kind = Round.PREFILL

    def keep_as_padding(self) -> None:
        """This row has finished but stays in the batch (a cheaper forward): its root alone from now on."""
        self.this_round.kind = Round.PADDING

    def move_to(self, slot: int) -> None:
        """Rows left the batch: this row is now `slot` in the shared drafter cache."""
        self.cache_row.slot = slot

    def end_round(self, accepted: int, last_token: int, path: list[int] | None = None, cut: bool = False,
                  tree: DraftTree | None = None) -> RoundRecord | None:
        """The round's outcome, after the target verified (or decoded plainly), as one `RoundRecord` for its
        readers: the stats, the schedule, the copy source, the listeners (None after the prefill).

        path: the accepted node path (default: the first `accepted` drafts of a chain); cut: the round's tokens
        were cut at EOS or the length limit, so nothing after the accepted drafts was rejected; tree: the round's
        tree as verified (default: the one `draft` returned). A drafting round whose tree holds no draft (every
        branch fell below the confidence threshold) was a plain step."""
        r = self.this_round
        if r.kind == Round.PREFILL:
            return None
        r.tree = tree if tree is not None else r.tree
        if r.kind == Round.DRAFT and r.tree is not None and r.tree.num_drafts == 0:
            r.kind = Round.FALLBACK
        drafting = r.kind == Round.DRAFT
        record = RoundRecord(r.kind, accepted, last_token, self.row, r.tree if drafting else None,
                             (path if path is not None else list(range(accepted + 1))) if drafting else [0], cut,
                             r.eagle_depth if drafting else 0)
        self.stats.read(record)
        if drafting and record.eagle_depth > 0:
            self._learn_drafter(record)
        if drafting and self.copy is not None and self.copy.branches:
            self.copy.update(record.taken)
        if drafting and self.copy is not None and record.accepted:  # (whose draft was accepted first: its
            # branches come first in the next layout)
            self.copy.leads = bool(record.tree.host.sources[record.path[1]] & COPY)
        self.cache_row.after_cycle = drafting and record.eagle_depth > 0
        if self.listeners:
            drafts, sources = record.shown()
            for listener, keywords in self.listeners:
                extra = {"sources": sources, "row": self.row}
                listener(drafts, accepted, last_token, **{k: v for k, v in extra.items() if k in keywords})
        return record

    def _learn_drafter(self, record: RoundRecord) -> None:
        """The drafter's own outcome (its nodes only) for the adaptive controller and the heuristic schedule."""
        drafted, mine = record.drafter_outcome
        if self.controller is not None and drafted:
            seeded = self.controller.acceptance.seeded
            self.controller.update(drafted, mine, None if seeded else record.tree.confidences())
        if self.settings.schedule.startswith("heuristic"):
            self.depth = min(self.depth + 2, MAX_DEPTH) if mine == drafted else max(1, self.depth - 1)


# ------------------------------------------------------------------ the round's plan
@dataclass
class RowPlan:
    """One row's part of a round's plan: its `kind` (a drafting round, a plain step the schedule chose, one without
    room for drafts, a padding row); the drafter's `depth` (0: it rests); the tree's `size` (total tokens, cut to
    what the depth can fill and to the row's room); the copy `branches` grafted at the root, and what the copy
    source's proposal does to its wait (`copy_wait`: it sat the round out, or retries); whether the drafter's round
    counts as a retry of it (`refresh_drafter`)."""

    kind: Round
    depth: int = 0
    size: int = 1
    branches: list[Branch] = field(default_factory=list)
    copy_wait: Wait | None = None  # what the copy source's proposal does to its wait (`CopySource.begin_round`)
    refresh_drafter: bool = False  # the drafter joins copies though a round of its own would not pay: its
    # estimates are refreshed as a retry's are (`DraftLengthController.drafts_with_copies`)


@dataclass
class RoundPlan:
    """A round's plan for its rows (in the batch's row order). `kind`: a batch's drafting round as its timed rounds
    key it, (the drafter's depth, whether copy branches join) (`DraftLengthController.kind`; None: a single row's
    round, or none planned)."""

    rows: list[RowPlan]
    kind: tuple[int, bool] | None = None

    @property
    def depths(self) -> list[int]:
        return [r.depth for r in self.rows]

    @property
    def sizes(self) -> list[int]:
        return [r.size for r in self.rows]


def plan_round(speculators: Sequence, rooms: Sequence[int | None], fits: int | None = None,
               batch: bool = False) -> RoundPlan:
    """This round's plan for the rows (`Speculator`s, verified together), which then execute it. `rooms`: each
    row's drafts that still fit before its length limit (None: a padding row, its root alone); `fits`: the slots a
    tree may take (a static cache's free slots, or short of Llama 4's query-scale step; None: no limit); `batch`: the
    call decodes several rows, whose shared schedule chooses once for all of them, even once they finish down to one
    (it then decides as one row: `DraftLengthController.batched`). Each row's tree is sized by its settings' tree
    budget (`DraftSettings.tree_sizes`)."""
    controller = speculators[0].controller
    if controller is not None:
        controller.costs.rows = len(speculators)
    planned = controller.choose() if controller is not None and batch else None
    rows = []
    for sp, room in zip(speculators, rooms):
        row = RowPlan(Round.PADDING) if room is None else plan_row(sp, room, planned)
        if room is not None:  # (the verify reads the row's whole size: no more than its depth can fill)
            row.size = min(sp.settings.tree_sizes[row.depth], room + 1, room + 1 if fits is None else fits)
        rows.append(row)
    if fits is not None:  # copy branches are not sized by the tree budget: they take the slots the trees leave
        largest = max((row.size for row in rows if row.kind == Round.DRAFT and row.depth > 0), default=1)
        for row in rows:
            row.branches = cut_branches(row.branches, fits - largest)
            if row.kind == Round.DRAFT and not (row.depth or row.branches):
                row.kind = Round.FINAL  # (no room for a copy)
    for sp, row in zip(speculators, rows):
        sp.begin_round(row)
    return RoundPlan(rows, None if planned is None else controller.kind)


def plan_row(sp, room: int, planned: int | None = None) -> RowPlan:
    """One row's part of the round: the drafter's depth and the copy branches; a plain step where neither drafts.
    `room`: drafts that still fit before the length limit; `planned`: the depth a batch's schedule chose for its
    rows this round."""
    settings, controller, copy = sp.settings, sp.controller, sp.copy
    wanted = sp.depth  # the fixed (or heuristic) schedule's depth
    if not settings.uses_eagle:
        wanted = 0
    elif planned is not None:
        wanted = planned
    elif controller is not None:
        wanted = controller.choose()
    depth = max(min(wanted, room), 0)
    branches, wait, refresh = [], None, False
    copies = CopyAction.DRAFT if controller is None else controller.copy_branches(
        None if planned is None else depth)  # (a batch's plan: `DraftLengthController.copy_branches`)
    if copy is not None and copies != CopyAction.REST:
        paying = copies == CopyAction.DRAFT
        # a batch where drafting does not pay retries its rows' copies together, in the controller's retry
        # rounds: one row's retry widens every row's round
        retry = None if paying or planned is None else planned > 0
        # sized by their own acceptance, as copy drafting alone sizes them
        proposal = copy.propose(room, retry_only=not paying, retry=retry)
        branches, wait = proposal.branches, proposal.wait
        # the controller rests the drafter where a round of its own would not pay; where copies draft anyway
        # it costs only its marginal cost with them (its levels, its catch-up, a few more verified tokens)
        with_copies_only = bool(depth == 0 and branches and planned is None and controller is not None
                                and settings.uses_eagle)
        if with_copies_only:
            depth = min(controller.best()[0], room)
        if depth > 0 and branches and retry is None:  # (a batch's retry round retries the drafter too)
            drafter, copying = sources_that_pay(controller, proposal, depth)
            if with_copies_only:  # it joins the copies or rests (alone it does not pay)
                depth = depth if drafter and copying else 0
                refresh = depth > 0
            else:
                depth = depth if drafter else 0
                if not copying and wait != Wait.RESTART:
                    branches = []  # (they rest; a retry drafts, to refresh their estimates)
    kind = Round.DRAFT if depth > 0 or branches else (Round.FALLBACK if wanted <= 0 else Round.FINAL)
    return RowPlan(kind, depth, branches=list(branches), copy_wait=wait, refresh_drafter=refresh)


def sources_that_pay(controller, proposal: Proposal, depth: int) -> tuple[bool, bool]:
    """(drafter, copies): who drafts this round, of the drafter's tree of `depth` and the copy source's `proposal`
    (its branches, with what it expects of them): the plan with the most tokens per cost, of the copies alone, the
    drafter alone and both (tokens and costs in one-token target forwards, from running acceptances and measured
    costs). The drafter's
    drafts add tokens to the copies' tokens where every copy's first token is rejected; it costs its levels, its
    catch-up and the wider verify. Where copies stream the drafter waits; where copies keep missing the drafter
    drafts alone."""
    if controller is None:
        return True, True
    c, acceptance = controller.costs, controller.acceptance
    nodes = 1 + sum(len(b.tokens) for b in proposal.branches)  # the copy round's verified tokens, root included
    eagle = c.verified(depth) - 1  # the drafter's nodes
    round_cost = c.cycle_overhead + c.loop_overhead  # what every drafting round pays
    drafter_cost = depth * c.draft_step + c.round_overhead
    copies = 1.0 + proposal.expected, c.verify_cost(nodes) + round_cost
    drafter = acceptance.expected_tokens(depth), c.verify_cost(1 + eagle) + drafter_cost + round_cost
    both = (copies[0] + proposal.missed * (drafter[0] - 1.0),
            c.verify_cost(nodes + eagle) + drafter_cost + round_cost)
    plans = {(False, True): copies, (True, False): drafter, (True, True): both}
    return max(plans, key=lambda p: plans[p][0] / plans[p][1])


# ------------------------------------------------------------------ drafting it
def marginal_cost(controller: DraftLengthController | None, verified: int) -> float:
    """Extra cost of verifying one more token on top of `verified`, in tokens a plain step yields for the same
    cost. In a batch a longer tree pads every row's to its size: the whole batch pays for it. (A function of the
    controller, not a bound method: the copy source keeps it, and a speculator it pointed back to would make a
    reference cycle that keeps the drafter's cache alive until the garbage collector runs.)"""
    if controller is None:
        return DEFAULT_MARGINAL_COST
    c = controller.costs  # a secant over 8 tokens: single-token steps of measured times are noisy
    step = max((c.verify_cost(verified + 8) - c.verify_cost(verified)) / 8, 0.0)
    return step * c.rows / c.verify_cost(1)


def draft_round(speculators: Sequence[Speculator], roots: list[int], depths: list[int], total_tokens: list[int],
                marks: dict | None = None, positions: list[int] | None = None, pad: Callable[[int], int] | None = None,
                choose: Chooser | None = None, beside: bool = False) -> list[DraftTree] | PendingTrees:
    """Step "draft" of one round for the rows of a batch that share a drafter cache, in its row order (a single
    row: `Speculator.draft`). Every row with committed rows catches them up in one drafter forward; the rows with
    a depth grow their trees together and lay them out for the verify, on the device (`draft_trees`): the round's
    `PendingTrees`, with each row's copy branches (known on the host before the round) beside them. A round in
    which no row drafts with the drafter has its trees on the host (the root, with its copy branches). A row not in
    a drafting round (`round` is not `Round.DRAFT`) keeps the root alone.

    `marks`: the round's named marks on the timer (`eagle_hf.speculation.rounds.RoundTiming`); `positions`: each
    row's root position in the target's cache (the verify's); `pad`: the verify's width for trees of n nodes
    (default n); `choose`: the drafter's children's choice (a sampling chain's, one row); `beside`: the verify
    reads the layout as it is, so the copy branches are laid out in it beside the drafter's nodes (else the host
    grafts them onto the trees it reads: `PendingTrees.settle`). The copy branches are the plan's (`plan_round`:
    cut to a static cache's room there)."""
    first = speculators[0]
    state, timer, s = first.state, first.timer, first.settings
    drafting = [i for i, sp in enumerate(speculators) if sp.this_round.kind == Round.DRAFT and depths[i] > 0]
    copies = [sp.copy.tree if sp.copying else None for sp in speculators]  # (the plan's, on the host)
    for i, sp in enumerate(speculators):
        sp.this_round.eagle_depth = depths[i] if i in drafting else 0
    if not drafting:
        return [c or DraftTree.root(r) for c, r in zip(copies, roots)]
    if marks is not None:
        marks["draft"] = timer.mark()
    # the catch-up and the levels as one program where the levels run as one: the catch-up padded to a regular
    # round's rows (depth + 1), so that its rounds share one
    staged = max(depths) + 1 if state.graphs is not None and choose is None else None
    logits, hidden = _catch_up(speculators, staged)  # [B, Vd], [B, 1, H]
    if marks is not None and not (staged and state.staged()):  # (a staged catch-up's time is the
        # levels')
        marks["caught_up"] = timer.mark()
    largest = max(total_tokens[i] for i in drafting)
    # the copy nodes a row adds, where the layout holds them
    extra = max((c.size - 1 for c in copies if c is not None), default=0) if beside else 0
    order = sorted(range(len(speculators)), key=lambda i: speculators[i].cache_row.slot)  # the cache's row order
    positions = positions or [0] * len(speculators)
    pad = pad or int
    width = pad(largest)  # the drafter's nodes a row, padded: one program a tree size, whatever the copies add
    if extra:  # (the copy branches after them, padded so that the verify's whole width is padded too)
        extra = pad(width + extra) - width
    copies_first = [c is not None and sp.copy.leads for c, sp in zip(copies, speculators)]  # (where the last
    # accepted draft was a copy's, the copies come first: an accepted copy path is then the first columns, moved
    # nowhere)
    request = TreeRequest(width, [roots[i] for i in order], [positions[i] for i in order],
                          [total_tokens[i] if i in drafting else 1 for i in order], [copies[i] for i in order], extra,
                          [copies_first[i] for i in order])
    steps = state.steps
    grown = draft_trees(first.drafter, state, logits, hidden, [depths[i] if i in drafting else 0 for i in order],
                        s.branching, request, s.confidence_threshold, prune=s.branching > 1, choose=choose)
    if marks is not None:
        marks["drafted"] = timer.mark()
    for i in drafting:
        speculators[i].this_round.drafter_levels = state.steps - steps
    return PendingTrees([sp.cache_row.slot for sp in speculators], roots, *grown, copies, width,
                        copies_first=copies_first if extra else None)


def _catch_up(speculators: Sequence[Speculator], staged: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' pending real rows through the drafter in one forward (padded to the longest): each row's last
    row's draft logits [B, Vd] and fed-back hidden state [B, 1, H]. Rows that each hold one piece of the same
    length are joined as they are (a round after a drafting round: no padding, no copy for a single row).
    `staged`: see `DraftState.extend`."""
    w = speculators[0].drafter.fc.weight
    pending = [sp.cache_row.pending for sp in speculators]
    counts = [sum(t.shape[1] for _, t in queued) for queued in pending]
    for sp, n in zip(speculators, counts):
        sp.cache_row.caught_up = n
    width = max(counts)
    if all(len(queued) == 1 for queued in pending) and min(counts) == width:
        pieces = [queued.pop() for queued in pending]
        aux = pieces[0][0] if len(pieces) == 1 else torch.cat([a for a, _ in pieces])  # [B, n, A*H_t]
        tokens = pieces[0][1] if len(pieces) == 1 else torch.cat([t for _, t in pieces])  # [B, n]
        return speculators[0].state.extend(speculators[0].drafter, aux.to(w.device, w.dtype), tokens.to(w.device), counts,
                                           staged)
    aux = w.new_zeros(len(speculators), width, speculators[0].drafter.fc.weight.shape[1])  # [B, n, A*H_t]
    tokens = torch.zeros(len(speculators), width, dtype=torch.long, device=w.device)  # [B, n]
    for b, queued in enumerate(pending):
        if queued:
            aux[b, : counts[b]] = torch.cat([a for a, _ in queued], 1)[0].to(w.device, w.dtype)
            tokens[b, : counts[b]] = torch.cat([t for _, t in queued], 1)[0].to(w.device)
            queued.clear()
    return speculators[0].state.extend(speculators[0].drafter, aux, tokens, counts, staged)


def _keywords(listener) -> set[str]:
    """The optional keywords (``sources``, ``row``) a listener takes."""
    try:
        return set(inspect.signature(listener).parameters) & {"sources", "row"}
    except (TypeError, ValueError):
        return set()


def round_facts(speculators, width: int, batch: bool = False, kind: tuple[int, bool] | None = None) -> dict:
    """What a round did, for its `RoundTiming` (`from_marks`'s facts; `tokens` follows after the verify): the
    rows (`Speculator`s, each after its draft step) verifying `width` tokens each, the drafter's rows and levels,
    copies; `batch`: the call decodes several rows; `kind`: the kind of drafting round a batch planned."""
    drafting = [sp for sp in speculators if sp.eagle_depth > 0]
    return dict(rows=len(speculators), width=width, drafting_rows=len(drafting),
                levels=max((sp.this_round.drafter_levels for sp in drafting), default=0),
                depth=max((sp.eagle_depth for sp in drafting), default=0),
                copies=any(sp.copying for sp in speculators), drafter_prefill=any(sp.drafter_prefill for sp in drafting),
                caught_up=max((sp.cache_row.caught_up for sp in drafting), default=0), batch=batch, kind=kind)
