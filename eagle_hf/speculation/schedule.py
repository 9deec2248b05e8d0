"""What drafting is expected to gain, and each round's decision: the adaptive schedule.

Each round's draft depth (chain length or tree depth) comes from measured costs (`eagle_hf.speculation.costs`)
and running acceptance; 0 decodes the round plainly. What is estimated, each by one estimator:

* the drafter's acceptance per depth, and E(k), the tokens a round of depth k yields (`AcceptanceEstimate`; the
  copy source's acceptance moves by the same rule, `moved`);
* what a round of depth k costs, in one-token target forwards (`RoundCosts`, in `costs`);
* a batch's verdict from its own timed rounds (`LossBudget`), and its kind of drafting round (`BatchPlan`: its
  drafter alone, with copy branches in its tree, or copy branches alone);
* when a dropped source tries again (`Backoff`: a wait that doubles after each failed try; the drafter's retries,
  a batch's tries of the kinds it does not prefer and the copy source's retries are paced by it).

A batch decides otherwise than a single row in a few places (`DraftLengthController.batched`): a single row's costs
were measured on that row, and its tokens per round vary too much (a copy round yields 1 token or 12) for a running
rate to judge a depth, so it decides from the models alone; a batch's rows pay for the widest row's tree, and a
plain round of many rows is not a one-row forward times the rows, so a batch times its rounds, lets them have the
last word over the models, times a plain round now and then, and chooses its kind of drafting round.

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
import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from enum import StrEnum

from .costs import CostModel, RoundCosts

logger = logging.getLogger(__name__)
__all__ = ["COPY", "EAGLE", "EAGLE_COPY", "MEASURED_ROUNDS", "CopyAction", "DraftLengthController", "Plan",
           "choose_tree_size"]

#: the most rows a retry's catch-up reads and still costs about what a regular round's does (one drafter forward
#: over a few rows; a fixed-shape catch-up pads them to a power of two): its time prices the drafter's catch-up
#: until a regular round is timed (`RoundCosts.observe_retry`). More rows: the prompt, a long rest
RETRY_ROWS = 16
#: observations per depth a call's estimate is worth when the next call of the process starts from it: a new text
#: moves it within a round or two, as a fresh prior would be moved
CARRY_WEIGHT = 1


def moved(value: float, hit: float, seen: int, prior_weight: float, decay: float) -> float:
    """A running acceptance rate after its `seen`-th outcome `hit` (1.0 accepted, 0.0 rejected): the mean of the
    outcomes and a prior worth `prior_weight` of them while they are few, then a decayed mean (`decay`: the weight of
    the past; the text changes, recent rounds say more). The one update rule of every acceptance estimate here and
    of the copy source's (`eagle_hf.speculation.copying.CopyAcceptance`)."""
    return value + max(1 - decay, 1 / (seen + prior_weight)) * (hit - value)


