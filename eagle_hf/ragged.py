"""Ragged rows in one cache: the target's and the drafter's caches of a batch.

Every row of a batch gets the same number of new slots per step (the longest row's count); a row's extra slots are
holes its attention mask hides (``valid`` [B, L] says which slots are real). Holes are compacted lazily, once every
row has many of them (amortised O(1) per token; docs/concepts.md, "Batches: ragged rows in one cache").
"""

from __future__ import annotations

import torch

#: holes are compacted when every row has at least this many, and this fraction of the cache
MIN_HOLES_TO_COMPACT = 32
HOLE_FRACTION = 0.25


def worth_compacting(valid: torch.Tensor) -> bool:
    """Whether the holes that every row of `valid` [B, L] has are enough to compact."""
    length = valid.shape[1]
    holes = length - int(valid.sum(1).max())
    return holes >= max(MIN_HOLES_TO_COMPACT, HOLE_FRACTION * length)


def packed_index(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row's real slots go when its holes are dropped: (index [B, W], valid [B, W]), W = the most real
    slots of a row. A shorter row's real slots end the row; its first slots are masked copies of slot 0."""
    counts = valid.sum(1)  # [B]
    width = int(counts.max())
    index = torch.zeros(valid.shape[0], width, dtype=torch.long, device=valid.device)
    packed = torch.zeros_like(index, dtype=torch.bool)
    for b in range(valid.shape[0]):
        mine = valid[b].nonzero()[:, 0]
        index[b, width - mine.numel() :] = mine
        packed[b, width - mine.numel() :] = True
    return index, packed
