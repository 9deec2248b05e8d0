"""A batch's verdict on drafting, from its own timed rounds.

A batch's rows pay for the widest row's tree, and a plain round of many rows is not a one-row forward times the
rows: the models that choose a depth can be wrong there. So a batch times its rounds. Drafting rounds give a rate
(tokens a row emits per second, a ratio of decayed sums over about ten rounds: single rounds vary by a quarter);
a plain round now and then (every `plain_every` drafting rounds) gives what plain decoding would do; and a *loss
budget* keeps the total honest: a wide round (drafts or copy branches) that emitted fewer tokens than plain
rounds would have in its time adds the difference to the loss (one that emitted more takes it off), and the batch
widens its rounds only while the loss stays within `share` of its time. Where drafting pays the loss is negative
and nothing changes; where it does not, probes and copy branches together cost at most a few per cent.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class LossBudget:
    share: float = 0.03  # the loss allowed, as a share of the batch's time
    plain_every: int = 16  # drafting rounds between two timed plain rounds
    memory: float = 0.9  # weight of the past in the timed drafting rounds' rate
    plain_seconds: float = 0.0  # a plain round's seconds (median of the latest; 0: none timed yet)
    cycle_rate: float = 0.0  # tokens per second of a row in drafting rounds (0: none timed yet)
    since_plain: int = 0  # drafting rounds since the last plain one
    _cycle_tokens: float = 0.0  # decayed sums over the timed drafting rounds: tokens a row emitted ...
    _cycle_seconds: float = 0.0  # ... and their seconds
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

    def observe_cycle(self, seconds: float, tokens: float) -> None:
        """A timed drafting round in which each row emitted `tokens` on average."""
        self._cycle_tokens = self.memory * self._cycle_tokens + tokens
        self._cycle_seconds = self.memory * self._cycle_seconds + seconds
        self.cycle_rate = self._cycle_tokens / max(self._cycle_seconds, 1e-9)  # a ratio of sums: steadier than
        # a running mean of single rounds' rates

    def observe_plain(self, seconds: float) -> None:
        self._plain.append(seconds)
        self.plain_seconds = statistics.median(self._plain)