@dataclass
class AcceptanceEstimate:
    depth: int = 8  # depths estimated
    prior: float = 0.5  # acceptance assumed before anything is observed ...
    prior_weight: float = 2.0  # ... worth this many observations, so the first rounds move the estimate fast
    decay: float = 0.95  # weight of the past once warmed up: the text changes, recent rounds say more
    values: list[float] = field(default_factory=list)  # [depth] P(draft i accepted | draft i-1 accepted)
    seen: list[int] = field(default_factory=list)  # [depth] rounds observed at each depth

    def __post_init__(self):
        self.values = list(self.values) or [self.prior] * self.depth
        self.seen = self.seen or [0] * len(self.values)

    def expected_tokens(self, k: int) -> float:
        """E(k): tokens a round of depth k yields."""
        total, run = 1.0, 1.0
        for a in self.values[:k]:
            run *= a
            total += run
        return total

    def carried(self) -> AcceptanceEstimate:
        """This estimate as the start of the process's next call: its values, each depth's observations capped at
        `CARRY_WEIGHT` (the drafter's confidences no longer seed a depth that was observed). A call starting from
        the flat prior (or the first round's confidences) spends its first rounds relearning what the last call
        knew: on translation the trained drafter's confidences promise deep trees, and several rounds of depth 5
        yield one token each before the estimate falls to depth 1."""
        return replace(self, values=list(self.values), seen=[min(n, CARRY_WEIGHT) for n in self.seen])

    @property
    def seeded(self) -> bool:
        """Whether acceptance has been observed (after that, the drafter's confidences are not needed)."""
        return any(self.seen)

    def update(self, drafted: int, accepted: int, confidences: list[float] | None = None) -> None:
        """Depths < accepted were accepted, depth `accepted` (if drafted) was rejected, deeper ones unseen.

        `confidences`: the drafter's own (conditional) probability of each draft. Before the first observation
        they replace the flat prior: a trained drafter's confidence tracks its acceptance, and an untrained one,
        whose drafts have probability ~1/vocabulary, is dropped after a single round instead of several."""
        if confidences and not self.seeded:
            for i in range(len(self.values)):
                self.values[i] = min(max(confidences[min(i, len(confidences) - 1)], 0.01), 0.99)
        for i in range(min(drafted, accepted + 1, len(self.values))):
            self.seen[i] += 1
            self.values[i] = moved(self.values[i], float(i < accepted), self.seen[i], self.prior_weight, self.decay)


#: the share of the time a dropped source's retries may be expected to lose: a retry comes once the rounds sat out
#: since the last one would absorb its expected loss at this share (halved with each failed retry)
RETRY_SHARE = 0.01
#: the most plain rounds a dropped drafter's try is priced at, whatever the costs say (a batch's try pads every
#: row's round: a few plain rounds): a try comes at the latest after this many times the retry's wait
MOST_TRY_COST = 4.0


@dataclass
class Backoff:
    every: int = 16  # rounds sat out before the first retry
    most: int = 64  # the longest wait
    wait: int = 0  # the current wait (0: `every`)
    skipped: int = 0  # rounds sat out since the count last started

    def __post_init__(self):
        self.wait = self.wait or self.every

    def due(self, scale: float = 1.0) -> bool:
        """Whether the source has sat out its wait (times `scale`: a costlier retry waits longer)."""
        return self.skipped >= self.wait * scale

    def absorbs(self, loss: float, share: float) -> bool:
        """Whether the rounds sat out absorb a retry's expected `loss` (in rounds) at `share` of their time: a
        cheap retry comes soon. The share halves as the wait doubles: a source whose retries keep failing waits
        longer however little they cost."""
        return self.skipped * share * self.every / self.wait >= loss

    def skip(self) -> None:
        """The source sat out a round."""
        self.skipped += 1

    def restart(self) -> None:
        """The source drafts this round (a retry or a regular round): the count starts again."""
        self.skipped = 0

    def failed(self) -> None:
        """A retry did not pay: the next wait is twice as long."""
        self.wait = min(2 * self.wait, self.most)

    def paid(self) -> None:
        """A retry paid: the wait is back to `every`."""
        self.wait = self.every


@dataclass
class DepthSums:
    """Decayed sums over the timed drafting rounds of one depth: the tokens a row emitted, the tokens the model
    expected of the same rounds, their seconds, and the rounds' weight (the decayed count)."""

    tokens: float = 0.0
    expected: float = 0.0
    seconds: float = 0.0
    weight: float = 0.0
    rounds: int = 0

    def add(self, memory: float, tokens: float, seconds: float, expected: float) -> None:
        self.tokens = memory * self.tokens + tokens
        self.expected = memory * self.expected + expected
        self.seconds = memory * self.seconds + seconds
        self.weight = memory * self.weight + 1.0
        self.rounds += 1


