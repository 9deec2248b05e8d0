"""Retrying a dropped source with exponential backoff: a wait that doubles after each failed retry.

The adaptive schedule drops the drafter where its drafts do not pay, the copy source drops its branches where
they keep failing; both must notice when that changes, at a cost that shrinks the longer nothing changes. A
`Backoff` counts the rounds a source sat out; once they reach its wait the source drafts once (a *retry*); a
retry that fails doubles the wait (up to `most`), one that pays brings it back to `every`. A retry expected to
lose little (a source just below break-even) need not sit out the whole wait: `absorbs` says when the rounds sat
out pay for it.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the share of the time a dropped source's retries may be expected to lose: a retry comes once the rounds sat out
#: since the last one would absorb its expected loss at this share (halved with each failed retry)
RETRY_SHARE = 0.01


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
