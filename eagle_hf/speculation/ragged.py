"""Ragged rows in one cache: the target's and the drafter's caches of a batch.

Every row of a batch gets the same number of new slots per step (the longest row's count); a row's extra slots are
holes its attention mask hides. `Ragged` says which slots each row reads: the facts the host decides with (each
row's count of real slots, the length) live on the host, and the validity ``[B, L]`` lives on the device, only
while some row has holes, so no decision reads the device. Holes are compacted lazily, once every row has many of
them (amortised O(1) per token; docs/concepts.md, "Batches: ragged rows in one cache").
"""

from __future__ import annotations

import torch

#: holes are compacted when every row has at least this many, and this fraction of the cache
MIN_HOLES_TO_COMPACT = 32
HOLE_FRACTION = 0.25


class Ragged:
    """Which slots of a batch's cache each row reads: ``counts[b]`` real slots among ``length``; the validity
    ``valid`` [B, L] (device) is None while no row has a hole. Its storage grows by doubling: appending is
    O(new slots), never O(length)."""

    def __init__(self, counts: list[int], length: int, valid: torch.Tensor | None = None):
        self.counts, self.length = list(counts), length
        self._storage = valid  # [B, capacity] bool, or None: no holes

    @property
    def rows(self) -> int:
        return len(self.counts)

    @property
    def holes(self) -> bool:
        return self._storage is not None

    @property
    def valid(self) -> torch.Tensor | None:
        """[B, L] bool: which slots each row reads (None: all of them)."""
        return None if self._storage is None else self._storage[:, : self.length]

    def with_next(self, n: int) -> torch.Tensor:
        """[B, L + n] (a view): the validity, then `n` real slots (a plain step's 2D mask while holes exist)."""
        self._room(n)
        self._storage[:, self.length : self.length + n] = True
        return self._storage[:, : self.length + n]

    def _room(self, width: int) -> None:
        if self.length + width > self._storage.shape[1]:
            grown = self._storage.new_ones(self.rows, 2 * (self.length + width))
            grown[:, : self.length] = self._storage[:, : self.length]
            self._storage = grown

    def append(self, lengths: list[int], width: int, new_valid: torch.Tensor | None, device) -> None:
        """Every row gets `width` slots, row b's first ``lengths[b]`` real; `new_valid` [B, width] says so on the
        device (may be None where every length is `width`)."""
        full = all(n == width for n in lengths)
        if self._storage is None and not full:
            self._storage = torch.ones(self.rows, 2 * (self.length + width), dtype=torch.bool, device=device)
        if self._storage is not None:
            self._room(width)
            if not full:
                self._storage[:, self.length : self.length + width] = new_valid
            else:
                self._storage[:, self.length : self.length + width] = True
        self.length += width
        self.counts = [c + n for c, n in zip(self.counts, lengths)]

    def select(self, rows: list[int], index: torch.Tensor) -> None:
        """Keep these rows (`index`: the same, on the device)."""
        self.counts = [self.counts[b] for b in rows]
        if self._storage is not None:
            self._storage = None if all(c == self.length for c in self.counts) else self._storage.index_select(0, index)

    def worth_compacting(self) -> bool:
        """Whether the holes that every row has are enough to compact."""
        if self._storage is None:
            return False
        holes = self.length - max(self.counts)
        return holes >= max(MIN_HOLES_TO_COMPACT, HOLE_FRACTION * self.length)

    def compact(self) -> torch.Tensor:
        """Drop the holes: returns where each row's real slots come from (index [B, W], W = the most real slots of
        a row), in order, first; a shorter row's last slots are holes. Built on the device, read nowhere."""
        width = max(self.counts)
        valid = self.valid
        order = torch.sort(valid.to(torch.uint8), dim=1, descending=True, stable=True).indices  # [B, L] real first
        index = order[:, :width].contiguous()  # [B, W]
        self.length = width
        if all(c == width for c in self.counts):
            self._storage = None
        else:
            steps = torch.arange(2 * width, device=valid.device)
            self._storage = steps[None] < valid.sum(1, keepdim=True)  # [B, 2W] (the counts, on the device)
        return index