@dataclass
class LossBudget:
    share: float = 0.03  # the loss allowed, as a share of the batch's time
    plain_every: int = 16  # drafting rounds between two timed plain rounds
    memory: float = 0.9  # weight of the past in the timed drafting rounds' rate
    plain_seconds: float = 0.0  # a plain round's seconds (median of the latest; 0: none timed yet)
    since_plain: int = 0  # drafting rounds since the last plain one
    _cycles: dict[tuple[int, bool], DepthSums] = field(default_factory=dict)  # (the drafter's depth (0: copy
    # branches alone), whether copy branches were verified) -> its timed drafting rounds
    _elapsed: float = 0.0  # the batch's timed rounds: their seconds ...
    _loss: float = 0.0  # ... and the seconds its wide rounds lost against plain rounds (negative: gained)
    _plain: deque = field(default_factory=lambda: deque(maxlen=9))

    def within(self) -> bool:
        """Whether the wide rounds have lost at most `share` of the batch's time against plain rounds."""
        return self._loss <= self.share * self._elapsed

    def account(self, seconds: float, tokens: float, wide: bool) -> None:
        """A whole round: `seconds` of wall time in which each row emitted `tokens` on average; `wide` when it
        verified drafts or copy branches (a drafter catching up included)."""
        self._elapsed += seconds
        if wide and self.plain_seconds:
            self._loss += seconds - tokens * self.plain_seconds

    def observe_cycle(self, seconds: float, tokens: float, kind: tuple[int, bool] = (0, True),
                      expected: float = 0.0) -> None:
        """A timed drafting round in which each row emitted `tokens` on average (the model expected `expected`);
        `kind`: (the drafter's depth (0: copy branches alone), whether copy branches were verified)."""
        self._cycles.setdefault(kind, DepthSums()).add(self.memory, tokens, seconds, expected)

    def timed(self, rounds: int = 1) -> dict[tuple[int, bool], DepthSums]:
        """The kinds of drafting rounds timed at least `rounds` times."""
        return {d: c for d, c in sorted(self._cycles.items()) if c.rounds >= rounds}

    def observe_plain(self, seconds: float) -> None:
        self._plain.append(seconds)
        self.plain_seconds = statistics.median(self._plain)


#: timed rounds of a kind (a depth, with or without copy branches) before a batch's measured rate of it counts
MEASURED_ROUNDS = 2
#: a batch leaves its preferred kind of round (the drafter with copy branches) for another only where that one's
#: timed rounds beat it by this factor: copies' width is certain, their hits are not, and two rates over about ten
#: rounds differ by a few per cent by chance
KIND_MARGIN = 1.05


class Plan(StrEnum):
    """A batch's kind of drafting round, by its draft sources (as `draft_sources` names them): its drafter alone,
    its drafter and copy branches in one tree, copy branches alone (their timed rounds are `LossBudget` keys (depth, copies): (k, False), (k, True), (0, True))."""

    EAGLE = "eagle"
    EAGLE_COPY = "eagle+copy"
    COPY = "copy"


EAGLE, EAGLE_COPY, COPY = Plan.EAGLE, Plan.EAGLE_COPY, Plan.COPY


@dataclass
class KindTries:
    """A batch's tries of the kinds it does not prefer: the kind being tried, its rounds left and their depth; the
    drafting round each kind was last tried in (never tried: absent); its wide rounds of each kind so far."""

    kind: Plan | None = None
    left: int = 0
    depth: int = 0
    last: dict = field(default_factory=dict)
    rounds_of: dict = field(default_factory=dict)


