"""What a round costs, in one-token target forwards of one row: the cost model's forwards plus what the loops
time around them.

A drafting round of depth k costs one target forward over the verified tokens (k + 1 for a chain; up to
``1 + top_k + (k-1) * top_k**2`` for a tree of depth k, at most its total), k drafter steps, the drafter's
catch-up (`round_overhead`), what a drafting round of the tree loop costs beyond the modelled parts
(`cycle_overhead`: per-node verification, tree masks, the cache's commit) and the decoding loop's own cost that
every round pays (`loop_overhead`: logits processing, stopping criteria). The forwards and drafter steps come
from the `CostModel` (a prior, refined by the timed forwards); the three overheads are timed in the loop, each
the median of its latest rounds: a round timed at a noisy moment moves no decision.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from .cost_model import CostModel

#: single-round values an in-loop overhead's median is taken over
OVERHEAD_WINDOW = 9


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
        top_k, total_tokens = self.tree  # top_k candidates at depth 1, top_k**2 at each further depth
        return min(total_tokens, 1 + top_k + (k - 1) * top_k * top_k)

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
