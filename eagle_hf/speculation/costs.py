"""What drafting costs on one device: what is measured, and the prices the schedule reads from it.

The adaptive schedule weighs tokens against costs. Costs are relative to one *base* forward (the target over one
token of one row), so that a schedule reads the same on any device; `base_seconds` converts timings.

`CostModel`: the target's forwards by size and the drafter's step. Nothing is measured before the first token. A
model starts from a prior: the verify curve of a device kind (on a GPU a forward over 64 tokens costs about what
one over a single token does; on a CPU each token adds a share), or the estimates an earlier process kept
(`as_dict` / `from_dict`, persisted by `eagle_hf.hf.costs`). Every timed forward then adds an observation at its
size (tokens over all rows): the estimate of a size is the fastest of its last few observations (interference on
a shared machine only ever adds time; a one-off slow round does not steer the schedule), and sizes not observed
follow the prior's shape, scaled to the observed sizes around them.

Estimates read back are claims this process checks: `from_dict` refuses an entry that is not what `as_dict`
writes (types, shapes, finite positive values in sane ranges), and the estimates it inherits are forgotten, all
together, as soon as this process's own timings contradict one of them: a size (or the drafter step) it kept, timed
here `CONTRADICTS` times faster (noise only adds time: at once) or, at the fastest of its first `SLOWER_TIMES`
timings here, `CONTRADICTS` times slower (one slow first round is no contradiction); a size between those it kept,
`DRIFT` times off the line between them. An earlier process under heavy load, another machine state, a crafted
file: the model then learns as one that started from its prior. A schedule that stops drafting still tries a
draft now and then (`eagle_hf.speculation.schedule.MOST_TRY_COST`), so the claims about drafting are checked too.

`RoundCosts`: what a round costs, in one-token target forwards of one row. A drafting round of depth k costs one
target forward over the verified tokens (k + 1 for a chain; up to ``1 + top_k + (k-1) * top_k**2`` for a tree of
depth k, at most its total), k drafter steps, the drafter's catch-up (`round_overhead`), what a drafting round of
the tree loop costs beyond the modelled parts (`cycle_overhead`: per-node verification, tree masks, the cache's
commit) and the decoding loop's own cost that every round pays (`loop_overhead`: logits processing, stopping
criteria). The forwards and drafter steps come from the `CostModel`; the three overheads are timed in the loop,
each the median of its latest rounds: a round timed at a noisy moment moves no decision.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from .settings import most_nodes

logger = logging.getLogger(__name__)

#: a size's estimate is the fastest of this many of its latest observations
WINDOW = 8
#: relative cost of each token beyond the first, by device kind, before anything was observed: a GPU verifies
#: tens of tokens in the time of one; a CPU pays a share per token (0.03-0.2 on this project's hosts). Low
#: rather than high: a schedule that believes drafting pays drafts, and its first round corrects the belief
PRIOR_PER_TOKEN = {"cuda": 0.004, "cpu": 0.05}
PRIOR_PER_TOKEN_OTHER = 0.02
#: a drafter step before one was timed, relative to the base forward (a one-layer drafter)
PRIOR_DRAFT_STEP = 0.1
#: estimates read back are forgotten once a size (or the drafter step) they kept is timed here this many times
#: faster, or its fastest of `SLOWER_TIMES` timings here is this many times slower (a first round's one-off costs
#: aside): a busy machine's costs, three times this one's, no longer keep a quiet one from drafting
CONTRADICTS = 1.5
SLOWER_TIMES = 2
#: ... or a size between those kept is timed this many times off the line between them (sizes differ in shape)
DRIFT = 4.0
#: what an entry read back may hold (`from_dict`): prior curves of at most this many sizes, relative costs within
#: these bounds, sizes up to this many tokens, times within these seconds
MAX_PRIOR_SIZES = 4096
RELATIVE_RANGE = (1e-3, 1e3)
MAX_TOKENS = 1 << 20
SECONDS_RANGE = (1e-7, 3600.0)
#: single-round values an in-loop overhead's median is taken over
OVERHEAD_WINDOW = 9


#: the drafter step's key among the quantities checked (`CostModel._check`)
STEP = "step"


class CostEntryError(ValueError):
    """Learnt costs read back that are not what `CostModel.as_dict` writes; the message names the field."""


@dataclass
class CostModel:
    """Relative costs on one device. ``verify[n-1]``: the prior of a target forward over n tokens (beyond the
    list: extrapolated along the secant of its upper half); `draft_step`: the prior of one drafter step;
    `base_seconds`: a one-token forward in seconds where known up front (0: learnt from observations)."""

    verify: list[float]
    draft_step: float
    base_seconds: float = 0.0
    _seen: dict[int, deque] = field(default_factory=dict, repr=False)  # tokens -> seconds of its latest forwards
    _draft_seen: deque = field(default_factory=lambda: deque(maxlen=WINDOW), repr=False)  # seconds per step
    _given_base: float = field(default=0.0, repr=False)
    _memo: dict[int, float] = field(default_factory=dict, repr=False)  # n -> forward(n) since the last observation
    _inherited: dict[int, float] = field(default_factory=dict, repr=False)  # tokens -> seconds read back (`from_dict`)
    _inherited_step: float = field(default=0.0, repr=False)  # seconds per drafter step read back (0: none)
    _checked: dict = field(default_factory=dict, repr=False)  # a size kept (or STEP) -> (its timings here, fastest)

    def __post_init__(self):
        self._given_base = self.base_seconds

    @classmethod
    def prior(cls, device_type: str, tokens: int = 64) -> CostModel:
        """The prior of a device kind (``"cuda"``, ``"cpu"``, ...): linear in the tokens."""
        per_token = PRIOR_PER_TOKEN.get(device_type, PRIOR_PER_TOKEN_OTHER)
        return cls(verify=[1.0 + per_token * i for i in range(tokens)], draft_step=PRIOR_DRAFT_STEP)

    # ------------------------------------------------------------------ observations
    def observe_forward(self, tokens: int, seconds: float) -> None:
        """A timed target forward over `tokens` tokens (all rows together)."""
        if tokens >= 1 and 0 < seconds < math.inf:
            if tokens in self._inherited:
                self._check(tokens, self._inherited[tokens], seconds, f"a forward over {tokens} tokens")
            elif self._inherited:
                self._check_between(self._predicted(tokens), seconds, f"a forward over {tokens} tokens")
            seen = self._seen.setdefault(tokens, deque(maxlen=WINDOW))
            before = min(seen) if seen else None
            seen.append(seconds)
            if min(seen) != before:  # (most observations change no estimate: the costs stay as they were)
                self._update_base()
                self._memo.clear()

    def observe(self, timing) -> None:
        """A round's timings (`eagle_hf.speculation.rounds.RoundTiming`): its verify forward, and its drafter's level
        forwards unless the drafter caught up on plain rounds' rows (each drafting row's share of one). Those only
        check an inherited step (`check_draft_step`): after a drop every retry is such a round."""
        if timing.verify is not None:
            self.observe_forward(timing.rows * timing.width, timing.verify)
        if timing.draft is not None and timing.levels and timing.drafting_rows:
            step = timing.draft / timing.drafting_rows / timing.levels
            (self.check_draft_step if timing.drafter_prefill else self.observe_draft_step)(step)

    def observe_draft_step(self, seconds: float) -> None:
        """A timed drafter step (seconds per step of a drafting round)."""
        if 0 < seconds < math.inf:
            self._check(STEP, self._inherited_step, seconds, "a drafter step")
            self._draft_seen.append(seconds)

    def check_draft_step(self, seconds: float) -> None:
        """A drafter step timed in a round that is not a regular one (it caught up on plain rounds' rows): not an
        estimate, but no faster than a regular step, so an inherited step `CONTRADICTS` times slower is wrong."""
        if self._inherited_step > CONTRADICTS * seconds > 0:
            self.forget_inherited(f"a drafter step took {seconds:.3g} s, not {self._inherited_step:.3g} s")

    def _check(self, key, kept: float, seconds: float, what: str) -> None:
        """Forget the estimates read back where this process's timings of a quantity they `kept` contradict it
        (`key`: its size, or `STEP`): at once where one is `CONTRADICTS` times faster, where the fastest of its
        first `SLOWER_TIMES` is `CONTRADICTS` times slower."""
        if not kept:
            return
        n, fastest = self._checked.get(key, (0, math.inf))
        n, fastest = n + 1, min(fastest, seconds)
        self._checked[key] = n, fastest
        if kept > CONTRADICTS * fastest or (n >= SLOWER_TIMES and fastest > CONTRADICTS * kept):
            self.forget_inherited(f"{what} took {fastest:.3g} s here ({n} timed), not {kept:.3g} s")

    def _check_between(self, expected: float | None, seconds: float, what: str) -> None:
        """Forget the estimates read back where a forward of a size they did not keep is `DRIFT` times faster than
        their line predicts (`expected`; None: outside the sizes kept, they predict nothing)."""
        if expected and expected > DRIFT * seconds:
            self.forget_inherited(f"{what} took {seconds:.3g} s, not {expected:.3g} s")

    def _predicted(self, tokens: int) -> float | None:
        """Seconds of a forward over `tokens` tokens as the model predicts them, within the sizes read back
        (beyond them the prior's shape predicts, not a measurement)."""
        if not min(self._inherited) <= tokens <= max(self._inherited) or self.base_seconds <= 0:
            return None
        return self.forward(tokens) * self.base_seconds

    def forget_inherited(self, why: str = "") -> None:
        """Drop every estimate read back (`from_dict`), keeping this process's own observations."""
        if not (self._inherited or self._inherited_step):
            return
        logger.info("Learnt costs read back dropped (%s): learnt again", why)
        for tokens, seconds in self._inherited.items():
            seen = self._seen.get(tokens)
            if seen is not None and seconds in seen:
                seen.remove(seconds)
                if not seen:
                    del self._seen[tokens]
        if self._inherited_step in self._draft_seen:
            self._draft_seen.remove(self._inherited_step)
        self._inherited, self._inherited_step = {}, 0.0
        self._checked.clear()
        self._memo.clear()
        if self._seen:
            self._update_base()
        else:
            self.base_seconds = self._given_base

    def _update_base(self) -> None:
        """The base forward in seconds: observed, or the smallest observed size scaled down along the prior."""
        if self._given_base > 0 and 1 not in self._seen:
            self.base_seconds = self._given_base
            return
        smallest = min(self._seen)
        self.base_seconds = self._estimate(smallest) / self._prior(smallest)

    def _estimate(self, tokens: int) -> float:
        return min(self._seen[tokens])

    # ------------------------------------------------------------------ costs
    def forward(self, n: int) -> float:
        """A target forward over n tokens, relative to the base: observed where it was; between observed sizes
        linear; beyond the largest along the secant from the observed size nearest half of it (single sizes'
        estimates are noisy); below the smallest (with no one-token forward timed) along the prior. Never more
        than a larger size's estimate: a size timed at a noisy moment (noise only adds time) is capped by it."""
        if not self._seen or self.base_seconds <= 0:
            return self._prior(n)
        if n not in self._memo:  # (the schedule asks for a dozen sizes a round; observations change them)
            cap = min((self._relative(t) for t in self._seen if t > n), default=math.inf)
            self._memo[n] = min(self._uncapped(n), cap)
        return self._memo[n]

    def _uncapped(self, n: int) -> float:
        sizes = sorted(self._seen)
        if n in self._seen:
            return self._relative(n)
        if n < sizes[0]:
            return self._prior(n) * self._relative(sizes[0]) / self._prior(sizes[0])
        top = sizes[-1]
        if n < top:
            lo = max(t for t in sizes if t < n)
            hi = min(t for t in sizes if t > n)
            return self._relative(lo) + (self._relative(hi) - self._relative(lo)) * (n - lo) / (hi - lo)
        pivot = min(sizes[:-1], key=lambda t: abs(t - top / 2), default=None)
        if pivot is None:  # one size observed: the prior's slope, scaled to it
            slope = (self._prior(n) - self._prior(top)) / (n - top) * self._relative(top) / self._prior(top)
        else:
            slope = (self._relative(top) - self._relative(pivot)) / (top - pivot)
        return self._relative(top) + max(slope, 0.0) * (n - top)

    def _relative(self, tokens: int) -> float:
        return self._estimate(tokens) / self.base_seconds

    @property
    def draft_step_cost(self) -> float:
        """One drafter step relative to the base forward: timed where possible, else the prior."""
        if self._draft_seen and self.base_seconds > 0:
            return min(self._draft_seen) / self.base_seconds
        return self.draft_step

    def _prior(self, n: int) -> float:
        m = len(self.verify)
        if n <= m:
            return self.verify[n - 1]
        half = m // 2
        slope = (self.verify[-1] - self.verify[half - 1]) / (m - half) if half else 1.0
        return self.verify[-1] + (n - m) * slope

    @property
    def observed(self) -> bool:
        """Whether any forward was timed (by this process, or one whose estimates were read back)."""
        return bool(self._seen)

    # ------------------------------------------------------------------ keeping what was learnt
    def as_dict(self) -> dict:
        """What was learnt, in seconds (JSON-ready): each observed size's estimate and the drafter step."""
        return {"verify": [round(v, 4) for v in self.verify], "draft_step": self.draft_step,
                "seconds": {str(t): self._estimate(t) for t in sorted(self._seen)},
                "draft_step_seconds": min(self._draft_seen) if self._draft_seen else 0.0}

    @classmethod
    def from_dict(cls, entry, prior: CostModel | None = None) -> CostModel:
        """A model that starts from what `as_dict` kept (its estimates count as one observation each, and are
        forgotten once this process's timings contradict them: `forget_inherited`). `prior`: the curve and
        drafter step to start from (default: the entry's). Raises `CostEntryError` naming the first field that is not
        what `as_dict` writes: a kept file is untrusted input."""
        if not isinstance(entry, dict):
            raise CostEntryError(f"the entry is {_kind(entry)}, not an object")
        verify = entry.get("verify")
        if not isinstance(verify, list) or not 1 <= len(verify) <= MAX_PRIOR_SIZES:
            raise CostEntryError(f"verify is {_kind(verify)}, not a list of 1 to {MAX_PRIOR_SIZES} numbers")
        verify = [_number(v, f"verify[{i}]", *RELATIVE_RANGE) for i, v in enumerate(verify)]
        draft_step = _number(entry.get("draft_step"), "draft_step", 0.0, RELATIVE_RANGE[1])
        seconds = entry.get("seconds", {})
        if not isinstance(seconds, dict):
            raise CostEntryError(f"seconds is {_kind(seconds)}, not an object of token counts")
        timed = {}
        for tokens, value in seconds.items():
            if not (isinstance(tokens, str) and tokens.isascii() and tokens.isdigit() and 1 <= int(tokens) <= MAX_TOKENS):
                raise CostEntryError(f"seconds has the key {tokens!r}, not a token count from 1 to {MAX_TOKENS}")
            timed[int(tokens)] = _number(value, f"seconds[{tokens!r}]", *SECONDS_RANGE)
        step = entry.get("draft_step_seconds", 0.0)
        step = 0.0 if step == 0 and _is_number(step) else _number(step, "draft_step_seconds", *SECONDS_RANGE)
        model = (cls(verify=list(prior.verify), draft_step=prior.draft_step) if prior is not None
                 else cls(verify=verify, draft_step=draft_step))
        for tokens, value in timed.items():
            model.observe_forward(tokens, value)
        model.observe_draft_step(step)
        model._inherited, model._inherited_step = timed, step
        return model


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _kind(value) -> str:
    return "missing" if value is None else f"a {type(value).__name__}"


def _number(value, name: str, low: float, high: float) -> float:
    """`value` as a float if it is a finite number within [low, high], else a `CostEntryError` naming `name`."""
    if not _is_number(value) or not low <= value <= high:  # (NaN fails both comparisons)
        raise CostEntryError(f"{name} is {value!r}, not a number from {low:g} to {high:g}")
    return float(value)


@dataclass
class RoundCosts:
    cost: CostModel
    tree: tuple[int, int] | None = None  # (top_k, total_tokens): rounds are trees of depth k, not chains of k
    rows: int = 1  # rows verified together (a batch): each row's share of a forward over rows * n tokens
    round_overhead: float = 0.0  # the drafter's catch-up per drafting round
    loop_overhead: float = 0.1  # every round, outside the target forward and the drafter
    cycle_overhead: float = 0.0  # a drafting round of the tree loop beyond the modelled parts
    _recent: dict[str, deque] = field(default_factory=dict)  # overhead name -> its latest single-round values

    @property
    def draft_step(self) -> float:
        """A drafter step, relative to the base forward (timed in the loop; the cost model's prior before)."""
        return self.cost.draft_step_cost

    def verify_cost(self, n: int) -> float:
        """One row's share of the target forward when each of the batch's rows verifies n tokens: a forward over
        rows * n tokens costs about what one row's over as many tokens does, so a batch that already fills the
        device gains less from drafting (1 for a single row's plain step)."""
        return self.cost.forward(self.rows * n) / self.rows

    def verified(self, k: int) -> int:
        """Tokens a round of depth k verifies, the root included."""
        if self.tree is None:
            return k + 1
        return most_nodes(k, *self.tree)

    def cycle_cost(self, k: int) -> float:
        """A drafting round of depth k, the loop's own cost aside."""
        return self.verify_cost(self.verified(k)) + k * self.draft_step + self.round_overhead + self.cycle_overhead

    @property
    def plain(self) -> float:
        """A plain round: one token's forward and the loop."""
        return self.verify_cost(1) + self.loop_overhead

    def relative_cost(self, k: int) -> float:
        """A drafting round of depth k, in plain rounds."""
        return (self.cycle_cost(k) + self.loop_overhead) / self.plain

    # ------------------------------------------------------------------ the loop's timings
    def observe_drafter(self, overhead_seconds: float) -> None:
        """A regular drafting round's drafter catch-up on the last round's rows (each drafting row's share)."""
        if self.cost.base_seconds > 0:
            self.round_overhead = self._robust("round_overhead", overhead_seconds / self.cost.base_seconds)

    def observe_retry(self, overhead_seconds: float) -> None:
        """A retry's drafter catch-up on a few rows of rounds it sat out (each drafting row's share): the estimate
        until a regular round's is timed. A drafter that rests between its retries times no regular round, and
        without it would price every retry at no catch-up at all."""
        if "round_overhead" not in self._recent:
            self.observe_drafter(overhead_seconds)

    def observe_cycle(self, seconds: float, width: int, steps: int) -> None:
        """A whole drafting round of the tree loop: every row verified `width` tokens after `steps` drafter
        levels. What the parts modelled above do not explain becomes `cycle_overhead`."""
        if self.cost.base_seconds > 0:
            share = seconds / self.cost.base_seconds / self.rows
            modelled = self.verify_cost(width) + steps * self.draft_step + self.round_overhead + self.loop_overhead
            self.cycle_overhead = self._robust("cycle_overhead", max(share - modelled, 0.0))

    def observe_plain(self, seconds: float) -> None:
        """A whole plain round (target forward plus the decoding loop's own work)."""
        if self.cost.base_seconds > 0:  # a batch's round: each row's share
            share = seconds / self.cost.base_seconds / self.rows
            self.loop_overhead = self._robust("loop_overhead", max(share - self.verify_cost(1), 0.0))

    def _robust(self, name: str, value: float) -> float:
        """The median of an overhead's latest `OVERHEAD_WINDOW` single-round values. A shared machine's single
        rounds vary by a quarter; a running mean let one slow round steer the schedule for several rounds, and
        whole calls differ from process to process."""
        recent = self._recent.setdefault(name, deque(maxlen=OVERHEAD_WINDOW))
        recent.append(value)
        return statistics.median(recent)
