"""Adaptive speculation: pick the draft length each cycle from measured costs and running acceptance.

Expected tokens per cycle with k drafts, given conditional acceptance a_i of draft position i:
``E(k) = 1 + sum_{j=1..k} prod_{i<=j} a_i``. A cycle costs one target forward over the verified tokens (k+1 for a
chain; up to ``1 + top_k + (k-1) * top_k**2`` for a tree of depth k) plus k drafts, all relative to a one-token
target forward on the current device: the verify costs and a drafter step from the cost model
(`eagle_hf.cost_model`: a prior, refined by the forwards the loop times), the drafter's catch-up and the decoding
loop's own per-round cost timed in the loop. Plain decoding yields 1 token per round. The controller drafts
``argmax_k E(k) / cost(k)`` and falls back to plain decoding (k = 0) when no k beats 1, probing again after
``probe_every`` plain steps; each failed probe doubles the wait (up to ``max_probe_every``), so a drafter that
never helps costs almost nothing. A drafter never tried drafts once first. Given the same measurements it makes
the same decisions.

A batch also keeps a *loss budget*: every round is timed, and a wide round (drafts or copy branches) that emitted
fewer tokens than plain rounds would have in its time adds the difference to the batch's loss (a wide round that
emitted more takes it off). The batch widens its rounds only while that loss stays within ``loss_budget`` of its
time so far: where drafting pays the loss is negative and nothing changes; where it does not, probes and copy
branches together cost at most a few per cent, whatever the models and the noise of single rounds say.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field

from .cost_model import CostModel

logger = logging.getLogger(__name__)


@dataclass
class DraftLengthController:
    """Chooses the draft length (chain) or depth (tree) of each cycle; 0 means decode this step plainly."""

    cost: CostModel
    max_draft: int = 8
    prior: float = 0.5  # acceptance assumed before anything is observed ...
    prior_weight: float = 2.0  # ... worth this many observations, so the first cycles move the estimate fast
    decay: float = 0.95  # weight of the past in the running acceptance estimates, once warmed up
    probe_every: int = 16  # plain steps before the first probe while falling back
    max_probe_every: int = 64  # each failed probe doubles the wait, up to this
    min_gain: float = 1.0  # start (or resume) drafting when the expected speedup exceeds this ...
    keep_gain: float = 0.95  # ... and keep drafting until it falls below this: noisy estimates do not flap
    tree: tuple[int, int] | None = None  # (top_k, total_tokens): cost trees of depth k instead of chains of k
    warmup: int = 8  # cycles observed at the first position before `keep_gain` (rather than `min_gain`) applies
    acceptance: list[float] = field(default_factory=list)
    round_overhead: float = 0.0  # drafter cost per drafting round besides the steps (catch-up, bookkeeping)
    loop_overhead: float = 0.1  # cost of every round outside the target forward and the drafter (the decoding
    # loop itself: logits processing, stopping criteria, cache bookkeeping); re-measured on plain rounds
    rows: int = 1  # rows verified together (a batch): each row's share of a forward over rows * n tokens
    cycle_overhead: float = 0.0  # what a drafting round of the tree loop costs beyond the modelled parts (its
    # per-node verification, tree masks, the cache's commit), measured on whole drafting rounds
    cycle_rate: float = 0.0  # measured tokens per second of a row in drafting rounds (0: none timed yet)
    plain_seconds: float = 0.0  # measured seconds of a plain round (0: none timed yet)
    plain_every: int = 16  # a batch's drafting rounds between two timed plain rounds: its verdict compares both
    rest: bool = False  # this round of a batch is plain for every source (copy branches rest too): it times a
    # plain round, or its loss budget is spent
    loss_budget: float = 0.03  # a batch widens rounds only while their measured loss is within this share of its time
    memory: float = 0.9  # weight of the past in the batch's timed drafting rounds: they judge over about ten
    # rounds, as single rounds vary by a quarter on a shared machine
    _seen: list[int] = field(default_factory=list)
    _cycle_tokens: float = 0.0  # decayed sums over the timed drafting rounds: tokens a row emitted ...
    _cycle_seconds: float = 0.0  # ... and their seconds
    _drafting: bool = True
    _plain_steps: int = 0
    _wait: int = 0
    _tried: bool = False  # whether a round drafted yet (the first round that does not pay probes instead)
    _since_plain: int = 0  # drafting rounds since the last plain one
    _elapsed: float = 0.0  # a batch's timed rounds: their seconds ...
    _loss: float = 0.0  # ... and the seconds its wide rounds lost against plain rounds (negative: gained)
    _recent: dict[str, deque] = field(default_factory=dict)  # overhead name -> its latest single-round values

    def __post_init__(self):
        if not self.acceptance:
            self.acceptance = [self.prior] * self.max_draft
        self._seen = [0] * len(self.acceptance)
        self._wait = self.probe_every

    @property
    def draft_step(self) -> float:
        """A drafter step, relative to the base forward (timed in the loop; the cost model's prior before)."""
        return self.cost.draft_step_cost

    def expected_tokens(self, k: int) -> float:
        total, run = 1.0, 1.0
        for a in self.acceptance[:k]:
            run *= a
            total += run
        return total

    def cycle_cost(self, k: int) -> float:
        if self.tree is None:
            verified = k + 1
        else:  # draft_tree: top_k candidates at depth 1, top_k * top_k at each further depth, best total_tokens kept
            top_k, total_tokens = self.tree
            verified = min(total_tokens, 1 + top_k + (k - 1) * top_k * top_k)
        return self.verify_cost(verified) + k * self.draft_step + self.round_overhead + self.cycle_overhead

    def verify_cost(self, n: int) -> float:
        """One row's share of the target forward when each of the batch's rows verifies n tokens: a forward over
        rows * n tokens costs about what one row's over as many tokens does, so a batch that already fills the
        device gains less from drafting (1 for a single row's plain step)."""
        return self.cost.forward(self.rows * n) / self.rows

    def best(self) -> tuple[int, float]:
        """(k, expected speedup over plain decoding) of the best draft length.

        A plain round costs verify_cost(1) + loop overhead and yields one token; a cycle costs cycle_cost(k) +
        loop overhead."""
        plain = self.verify_cost(1) + self.loop_overhead
        gains = [(k, self.expected_tokens(k) * plain / (self.cycle_cost(k) + self.loop_overhead))
                 for k in range(1, self.max_draft + 1)]
        return max(gains, key=lambda x: x[1])

    def relative_cost(self, k: int) -> float:
        """A drafting round of depth k, in plain rounds."""
        return (self.cycle_cost(k) + self.loop_overhead) / (self.verify_cost(1) + self.loop_overhead)

    def measured_gain(self) -> float | None:
        """Tokens per second of a batch's drafting rounds timed so far over those of plain rounds (measured, or
        modelled while none was timed); None before a drafting round was timed, and for a single row. The model
        picks the depth, the measurement has the last word on whether drafting pays at all."""
        if self.rows == 1 or self.cycle_rate <= 0 or self.cost.base_seconds <= 0:
            return None  # one row: its costs were measured on one row, and its tokens per round vary too much
            # (a copy round yields 1 token or 12) for a running rate to judge drafting as a whole
        plain = self.plain_seconds or (self.verify_cost(1) + self.loop_overhead) * self.cost.base_seconds * self.rows
        return self.cycle_rate * plain

    def drafting_pays(self) -> bool:
        """Whether the timed drafting rounds beat plain ones (True before any was timed): when they do not, copy
        branches wait for their probes too."""
        measured = self.measured_gain()
        return measured is None or measured >= self.keep_gain

    def choose(self) -> int:
        k, gain = self.best()
        measured = self.measured_gain()
        if measured is not None:
            gain = min(gain, measured)
        keep = self.keep_gain if self._seen[0] >= self.warmup else self.min_gain
        self.rest = False
        if (self.rows > 1 and not self.plain_seconds) or not self.within_budget():
            # a batch times a plain round before anything else (its losses are counted against it), and rests
            # while its loss budget is spent
            self.rest, self._since_plain = True, 0
            return 0
        if gain > (keep if self._drafting else self.min_gain):
            if self.rows > 1 and self._since_plain >= self.plain_every:
                # a batch times a plain round now and then: a plain round of many rows is not a one-row
                # forward times the rows, and without one the measured verdict would rest on that model
                self._since_plain, self.rest = 0, True
                return 0
            self._drafting, self._plain_steps, self._wait, self._tried = True, 0, self.probe_every, True
            self._since_plain += 1
            return k
        self._drafting = False
        if not self._tried:  # a drafter never tried is tried at once: its costs and acceptance are priors yet
            self._tried, self._plain_steps = True, 0
            return k
        if self._plain_steps >= self._wait * self.relative_cost(k):  # probe: draft once to refresh the estimates
            # (waiting longer the more a probe costs: in a big batch it pads every row's round)
            self._plain_steps, self._wait = 0, min(2 * self._wait, self.max_probe_every)
            return k
        self._plain_steps += 1
        self._since_plain = 0
        return 0

    def within_budget(self) -> bool:
        """Whether a batch's wide rounds have lost at most `loss_budget` of its time against plain rounds (always
        True for a single row, whose rounds are not accounted)."""
        return self._loss <= self.loss_budget * self._elapsed

    def account(self, seconds: float, tokens: float, wide: bool) -> None:
        """A batch's whole round, for its loss budget: `seconds` of wall time in which each row emitted `tokens`
        on average; `wide` when it verified drafts or copy branches (a drafter catching up included)."""
        self._elapsed += seconds
        if wide and self.plain_seconds:
            self._loss += seconds - tokens * self.plain_seconds

    def observe(self, timing) -> None:
        """A round's timings (`eagle_hf.rounds.RoundTiming`, one round late on a GPU): the schedule's one entry
        point for them. Whole rounds teach the loop's own costs (a drafter catching up on plain rounds' rows is
        neither a regular drafting round nor a plain one) and count against a batch's loss budget (every round:
        catching up is part of what drafting costs). The verify forward and drafter steps teach the cost model
        (`CostModel.observe`, called beside this by the loops: it also serves fixed schedules)."""
        t = timing
        if t.catch_up is not None and t.drafting_rows and not t.backlog:
            self.observe_drafter(t.catch_up / t.drafting_rows)
        if t.seconds is None:
            return
        if t.width > 1 and not t.backlog:
            self.observe_cycle_round(t.seconds, t.width, t.levels, t.tokens)
        elif not t.wide:
            self.observe_plain_round(t.seconds)
        if t.batch:
            self.account(t.seconds, t.tokens, t.wide)

    def observe_drafter(self, overhead_seconds: float) -> None:
        """A regular drafting round's drafter catch-up on the last cycle's rows (each drafting row's share)."""
        if self.cost.base_seconds > 0:
            self.round_overhead = self._robust("round_overhead", overhead_seconds / self.cost.base_seconds)

    def observe_cycle_round(self, seconds: float, width: int, steps: int, tokens: float) -> None:
        """Measured wall time of a whole drafting round of the tree loop: every row verified `width` tokens after
        `steps` drafter levels and emitted `tokens` on average. What the parts modelled above do not explain
        becomes `cycle_overhead`."""
        self._cycle_tokens = self.memory * self._cycle_tokens + tokens
        self._cycle_seconds = self.memory * self._cycle_seconds + seconds
        self.cycle_rate = self._cycle_tokens / max(self._cycle_seconds, 1e-9)  # a ratio of sums: steadier than
        # a running mean of single rounds' rates
        if self.cost.base_seconds > 0:
            share = seconds / self.cost.base_seconds / self.rows
            modelled = self.verify_cost(width) + steps * self.draft_step + self.round_overhead + self.loop_overhead
            self.cycle_overhead = self._robust("cycle_overhead", max(share - modelled, 0.0))

    def observe_plain_round(self, seconds: float) -> None:
        """Measured wall time of a whole plain round (target forward plus the decoding loop's own work)."""
        self.plain_seconds = self._robust("plain_seconds", seconds)
        if self.cost.base_seconds > 0:  # a batch's round: each row's share
            share = seconds / self.cost.base_seconds / self.rows
            self.loop_overhead = self._robust("loop_overhead", max(share - self.verify_cost(1), 0.0))

    def _robust(self, name: str, value: float) -> float:
        """An in-loop overhead's estimate: the median of its latest `OVERHEAD_WINDOW` single-round values. A round
        timed at a noisy moment (a shared machine's single rounds vary by a quarter) moves no decision; a running
        mean let one slow round steer the schedule for several rounds, and whole calls differ from process to
        process."""
        recent = self._recent.setdefault(name, deque(maxlen=OVERHEAD_WINDOW))
        recent.append(value)
        return statistics.median(recent)

    @property
    def seeded(self) -> bool:
        """Whether acceptance has been observed (after that, the drafter's confidences are not needed)."""
        return any(self._seen)

    def update(self, drafted: int, accepted: int, confidences: list[float] | None = None) -> None:
        """Positions < accepted were accepted, position `accepted` (if drafted) was rejected, later ones unseen.

        `confidences`: the drafter's own (conditional) probability of each draft. Before the first observation
        they replace the flat prior: a trained drafter's confidence tracks its acceptance, and an untrained one,
        whose drafts have probability ~1/vocabulary, is dropped after a single cycle instead of several."""
        if confidences and not self.seeded:
            for i in range(len(self.acceptance)):
                self.acceptance[i] = min(max(confidences[min(i, len(confidences) - 1)], 0.01), 0.99)
        self._tried = True
        for i in range(min(drafted, accepted + 1, len(self.acceptance))):
            hit = 1.0 if i < accepted else 0.0
            self._seen[i] += 1
            rate = max(1 - self.decay, 1 / (self._seen[i] + self.prior_weight))
            self.acceptance[i] += rate * (hit - self.acceptance[i])


#: single-round values an in-loop overhead's median is taken over
OVERHEAD_WINDOW = 9


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
