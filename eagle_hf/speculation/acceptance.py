"""The drafter's running acceptance per draft depth, and the tokens a round of depth k is expected to yield.

With conditional acceptance a_i of the draft at depth i (accepted, given the one above it was), a round of depth
k yields ``E(k) = 1 + sum_{j=1..k} prod_{i<=j} a_i`` tokens: the accepted drafts and the target's own token.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

#: observations per depth a call's estimate is worth when the next call of the process starts from it: a new text
#: moves it within a round or two, as a fresh prior would be moved
CARRY_WEIGHT = 1


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
            hit = 1.0 if i < accepted else 0.0
            self.seen[i] += 1
            rate = max(1 - self.decay, 1 / (self.seen[i] + self.prior_weight))
            self.values[i] += rate * (hit - self.values[i])
