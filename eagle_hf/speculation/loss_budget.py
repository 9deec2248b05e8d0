"""A batch's verdict on drafting, from its own timed rounds.

A batch's rows pay for the widest row's tree, and a plain round of many rows is not a one-row forward times the
rows: the models that choose a depth can be wrong there. So a batch times its rounds. Drafting rounds are kept per
depth of the drafter (depth 0: copy branches alone) as decayed sums over about ten rounds (single rounds vary by a
quarter): the tokens a row emitted, the tokens the model expected of them, their seconds; a plain round now and
then (every `plain_every` drafting rounds) gives what plain decoding would do. From these the schedule judges
each depth (`DraftLengthController.best`). A *loss budget* keeps the total honest: a wide round (drafts or copy
branches) that emitted fewer tokens than plain rounds would have in its time adds the difference to the loss (one
that emitted more takes it off), and the batch widens its rounds only while the loss stays within `share` of its
time (the first rounds of each kind of drafting round in a call, what its measured verdict needs, are not held
against it: `BatchPlan.first_of_kind`). Where drafting pays the loss is negative and nothing
changes; where it does not, retries and copy branches together cost at most a few per cent.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


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
