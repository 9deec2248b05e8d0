"""Ragged rows in one cache: the target's and the drafter's caches of a batch.

Both caches are built from the three pieces here: `Ragged` (which slots each row reads), `SlotBuffers` (the
keys and values, grown in place by one rule, `grown_capacity`) and `KeptMask` (the attention mask kept between
forwards). The drafter's cache (`eagle_hf.speculation.drafting.DraftState`) and the target's dynamic cache
(`eagle_hf.hf.cache.GrowingLayer`, `TreeCache`) only say when to write, select rows and compact.

Every row of a batch gets the same number of new slots per step (the longest row's count); a row's extra slots are
holes its attention mask hides. `Ragged` says which slots each row reads: the facts the host decides with (each
row's count of real slots, the length) live on the host, and the validity ``[B, L]`` lives on the device, only
while some row has holes, so no decision reads the device. Holes are compacted lazily, once every row has many of
them (amortised O(1) per token; docs/concepts.md, "Batches: ragged rows in one cache").
"""

from __future__ import annotations

from collections.abc import Callable

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



#: a buffer (re)allocated for n slots has room for at least this many more: the widest verify forward (the
#: target's `eagle_hf.hf.cache.VERIFY_BUCKETS`) and a round's draft levels
MIN_ROOM = 64


