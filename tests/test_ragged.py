"""The ragged-cache component both caches are built from (`eagle_hf.speculation.ragged`): the growth rule, the
slot buffers (write, select rows, compact) and the kept mask, on their own and through each of their users, the
drafter's cache (`DraftState`) and the target's dynamic cache in tree mode (`TreeCache` over `GrowingLayer`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from eagle_hf.drafter.modeling import KV
from eagle_hf.hf.cache import VERIFY_BUCKETS, GrowingLayer, TreeCache
from eagle_hf.speculation import ragged
from eagle_hf.speculation.drafting import DraftState
from eagle_hf.speculation.ragged import MIN_ROOM, KeptMask, Ragged, SlotBuffers, grown_capacity

HEADS, DIM = 2, 4


def test_the_growth_rule_keeps_an_eighth_and_the_widest_verify_forward_and_stops_at_the_limit():
    assert MIN_ROOM >= VERIFY_BUCKETS[-1]  # a verify forward after a reallocation never reallocates
    assert grown_capacity(10) == 10 + MIN_ROOM
    assert grown_capacity(8000) == 9000  # an eighth more
    assert grown_capacity(50, limit=60) == 60 and grown_capacity(70, limit=60) == 70 + MIN_ROOM  # (past: holes)


def test_writes_cost_a_bounded_number_of_slot_copies_and_hold_what_concatenation_holds():
    """Amortised O(1) per slot: a reallocation copies the live slots, at most 8 per written slot in all."""
    g = torch.Generator().manual_seed(0)
    first = torch.randn(2, HEADS, 5, DIM, generator=g)
    slots, ref = SlotBuffers.holding((first, -first)), first
    copied, written, length = 0, 0, 5
    for step in range(400):
        new = torch.randn(2, HEADS, 1 + step % 7, DIM, generator=g)  # [B, H, n, D]
        before = slots.buffers[0]
        keys, values = slots.write(length, (new, -new))
        copied += length if slots.buffers[0] is not before else 0
        length, written, ref = length + new.shape[2], written + new.shape[2], torch.cat([ref, new], 2)
        assert torch.equal(keys, ref) and torch.equal(values, -ref) and slots.holds((keys, values))
    assert copied <= 8 * written + grown_capacity(0), (copied, written)
    assert slots.capacity <= grown_capacity(length) + 7  # never more than an eighth (and the room) past the live


def test_the_buffers_hold_their_crops_but_not_tensors_made_elsewhere():
    x = torch.randn(2, HEADS, 6, DIM)
    slots = SlotBuffers.holding((x, x.clone()))
    keys, values = slots.live(6)
    assert slots.holds((keys[:, :, :3], values[:, :, :3]))  # a commit's crop
    assert not slots.holds((keys.index_select(0, torch.tensor([1])), values))  # a selection made elsewhere
    assert not slots.holds((keys[1:], values[1:])) and not slots.holds((x, values))


def test_select_and_compact_keep_each_rows_slots_with_room_after_them():
    x = torch.arange(3 * HEADS * 8 * DIM, dtype=torch.float32).view(3, HEADS, 8, DIM)
    slots = SlotBuffers.holding((x, 2 * x), limit=9)
    assert slots.capacity == 9  # the room ends at the limit
    slots.select(torch.tensor([2, 0]))
    assert torch.equal(slots.live(8)[0], x[[2, 0]]) and slots.capacity == 9
    index = torch.tensor([[0, 3, 5], [1, 2, 7]])  # [B, W] each row's kept slots, in order
    slots.compact(index)
    keys, values = slots.live(3)
    assert torch.equal(keys[0], x[2][:, [0, 3, 5]]) and torch.equal(values[1], 2 * x[0][:, [1, 2, 7]])
    assert slots.capacity >= 3 + 6  # (room: grown_capacity(3, limit 9))


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_the_kept_mask_equals_one_built_from_scratch(dtype):
    """Boolean (the drafter's) or additive (the target's): columns written as slots arrive, a forward's block
    rewritten, rows selected; every view equals the mask built from the validity and the block."""
    g = torch.Generator().manual_seed(1)
    kept, valid = KeptMask(), torch.ones(3, 0, dtype=torch.bool)  # [B, L] the rows' validity so far
    for step in range(12):
        q, t = 1 + step % 4, 2 + step % 3
        tail = torch.rand(valid.shape[0], q, t, generator=g) < 0.6  # [B, q, t]
        view = kept.view(tail, valid.shape[1], valid, dtype)
        expected = torch.cat([valid[:, None, :].expand(-1, q, -1), tail], 2)[:, None]  # [B, 1, q, L + t]
        as_bool = view if dtype == torch.bool else view == 0
        assert torch.equal(as_bool, expected), step
        new = torch.rand(valid.shape[0], 5, generator=g) < 0.7  # [B, 5] slots committed
        kept.arrive(valid.shape[1], 5, new)
        valid = torch.cat([valid, new], 1)
        if step == 6:
            kept.select(torch.tensor([0, 2]))
            valid = valid[[0, 2]]
    kept.drop()
    assert kept.mask is None


class _Drafter(SimpleNamespace):
    """What `DraftState.for_drafter` reads of a drafter."""

    config = SimpleNamespace(num_key_value_heads=HEADS, head_dim=DIM)
    fc = SimpleNamespace(weight=torch.zeros(1))


class _DrafterCache:
    """The drafter's cache, written as its forwards write (`DraftState.writer`)."""

    def __init__(self, rows: int):
        self.state = DraftState.for_drafter(_Drafter(), rows)

    def append(self, new: torch.Tensor, counts: list[int], valid: torch.Tensor | None):
        s = self.state
        s.reserve(new.shape[2])
        s.writer(s.length).extended(KV(new, -new))
        s.ragged.append(counts, new.shape[2], valid, new.device)
        s.compact()

    def select(self, rows: list[int]):
        self.state.select(rows)

    def live(self) -> tuple[torch.Tensor, Ragged]:
        return self.state.kv.keys, self.state.ragged