class BatchPlan:
    """Which kind of drafting round a batch runs (`plan`), from its schedule's timed rounds and gains (the
    schedule passes itself to `choose`: no reference back to it, so a call's objects are freed by reference
    counting). `kind`: this round's kind as the batch's timed rounds key it, (the drafter's depth (0: copy branches
    alone), whether copy branches join it), where the plan chose it: the plan's rounds are timed as its own
    whatever its rows then drafted (copies alone where no row found a match: a plain round). `drafts`: whether the
    drafter drafts (False: copy branches alone); `copying`: whether copy branches draft (False: the drafter alone,
    the batch's only kind of drafting round)."""

    def __init__(self, probe_every: int, max_probe_every: int, drafts: bool = True, copying: bool = True):
        self.drafts, self.copying = drafts, copying
        self.backoff = Backoff(probe_every, max_probe_every)  # the tries of the kinds the batch does not prefer
        self.tries = KindTries()
        self.rounds = 0  # drafting rounds so far
        self.gains = {}  # kind -> its gain this round (None: not timed; `kind_gains`)
        self.copies_gain = None  # the timed rounds of copy branches alone this round (None: not timed)
        self.plan = None  # this round's kind (None: no drafting round; copy branches draft where their own timed
        # rounds pay)
        self.kind = None
        self.preferred = self.drafter_plan = EAGLE_COPY  # the kinds the timed rounds prefer, of all and of those
        # where the drafter drafts

    @property
    def copies(self) -> bool:
        """Whether copy branches join the drafter this round (where the rows have them)."""
        return self.plan != EAGLE

    def choose(self, s, k: int, gain: float) -> tuple[int, float]:
        """(k, gain) of this round's best draft, and its kind (`plan`): the drafter with copy branches in its tree
        (each row then drafts with the sources that pay for it), unless the drafter alone or copy branches alone
        beat it by `KIND_MARGIN` in their timed rounds; a kind is gained by its timed rounds where two were
        timed, at k or the deepest depth below for the drafter's, and the kinds not preferred are tried now and
        then (`try_kinds`). `s`: the schedule (`DraftLengthController`)."""
        self.copies_gain = copies = s.measured_gains().get((0, True))  # (read by `copy_branches`)
        if not self.copying:
            self.plan = EAGLE
            return k, gain
        if not self.drafts:  # copy branches alone: their timed rounds have the last word on whether they draft
            return k, gain if copies is None else min(gain, copies)
        self.gains = gains = self.kind_gains(s, k, gain, copies)

        def score(kind):  # (ties to the earlier kind: the drafter with copies first)
            return (gains[kind] or 0.0) / (1.0 if kind == EAGLE_COPY else KIND_MARGIN)

        self.drafter_plan = max((EAGLE_COPY, EAGLE), key=score)
        self.plan = self.preferred = max((self.drafter_plan, COPY), key=score)
        return k, gains[self.plan]

    @staticmethod
    def kind_gains(s, k: int, gain: float, copies: float | None) -> dict[str, float | None]:
        """The gain of each kind of drafting round at depth k (None: not timed): the drafter alone (`gain`, the
        schedule's `best`), with copy branches in its tree (the model's gain while none was timed) and copy
        branches alone."""
        timed = s.budget.timed(MEASURED_ROUNDS)
        eagle = any(0 < d <= k and not c and sums.expected for (d, c), sums in timed.items())
        both = {d: sums for (d, c), sums in timed.items() if c and 0 < d <= k and sums.expected}
        both_gain = s.timed_gain(k, max(both), both[max(both)]) if both else None
        return {EAGLE: gain if eagle else None, EAGLE_COPY: gain if both_gain is None else both_gain, COPY: copies}

    def try_kinds(self, k: int, paying: bool) -> int:
        """A drafting round at depth k: a kind the batch does not prefer is tried for `MEASURED_ROUNDS` rounds at
        one depth (the rounds a verdict needs, timed per depth), at once if it was never tried, else (while
        drafting pays) the kind tried longest ago whose try is due (`try_due`). Returns the round's depth."""
        t = self.tries
        self.rounds += 1
        if t.left > 0:
            t.left -= 1
            self.plan = t.kind
            return t.depth
        others = [kind for kind in (EAGLE, COPY, EAGLE_COPY) if kind != self.preferred]
        fresh = [kind for kind in others if self.gains[kind] is None and kind not in t.last]
        due = [kind for kind in sorted(others, key=lambda kind: t.last.get(kind, -1)) if self.try_due(kind)]
        if fresh or (paying and due):
            if not fresh:
                self.backoff.restart()
                self.backoff.failed()
            self.plan = t.kind = (fresh or due)[0]
            t.left, t.last[self.plan], t.depth = MEASURED_ROUNDS - 1, self.rounds, k
        else:
            self.backoff.skip()
        return k

    def try_due(self, kind: str) -> bool:
        """Whether a try of a kind not preferred is due: after the try's wait (16 drafting rounds, doubling with
        each try), once the rounds since the last try absorb its expected loss against the preferred kind (by
        their timed gains) at `RETRY_SHARE` of their time, as a dropped drafter's tries are paced, and at the
        latest after the longest wait. A kind close to the preferred one is tried every wait; one far below it
        seldom (batched translation: the drafter's own rounds at 1.0x plain beside copies alone at 2.4x, each try
        a loss of more than a round)."""
        p, gains = self.backoff, self.gains
        best, gain = gains[self.preferred] or 0.0, gains[kind]
        loss = MEASURED_ROUNDS * (max(1.0 - gain / best, 0.0) if gain is not None and best > 0 else 0.0)
        return p.due() and (p.absorbs(loss, RETRY_SHARE) or p.skipped >= p.most)

    def first_of_kind(self, timing) -> bool:
        """Whether a wide round is among the first `MEASURED_ROUNDS` of its kind (`EAGLE`, `EAGLE_COPY`, `COPY`) in
        this call: what a measured verdict on the kind needs, at most six rounds a call, so their loss is not held
        against the loss budget (else one losing try at the start of a call, a few plain rounds' time in, would
        spend it and rest every source for a dozen rounds)."""
        depth, copies = timing.kind or (timing.depth, timing.copies)
        kind = (EAGLE, EAGLE_COPY)[copies] if depth else COPY
        self.tries.rounds_of[kind] = self.tries.rounds_of.get(kind, 0) + 1
        return self.tries.rounds_of[kind] <= MEASURED_ROUNDS


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
    def batched(self) -> bool:
        """Whether this round's rows decide as a batch: rows verified together (`costs.rows`, which the tree loop
        sets each round: a batch whose rows finish down to one decides as a single row). A batch's timed rounds have
        the last word over the models, it times a plain round first and then every `plain_every` drafting rounds,
        and it chooses its kind of drafting round (`BatchPlan`); a single row decides from the models alone."""
        return self.costs.rows > 1

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
        timed = self._timed_depths() if self.batched else {}
        for k in gains:  # from the deepest depth timed at or below k: a batch's wide forwards are what the model
            # misjudges most, so a deeper round's shortfall says little of a shallower one (the model's own gain
            # there, until it was timed: the shallower rounds get their try)
            below = max((d for d in timed if d <= k), default=None)
            if below is not None:
                gains[k] = self.timed_gain(k, below, timed[below])
        return max(gains.items(), key=lambda x: x[1])

    def _timed_depths(self) -> dict:
        """A batch's drafter depths timed `MEASURED_ROUNDS` times without copy branches in its tree; where none was,
        with them: they overrule the model's gains (`best`)."""
        timed = {key: sums for key, sums in self.budget.timed(MEASURED_ROUNDS).items()
                 if 0 < key[0] <= self.max_draft and sums.expected}
        alone = {d: sums for (d, copies), sums in timed.items() if not copies}
        return alone or {d: sums for (d, _), sums in timed.items()}

    def _plan(self) -> tuple[int, float]:
        """(k, gain) of this round's best draft; a batch also chooses its kind of drafting round
        (`BatchPlan.choose`)."""
        k, gain = self.best()
        return self.kinds.choose(self, k, gain) if self.batched else (k, gain)

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
        return tokens / seconds * self.plain_seconds()

    def plain_seconds(self) -> float:
        """A batch's plain round in seconds: timed (`LossBudget.plain_seconds`), else modelled."""
        c = self.costs
        return self.budget.plain_seconds or c.plain * c.cost.base_seconds * c.rows

    def measured_gains(self) -> dict[tuple[int, bool], float]:
        """A batch's timed drafting rounds by kind, (the drafter's depth (0: copy branches alone), whether copy
        branches were verified), each timed at least `MEASURED_ROUNDS` times: their tokens per second over plain
        rounds' (`plain_seconds`). Empty for a single row (`batched`), and before the cost model has a time."""
        if not self.batched or self.costs.cost.base_seconds <= 0:
            return {}
        plain = self.plain_seconds()
        return {d: sums.tokens / max(sums.seconds, 1e-9) * plain for d, sums in self.budget.timed(MEASURED_ROUNDS).items()}

    def copy_branches(self, depth: int | None = None) -> CopyAction:
        """What copy branches do this round: a `CopyAction`. A
        single row's (`depth` None) draft: its own plan choice follows (`speculator.plan_row`). A batch's
        (`depth`: its drafter's this round) rest with every source (`rest`) and where its drafter drafts alone;
        they draft with its drafter and where they draft alone (`plan`); in a round where its drafter rests
        while nothing pays, they draft while their timed rounds alone beat plain ones (before any was timed too),
        else only retry."""
        if depth is None:
            return CopyAction.DRAFT
        if self.rest or (depth > 0 and not self.copies):
            return CopyAction.REST
        measured = self.kinds.copies_gain if self.batched else None
        draft = depth > 0 or self.plan == COPY or measured is None or measured >= self.keep_gain
        return CopyAction.DRAFT if draft else CopyAction.RETRY

    def choose(self) -> int:
        """This round's drafter depth (0: a plain round, or copy branches alone; `rest`: every source rests), and
        in a batch its kind of drafting round (`plan`)."""
        k = self._choose()
        batch = self.batched
        if batch and self.kinds.drafts and self.kinds.copying and k > 0:  # a kind not preferred, tried now and then
            k = self.kinds.try_kinds(k, paying=self._drafting)
        depth = 0 if self.plan == COPY else k
        self.kinds.kind = (depth, self.plan != EAGLE) if batch and self.plan is not None else None
        return depth

    def _choose(self) -> int:
        k, gain = self._plan()
        keep = self.keep_gain if self.acceptance.seen[0] >= self.warmup else self.min_gain
        self.rest = False
        batch, budget = self.batched, self.budget
        if (batch and not budget.plain_seconds) or not budget.within():
            return self._rest()  # a batch times a plain round before anything else, and rests while its loss
            # budget is spent
        if gain > (keep if self._drafting else self.min_gain):
            if batch and budget.since_plain >= budget.plain_every:
                return self._rest()  # a batch's plain round now and then
            self._drafting = self._tried = True
            self.backoff.paid()
            self.backoff.restart()
            self.budget.since_plain += 1
            return k
        self._drafting = False
        if self.plan == COPY:  # (nothing pays: the drafter tries alone or with copies, as it prefers)
            self.kinds.plan = self.kinds.drafter_plan
        untimed = batch and self.kinds.drafts and not any(d > 0 for d, _ in budget.timed(MEASURED_ROUNDS))
        if not self._tried or untimed:  # a drafter never tried is tried at once: its costs and acceptance are
            # priors yet (in a batch, until its rounds were timed: a batch's verdict is measured)
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
        again within a round or two: a drop decided on a few rounds' acceptance and costs measured a few per cent
        apart (as two processes measure them) is not kept for a whole call; a poor drafter waits. A try is priced
        at most `MOST_TRY_COST` plain rounds, so one comes whatever the costs say: the try measures them (a drafter
        step of 1000 s kept from a busy or poisoned store would otherwise never be timed again)."""
        cost = min(self.costs.relative_cost(k), MOST_TRY_COST)  # a try, in plain rounds
        loss = cost * max(1.0 - gain, 0.0)  # plain rounds a try is expected to lose
        return self.backoff.absorbs(loss, RETRY_SHARE) or self.backoff.due(cost)

    def drafts_with_copies(self) -> None:
        """The drafter drafts this round with copy branches, though a round of its own would not pay (its
        marginal cost with them does: `speculator.plan_row`): its estimates are refreshed as a retry's are."""
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
        if t.catch_up is not None and t.drafting_rows:
            if not t.drafter_prefill:
                c.observe_drafter(t.catch_up / t.drafting_rows)
            elif 0 < t.caught_up <= RETRY_ROWS:  # (a retry after a short rest, not the prompt)
                c.observe_retry(t.catch_up / t.drafting_rows)
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