def grown_capacity(need: int, limit: int | None = None) -> int:
    """The slots a buffer gets when it is (re)allocated for `need` live slots: the one growth rule of both caches'
    buffers and kept masks. `limit`: the most slots it will need (the call's longest sequence and a verify
    forward); the room never goes past it while `need` is below it (beyond it: a ragged batch's holes)."""
    # An eighth more, and at least MIN_ROOM more. A reallocation copies the n live slots and leaves n/8 free, so
    # each written slot costs at most 8 slot copies in all (amortised O(1)), while a buffer holds at most an
    # eighth more than its live slots (the target's cache has one per layer: doubling could hold twice its keys).
    # The minimum room: a verify forward of the widest bucket after a reallocation never reallocates again, and a
    # short cache does not reallocate every forward.
    room = max(MIN_ROOM, need // 8)
    if limit is not None and need < limit:
        room = min(room, limit - need)
    return need + room


#: makes buffers of these shapes [B, H, capacity, D] with the dtype and device of a tensor (`SlotBuffers`)
Allocate = Callable[[tuple, torch.Tensor], tuple]


def new_buffers(shapes: tuple, like: torch.Tensor) -> tuple:
    """Uninitialised buffers (`Allocate`'s default): only live slots are ever read."""
    return tuple(like.new_empty(shape) for shape in shapes)


class SlotBuffers:
    """A batch's cached slots in buffers that grow in place: keys and values [B, H, capacity, D] (their heads and
    widths may differ, as multi-head latent attention's latent and rotary key), of which the owner's first
    `length` slots are live. A write copies only its own slots, into the room after the live ones; out of room,
    the buffers are reallocated by `grown_capacity`. The owner keeps the length (its `Ragged`'s, or its live
    views' for the target's cache layers) and passes it in."""

    def __init__(self, buffers: tuple, limit: int | None = None, allocate: Allocate = new_buffers):
        self.buffers, self.limit, self.allocate = tuple(buffers), limit, allocate

    @classmethod
    def holding(cls, live: tuple, extra: int = 0, limit: int | None = None,
                allocate: Allocate = new_buffers) -> SlotBuffers:
        """New buffers holding the slots `live` (each [B, H, L, D]) with room for `extra` more at least."""
        slots = cls((), limit, allocate)
        slots._regrow(live, live[0].shape[2] + extra)
        return slots

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[2]

    def live(self, length: int) -> tuple:
        """The first `length` slots of each buffer: views [B, H, length, D] (narrow: the cheapest on the host)."""
        return tuple(b.narrow(2, 0, length) for b in self.buffers)

    def holds(self, live: tuple) -> bool:
        """Whether `live` are views of the first slots of these buffers (a crop keeps them so; a row selection or
        a gather made elsewhere does not)."""
        return len(live) == len(self.buffers) and all(  # (the buffers are held here: no other tensor starts there)
            v.data_ptr() == b.data_ptr() and v.stride() == b.stride() and v.shape[:2] == b.shape[:2]
            and v.shape[2] <= b.shape[2] and v.shape[3:] == b.shape[3:] for v, b in zip(live, self.buffers))

    def reserve(self, length: int, extra: int) -> None:
        """Room for `extra` slots after the first `length` (reallocated by `grown_capacity` when out of room)."""
        if length + extra > self.capacity:
            self._regrow(self.live(length), length + extra)

    def _regrow(self, live: tuple, need: int) -> None:
        """New buffers for `need` slots at least, the first ones copied from `live` [B, H, L, D]."""
        capacity = grown_capacity(need, self.limit)
        shapes = tuple((*t.shape[:2], capacity, t.shape[3]) for t in live)
        buffers = self.allocate(shapes, live[0])  # [B, H, capacity', D] each (capacity' >= capacity)
        for buffer, t in zip(buffers, live):
            buffer.narrow(2, 0, t.shape[2]).copy_(t)
        self.buffers = tuple(buffers)

    def write(self, at: int, new: tuple) -> tuple:
        """Write `new` (each [B, H, n, D]) at slots ``at .. at+n-1``; returns the live views up to them
        [B, H, at+n, D]. O(n) unless the buffers grow."""
        n = new[0].shape[2]
        self.reserve(at, n)
        for buffer, t in zip(self.buffers, new):
            buffer.narrow(2, at, n).copy_(t)
        return self.live(at + n)

    def select(self, index: torch.Tensor) -> None:
        """Keep the batch rows `index` (a device index tensor), room included, in buffers from `allocate` (the
        drafter's programs' storage is kept by shape: a later call whose batch shrinks alike reuses it; it may hand
        out more room, as to `_regrow`: an empty cache's is rounded up)."""
        shapes = tuple((index.shape[0], *b.shape[1:]) for b in self.buffers)
        kept = self.allocate(shapes, self.buffers[0])  # [B', H, capacity', D] each (capacity' >= capacity)
        for new, old in zip(kept, self.buffers):  # (not out=: a cache written with grad copies too)
            new.narrow(2, 0, old.shape[2]).copy_(old.index_select(0, index.to(old.device)))
        self.buffers = tuple(kept)

    def compact(self, index: torch.Tensor) -> None:
        """Row b keeps its slots ``index[b]`` ([B, W], `Ragged.compact`), in new buffers with room after them:
        the live slots are then the first W."""
        gathered = tuple(b.gather(2, _along_slots(index, b)) for b in self.buffers)  # [B, H, W, D] each
        self._regrow(gathered, index.shape[1])


def _along_slots(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`index` [B, W] (slots) expanded to gather along dimension 2 of `like` [B, H, C, D]: [B, H, W, D]."""
    b, h, _, d = like.shape
    return index.to(like.device)[:, None, :, None].expand(b, h, index.shape[1], d)


class KeptMask:
    """An attention mask [B, 1, R, C] kept between the forwards over a ragged cache, so that no forward builds
    one over the whole context: the columns below the cache's length hold each row's slot validity for all R
    query rows (written as slots arrive, O(new slots x R)), and a forward's own block after them is rewritten
    (O(its rows x its slots)). Boolean (True: attend; the drafter's) or additive (0, or the dtype's lowest: the
    target's). Its columns grow by `grown_capacity` (whole multiples of 64: kernels want the rows aligned)."""

    def __init__(self):
        self.mask: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor | None:
        """[B, 1, R, C] (None: none yet)."""
        return self._mask

    @mask.setter
    def mask(self, mask: torch.Tensor | None) -> None:
        self._mask = mask
        self._rows = None if mask is None else mask[:, 0]  # [B, R, C]: the view the writes address, made once
        self._hidden = None if mask is None else False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
        # (an additive mask's two values as tensors: `torch.where` writes into a view only from tensors)
        self._values = None if mask is None or mask.dtype == torch.bool else (mask.new_zeros(()),
                                                                              mask.new_full((), self._hidden))

    def view(self, tail: torch.Tensor, length: int, valid: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, q, length + t], a view: the `length` slots as `valid` [B, length] says (None: all read), then
        `tail` [B, q, t] (nonzero: attend) for the q rows of a forward that writes t slots after them."""
        rows, q, t = tail.shape
        m = self.mask
        if m is None or m.dtype != dtype or m.shape[0] != rows or m.shape[2] < q or m.shape[3] < length + t:
            m = self.fresh(rows, q, length, valid, dtype, tail.device, -(-grown_capacity(length + t) // 64) * 64)
        self.write(length, tail)
        return m[:, :, :q, : length + t]

    def fresh(self, rows: int, queries: int, length: int, valid: torch.Tensor | None, dtype: torch.dtype, device,
              columns: int) -> torch.Tensor:
        """A new kept mask [B, 1, R, columns] (R: `queries`, or the old mask's if more), its first `length`
        columns written from `valid` (None: all read), the rest attended."""
        old = self.mask
        queries = max(queries, old.shape[2] if old is not None else 0)
        attend = True if dtype == torch.bool else 0
        m = self.mask = torch.full((rows, 1, queries, columns), attend, dtype=dtype, device=device)
        if valid is not None:
            self._put(self._rows[:, :, :length], valid[:, None, :])
        return m

    def write(self, at: int, tail: torch.Tensor) -> None:
        """`tail` [B, q, t] (nonzero: attend) into the first q query rows at columns ``at .. at+t-1``."""
        q, t = tail.shape[1:]
        region = self._rows.narrow(2, at, t)  # [B, R, t]
        self._put(region if q == region.shape[1] else region[:, :q], tail)

    def hide(self, start: int, end: int) -> None:
        """Columns ``start .. end-1`` hidden from every query row."""
        self._rows.narrow(2, start, end - start).fill_(self._hidden)

    def arrive(self, at: int, n: int, valid: torch.Tensor | None) -> None:
        """Slots ``at .. at+n-1`` join the cache (`valid` [B, n] which are read; None: all): their columns, for
        every query row. Past the mask's columns it is dropped (rebuilt at the next `view`)."""
        m = self.mask
        if m is None or at + n > m.shape[3]:
            self.mask = None
            return
        columns = self._rows.narrow(2, at, n)  # [B, R, n]
        if valid is None:
            columns.fill_(True if m.dtype == torch.bool else 0)
        else:
            self._put(columns, valid[:, None, :])

    def select(self, index: torch.Tensor) -> None:
        """Keep the batch rows `index` (a device index tensor)."""
        if self.mask is not None:
            self.mask = self.mask.index_select(0, index)

    def drop(self) -> None:
        """Forget it (after a compaction: rebuilt at the next `view`, amortised like the compaction)."""
        self.mask = None

    def _put(self, region: torch.Tensor, attend: torch.Tensor) -> None:
        """`region` of the kept mask set from `attend` (broadcast to it; nonzero: attend), in one operation."""
        if region.dtype == torch.bool:
            region.copy_(attend)
        else:
            attend = attend if attend.dtype == torch.bool else attend.bool()
            torch.where(attend if attend.shape == region.shape else attend.expand_as(region), *self._values, out=region)