class _TargetCache:
    """The target's dynamic cache in tree mode, written as a verify forward writes (transformers' `update`)."""

    def __init__(self, rows: int):
        self.tree = TreeCache(DynamicCache(), Ragged([0] * rows, 0))
        self.tree.begin(slot_limit=None)

    def append(self, new: torch.Tensor, counts: list[int], valid: torch.Tensor | None):
        past = self.tree.length
        self.tree.cache.update(new, -new, 0)
        self.tree.commit(past, None, counts, valid, new.device, written=new.shape[2])
        self.tree.compact()

    def select(self, rows: list[int]):
        self.tree.select_rows(rows, torch.tensor(rows))

    def live(self) -> tuple[torch.Tensor, Ragged]:
        layer = self.tree.cache.layers[0]
        assert isinstance(layer, GrowingLayer) and torch.equal(layer.values, -layer.keys)
        return layer.keys, self.tree.ragged


@pytest.mark.parametrize("user", [_DrafterCache, _TargetCache])
def test_each_cache_holds_each_rows_real_slots_in_order_through_appends_selections_and_compactions(
        user, monkeypatch):
    """Rows append different counts (a shorter row's extra slots are holes), rows leave, holes are compacted: each
    row's real slots, read through the validity, are the ones it appended, in order; buffers grow in place."""
    monkeypatch.setattr(ragged, "MIN_HOLES_TO_COMPACT", 4)
    monkeypatch.setattr(ragged, "HOLE_FRACTION", 0.1)
    g = torch.Generator().manual_seed(2)
    cache, rows = user(3), [[], [], []]  # per row: its real slots' keys [H, D], in order
    compactions, buffers = 0, set()
    for step in range(40):
        counts = [1 + (step * (b + 2)) % 5 for b in range(len(rows))]
        width = max(counts)
        new = torch.randn(len(rows), HEADS, width, DIM, generator=g)  # [B, H, W, D]
        valid = None if all(c == width for c in counts) else torch.arange(width)[None] < torch.tensor(counts)[:, None]
        before = cache.live()[1].length if step else 0
        cache.append(new, counts, valid)
        keys, state = cache.live()
        compactions += state.length < before + width
        buffers.add(keys.data_ptr())
        for b, c in enumerate(counts):
            rows[b] += list(new[b, :, :c].unbind(1))
        read = state.valid if state.holes else torch.ones(len(rows), state.length, dtype=torch.bool)
        for b, real in enumerate(rows):
            assert state.counts[b] == len(real)
            assert torch.equal(keys[b][:, read[b]], torch.stack(real, 1)), (step, b)
        if step == 15:
            cache.select([2, 0])
            rows = [rows[2], rows[0]]
    assert compactions >= 2
    assert len(buffers) < 20  # grown in place: not a new buffer each append
