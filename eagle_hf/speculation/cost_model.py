"""What a round costs on one device: a prior, refined by the forwards that actually run.

The adaptive schedule weighs tokens against costs. Costs are relative to one *base* forward (the target over one
token of one row), so that a schedule reads the same on any device; `base_seconds` converts timings.

Nothing is measured before the first token. A model starts from a prior: the verify curve of a device kind (on
a GPU a forward over 64 tokens costs about what one over a single token does; on a CPU each token adds a share),
or the estimates an earlier process kept (`as_dict` / `from_dict`, persisted by `eagle_hf.hf.costs`). Every timed
forward then adds an observation at its size (tokens over all rows): the estimate of a size is the fastest of its
last few observations (interference on a shared machine only ever adds time; a one-off slow round does not
steer the schedule), and sizes not observed follow the prior's shape, scaled to the observed sizes around them.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

#: a size's estimate is the fastest of this many of its latest observations
WINDOW = 8
#: relative cost of each token beyond the first, by device kind, before anything was observed: a GPU verifies
#: tens of tokens in the time of one; a CPU pays a share per token (0.03-0.2 on this project's hosts). Low
#: rather than high: a schedule that believes drafting pays drafts, and its first round corrects the belief
PRIOR_PER_TOKEN = {"cuda": 0.004, "cpu": 0.05}
PRIOR_PER_TOKEN_OTHER = 0.02
#: a drafter step before one was timed, relative to the base forward (a one-layer drafter)
PRIOR_DRAFT_STEP = 0.1


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
        if tokens >= 1 and seconds > 0:
            seen = self._seen.setdefault(tokens, deque(maxlen=WINDOW))
            before = min(seen) if seen else None
            seen.append(seconds)
            if min(seen) != before:  # (most observations change no estimate: the costs stay as they were)
                self._update_base()
                self._memo.clear()

    def observe(self, timing) -> None:
        """A round's timings (`eagle_hf.speculation.rounds.RoundTiming`): its verify forward, and its drafter's level
        forwards unless the drafter caught up on plain rounds' rows (each drafting row's share of one)."""
        if timing.verify is not None:
            self.observe_forward(timing.rows * timing.width, timing.verify)
        if timing.draft is not None and timing.levels and timing.drafting_rows and not timing.drafter_prefill:
            self.observe_draft_step(timing.draft / timing.drafting_rows / timing.levels)

    def observe_draft_step(self, seconds: float) -> None:
        """A timed drafter step (seconds per step of a drafting round)."""
        if seconds > 0:
            self._draft_seen.append(seconds)

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
    def from_dict(cls, entry: dict) -> CostModel:
        """A model that starts from what `as_dict` kept (its estimates count as one observation each)."""
        model = cls(verify=list(entry["verify"]), draft_step=float(entry["draft_step"]))
        for tokens, seconds in entry.get("seconds", {}).items():
            model.observe_forward(int(tokens), float(seconds))
        model.observe_draft_step(float(entry.get("draft_step_seconds", 0.0)))
        return model
