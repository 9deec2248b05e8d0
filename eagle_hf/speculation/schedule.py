"""The adaptive schedule: each round's draft depth (chain length or tree depth) from measured costs and running
acceptance; 0 decodes the round plainly.

Four parts, each in its own module, meet here:

* `AcceptanceEstimate` (`acceptance`): the drafter's running acceptance per depth, and E(k), the tokens a round of
  depth k yields;
* `RoundCosts` (`round_costs`): what a round of depth k costs, in one-token target forwards (the cost model's
  forwards plus the overheads the loop times);
* `Backoff` (`backoff`): the longest a dropped drafter waits before it tries again (a wait that doubles after each
  failed try);
* `LossBudget` (`loss_budget`): a batch's verdict from its own timed rounds;
* `BatchPlan` (`batch_plan`): a batch's kind of drafting round (its drafter alone, with copy branches in its tree,
  or copy branches alone), from its timed rounds of each kind.

What a batch decides otherwise than a single row (its timed rounds, its plain rounds, its kinds) is its policy's
(`policy`: `BatchPolicy`, `OneRowPolicy`), asked each round: the schedule itself has no batch branches.

The schedule drafts ``argmax_k E(k) / cost(k)`` (against a plain round's one token for its cost) while that beats
plain decoding, with hysteresis (start above `min_gain`, keep until below `keep_gain`, after a warm-up). When it does
not, a dropped drafter tries again once the rounds it sat out absorb a try's expected loss at `RETRY_SHARE` of
their time (just below break-even: within a round or two; a poor drafter waits, at most the retry's wait), so a
drafter that never helps costs about that share, and a drop decided on a few rounds is soon revisited; a drafter
never tried drafts once first. A round's timings enter through one door (`observe`), its acceptance through another
(`update`). Given the same measurements it makes the same decisions.
"""

from __future__ import annotations

import logging
from enum import StrEnum

from .acceptance import AcceptanceEstimate
from .backoff import RETRY_SHARE, Backoff
from .batch_plan import COPY, EAGLE, EAGLE_COPY, MEASURED_ROUNDS, BatchPlan, Plan
from .cost_model import CostModel
from .loss_budget import LossBudget
from .policy import BATCH, ONE_ROW, BatchPolicy, OneRowPolicy
from .round_costs import RoundCosts

logger = logging.getLogger(__name__)
__all__ = ["COPY", "EAGLE", "EAGLE_COPY", "MEASURED_ROUNDS", "CopyAction", "DraftLengthController", "Plan",
           "choose_tree_size"]


class CopyAction(StrEnum):
    """What copy branches do in a round: draft, only retry (in the retry rounds), or rest."""

    DRAFT = "draft"
    RETRY = "retry"
    REST = "rest"


