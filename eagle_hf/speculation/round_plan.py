"""A round's plan: for every row, who drafts, how deep and how wide, decided in one call before anything runs.

    plan_round(speculators, rooms) -> RoundPlan
        a batch's schedule chooses once for its rows (the drafter's depth, its kind of drafting round);
        then each row: the copy source proposes its branches (sized by their own expected gain), the drafter's
        depth is cut to the row's room, and the sources that pay for the row draft

The `Speculator` and its copy source then execute the plan (`Speculator.begin_round`: the round's kind, the copy
branches it grafts and learns from); the decoding loops read its depths and tree sizes. Nothing here runs a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .copying import Branch, Wait
from .rounds import Round
from .schedule import CopyAction


@dataclass
class RowPlan:
    """One row's part of a round's plan: its `kind` (a drafting round, a plain step the schedule chose, one without
    room for drafts, a padding row); the drafter's `depth` (0: it rests); the tree's `size` (total tokens, cut to
    the row's room); the copy `branches` grafted at the root, and what the copy source's proposal does to its wait
    (`copy_wait`: it sat the round out, or retries); whether the drafter's round counts as a retry of it
    (`refresh_drafter`)."""

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


def plan_round(speculators: Sequence, rooms: Sequence[int | None], total_tokens: int | None = None,
               fits: int | None = None, batch: bool = False) -> RoundPlan:
    """This round's plan for the rows (`Speculator`s, verified together), which then execute it. `rooms`: each
    row's drafts that still fit before its length limit (None: a padding row, its root alone); `total_tokens`: the
    tree budget (default: the settings'); `fits`: the slots a tree may take (a static cache's free slots, or short of
    Llama 4's query-scale step; None: no limit); `batch`: the call decodes several rows, whose shared schedule
    chooses once for all of them, even once they finish down to one (it then decides as one row:
    `DraftLengthController.batched`)."""
    controller = speculators[0].controller
    total_tokens = speculators[0].settings.total_tokens if total_tokens is None else total_tokens
    if controller is not None:
        controller.costs.rows = len(speculators)
    planned = controller.choose() if controller is not None and batch else None
    rows = []
    for sp, room in zip(speculators, rooms):
        row = RowPlan(Round.PADDING) if room is None else plan_row(sp, room, planned)
        if room is not None:
            row.size = min(total_tokens, room + 1, room + 1 if fits is None else fits)
        sp.begin_round(row)
        rows.append(row)
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
            drafter, copying = sources_that_pay(controller, copy, branches, depth)
            if with_copies_only:  # it joins the copies or rests (alone it does not pay)
                depth = depth if drafter and copying else 0
                refresh = depth > 0
            else:
                depth = depth if drafter else 0
                if not copying and wait != Wait.RESTART:
                    branches = []  # (they rest; a retry drafts, to refresh their estimates)
    kind = Round.DRAFT if depth > 0 or branches else (Round.FALLBACK if wanted <= 0 else Round.FINAL)
    return RowPlan(kind, depth, branches=list(branches), copy_wait=wait, refresh_drafter=refresh)


def sources_that_pay(controller, copy, branches: list[Branch], depth: int) -> tuple[bool, bool]:
    """(drafter, copies): who drafts this round, of the drafter's tree of `depth` and the copy source's proposed
    `branches`: the plan with the most tokens per cost, of the copies alone, the drafter alone and both
    (tokens and costs in one-token target forwards, from running acceptances and measured costs). The drafter's
    drafts add tokens to the copies' tokens where every copy's first token is rejected; it costs its levels, its
    catch-up and the wider verify. Where copies stream the drafter waits; where copies keep missing the drafter
    drafts alone."""
    if controller is None:
        return True, True
    c, acceptance = controller.costs, controller.acceptance
    nodes = 1 + sum(len(b.tokens) for b in branches)  # the copy round's verified tokens, root included
    eagle = c.verified(depth) - 1  # the drafter's nodes
    round_cost = c.cycle_overhead + c.loop_overhead  # what every drafting round pays
    drafter_cost = depth * c.draft_step + c.round_overhead
    copies = 1.0 + copy.expected_tokens(branches), c.verify_cost(nodes) + round_cost
    drafter = acceptance.expected_tokens(depth), c.verify_cost(1 + eagle) + drafter_cost + round_cost
    both = (copies[0] + copy.missed(branches) * (drafter[0] - 1.0),
            c.verify_cost(nodes + eagle) + drafter_cost + round_cost)
    plans = {(False, True): copies, (True, False): drafter, (True, True): both}
    return max(plans, key=lambda p: plans[p][0] / plans[p][1])