class DraftLengthController:
    """Chooses the draft length (chain) or depth (tree) of each round; 0 means decode this round plainly.

    `tree`: (top_k, total_tokens) to cost trees of depth k instead of chains of k; `rows`: rows verified together;
    `acceptance`: the starting estimate, per depth or as an `AcceptanceEstimate` (the process's last call's,
    `AcceptanceEstimate.carried`; default: a flat prior); `drafts`: whether a drafter drafts
    (False: copy branches alone, which a batch's schedule times, rests and retries all the same); `copying`: whether
    copy branches draft (False: the drafter alone, a batch's only kind of drafting round)."""

    def __init__(self, cost: CostModel, max_draft: int = 8, probe_every: int = 16, max_probe_every: int = 64,
                 min_gain: float = 1.0, keep_gain: float = 0.95, tree: tuple[int, int] | None = None, rows: int = 1,
                 warmup: int = 8, acceptance: list[float] | AcceptanceEstimate | None = None, plain_every: int = 16,
                 loss_budget: float = 0.03, drafts: bool = True, copying: bool = True):
        self.max_draft = max_draft
        self.min_gain, self.keep_gain = min_gain, keep_gain  # start drafting above min_gain, keep until keep_gain
        self.warmup = warmup  # rounds observed at the first depth before `keep_gain` applies
        self.acceptance = (acceptance if isinstance(acceptance, AcceptanceEstimate)
                           else AcceptanceEstimate(max_draft, values=list(acceptance or [])))
        self.costs = RoundCosts(cost, tree=tree, rows=rows)
        self.backoff = Backoff(probe_every, max_probe_every)
        self.kinds = BatchPlan(probe_every, max_probe_every, drafts, copying)  # a batch's kind of drafting round
        self.budget = LossBudget(share=loss_budget, plain_every=plain_every)
        self.rest = False  # this round of a batch is plain for every source (copy branches rest too): it times a
        # plain round, or its loss budget is spent
        self._drafting = True
        self._tried = self.acceptance.seeded  # whether the drafter's acceptance was observed (in this call or the
        # last one it starts from): a drafter never tried drafts once first, a known one only where its rounds pay

    @property
    def policy(self) -> OneRowPolicy | BatchPolicy:
        """The decisions of this round's rows: a batch's where rows are verified together (`costs.rows`, which the
        tree loop sets each round: a batch whose rows finish down to one decides as a single row), else one row's."""
        return BATCH if self.costs.rows > 1 else ONE_ROW

    @property
    def plan(self) -> Plan | None:
        """This round's kind of drafting round in a batch (`BatchPlan.plan`; None: no drafting round)."""
        return self.kinds.plan

    @property
    def kind(self) -> tuple[int, bool] | None:
        """This round's kind as a batch's timed rounds key it (`BatchPlan.kind`)."""
        return self.kinds.kind

    @property
    def copies(self) -> bool:
        """Whether copy branches join a batch's drafter this round (where its rows have them)."""
        return self.kinds.copies

    def best(self) -> tuple[int, float]:
        """(k, expected speedup over plain decoding) of the best draft length: a plain round yields one token for
        `costs.plain`, a drafting round E(k) for its cycle cost plus the loop's. In a batch the drafter's timed
        rounds have the last word (`timed_gain`)."""
        gains = {k: self._gain(k) for k in range(1, self.max_draft + 1)}
        timed = self.policy.timed(self)
        for k in gains:  # from the deepest depth timed at or below k: a batch's wide forwards are what the model
            # misjudges most, so a deeper round's shortfall says little of a shallower one (the model's own gain
            # there, until it was timed: the shallower rounds get their try)
            below = max((d for d in timed if d <= k), default=None)
            if below is not None:
                gains[k] = self.timed_gain(k, below, timed[below])
        return max(gains.items(), key=lambda x: x[1])

    def _plan(self) -> tuple[int, float]:
        """(k, gain) of this round's best draft; a batch also chooses its kind of drafting round
        (`BatchPolicy.plan`)."""
        return self.policy.plan(self, *self.best())

    def _gain(self, k: int) -> float:
        """The model's gain at depth k."""
        c = self.costs
        return self.acceptance.expected_tokens(k) * c.plain / (c.cycle_cost(k) + c.loop_overhead)

    def timed_gain(self, k: int, d: int, timed) -> float:
        """A batch's gain at depth k from its rounds timed at depth d <= k (`LossBudget.timed`), against its timed
        plain rounds. Tokens: the model's E(k), scaled by what d's rounds yielded over what the model expected of
        them (copy branches with the drafter, an acceptance model off for this text); the acceptance the model
        tracks round by round stays its own, so a stretch of poor rounds is not kept once the drafter rests.
        Seconds: d's timed rounds, scaled along the model from d to k (a plain round of many rows, or a wide
        one, is not what one row's forwards say)."""
        c = self.costs
        tokens = self.acceptance.expected_tokens(k) * timed.tokens / timed.expected
        seconds = timed.seconds / timed.weight * ((c.cycle_cost(k) + c.loop_overhead)
                                                  / (c.cycle_cost(d) + c.loop_overhead))
        plain = self.budget.plain_seconds or c.plain * c.cost.base_seconds * c.rows
        return tokens / seconds * plain

    def measured_gains(self) -> dict[tuple[int, bool], float]:
        """A batch's timed drafting rounds by kind, (the drafter's depth (0: copy branches alone), whether copy
        branches were verified): their tokens per second over plain rounds' (`BatchPolicy.measured_gains`). Empty
        for a single row: its costs were measured on one row, and its tokens per round vary too much (a copy round
        yields 1 token or 12) for a running rate to judge a depth."""
        return self.policy.measured_gains(self)

    def copy_branches(self, depth: int | None = None) -> CopyAction:
        """What copy branches do this round: a `CopyAction`. A
        single row's (`depth` None) draft: its own plan choice follows (`round_plan.plan_row`). A batch's
        (`depth`: its drafter's this round) rest with every source (`rest`) and where its drafter drafts alone;
        they draft with its drafter and where they draft alone (`plan`); in a round where its drafter rests
        while nothing pays, they draft while their timed rounds alone beat plain ones (before any was timed too),
        else only retry."""
        if depth is None:
            return CopyAction.DRAFT
        if self.rest or (depth > 0 and not self.copies):
            return CopyAction.REST
        return CopyAction.DRAFT if self.policy.copies_draft(self, depth) else CopyAction.RETRY

    def choose(self) -> int:
        """This round's drafter depth (0: a plain round, or copy branches alone; `rest`: every source rests), and
        in a batch its kind of drafting round (`plan`)."""
        k = self._choose()
        k = self.policy.try_kinds(self, k)
        depth = 0 if self.plan == COPY else k
        self.kinds.kind = self.policy.kind(self, depth)
        return depth

    def _choose(self) -> int:
        k, gain = self._plan()
        keep = self.keep_gain if self.acceptance.seen[0] >= self.warmup else self.min_gain
        self.rest = False
        if self.policy.plain_first(self) or not self.budget.within():
            return self._rest()  # a batch times a plain round before anything else, and rests while its loss
            # budget is spent
        if gain > (keep if self._drafting else self.min_gain):
            if self.policy.plain_due(self):
                return self._rest()  # a batch's plain round now and then
            self._drafting = self._tried = True
            self.backoff.paid()
            self.backoff.restart()
            self.budget.since_plain += 1
            return k
        self._drafting = False
        if self.plan == COPY:  # (nothing pays: the drafter tries alone or with copies, as it prefers)
            self.kinds.plan = self.kinds.drafter_plan
        if not self._tried or self.policy.untimed(self):  # a drafter never tried is tried at once: its costs
            # and acceptance are priors yet (in a batch, until its rounds were timed: a batch's verdict is measured)
            self._tried = True
            self.backoff.restart()
            return k
        if self._retry_due(k, gain):  # retry: draft once to refresh the estimates
            self.backoff.restart()
            self.backoff.failed()  # (until a round pays again)
            return k
        self.backoff.skip()
        self.budget.since_plain, self.kinds.plan = 0, None
        return 0

    def _retry_due(self, k: int, gain: float) -> bool:
        """Whether a dropped drafter tries again this round (at depth k, expected to yield `gain` of a plain
        round's rate): once the rounds it sat out absorb the try's expected loss at `RETRY_SHARE` of their time
        (halved with each failed try), and at the latest after the retry's wait, longer the more a try costs (in
        a big batch it pads every row's round). A drafter just below break-even loses little by trying and tries
        again within a round or two:
        a drop decided on a few rounds' acceptance and costs measured a few per cent apart (as two processes
        measure them) is not kept for a whole call; a poor drafter waits."""
        cost = self.costs.relative_cost(k)  # a try, in plain rounds
        loss = cost * max(1.0 - gain, 0.0)  # plain rounds a try is expected to lose
        return self.backoff.absorbs(loss, RETRY_SHARE) or self.backoff.due(cost)

    def drafts_with_copies(self) -> None:
        """The drafter drafts this round with copy branches, though a round of its own would not pay (its
        marginal cost with them does: `round_plan.plan_row`): its estimates are refreshed as a retry's are."""
        self.backoff.restart()

    def _rest(self) -> int:
        self.rest, self.budget.since_plain, self.kinds.plan = True, 0, None
        return 0

    def observe(self, timing) -> None:
        """A round's timings (`eagle_hf.speculation.rounds.RoundTiming`, one round late on a GPU): the one door
        through which they enter. The verify forward and the drafter's levels teach the cost model; whole rounds
        teach the loop's own costs (a drafter catching up on plain rounds' rows is neither a regular drafting
        round nor a plain one), a batch's timed drafting rounds (by the kind its plan chose, whatever its rows
        then drafted; a round that caught up counts as the regular round it would have been: its catch-up's time
        replaced by a regular one's, so that a resting drafter's retries are timed) and its loss budget (every round as it was: catching up is part of what drafting
        costs)."""
        t, c = timing, self.costs
        c.cost.observe(t)
        if t.catch_up is not None and t.drafting_rows and not t.drafter_prefill:
            c.observe_drafter(t.catch_up / t.drafting_rows)
        if t.seconds is None:
            return
        kind = t.kind or (t.depth, t.copies)
        if t.width > 1 or t.kind:
            seconds = t.seconds
            if t.drafter_prefill and t.catch_up is not None:
                seconds += c.round_overhead * c.cost.base_seconds * t.drafting_rows - t.catch_up
            if not t.drafter_prefill or t.catch_up is not None:
                expected = self.acceptance.expected_tokens(kind[0]) if kind[0] else 0.0  # (what the model expected)
                self.budget.observe_cycle(seconds, t.tokens, kind, expected)
            if not t.drafter_prefill and t.width > 1:
                c.observe_cycle(t.seconds, t.width, t.levels)
        if not t.wide:
            self.budget.observe_plain(t.seconds)
            c.observe_plain(t.seconds)
        if t.batch:
            self.budget.account(t.seconds, t.tokens, t.wide and not self.kinds.first_of_kind(t))

    def update(self, drafted: int, accepted: int, confidences: list[float] | None = None) -> None:
        """A drafting round's outcome for the drafter: see `AcceptanceEstimate.update`."""
        self._tried = True
        self.acceptance.update(drafted, accepted, confidences)


#: tree sizes tried by the automatic choice, and the acceptance gain a bigger tree is assumed to buy (relative
#: to the smallest), as the EAGLE reference's `total_token=-1` tuning does
TREE_SIZES = (8, 12, 16, 24, 32)
TREE_GAINS = (1.0, 1.04, 1.07, 1.10, 1.13)


def choose_tree_size(cost: CostModel) -> int:
    """`total_tokens` with the best assumed gain per measured verify cost (needs costs up to 32 tokens)."""
    best, best_value = TREE_SIZES[0], 0.0
    for size, gain in zip(TREE_SIZES, TREE_GAINS):
        value = gain / cost.forward(size)
        if value > best_value:
            best, best_value = size, value
    return best
