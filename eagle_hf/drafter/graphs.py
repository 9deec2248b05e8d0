"""The drafter's draft-level forward at fixed shapes, replayed as a CUDA graph.

Eagerly, a draft level is a one-layer model's forward over k frontier nodes per row: about thirty kernel launches,
which on a GPU take longer than the kernels themselves (2.0 ms a level at the Llama-3.1-8B shape on an H200,
against a compiled target step of 8 ms). Here the same forward is written at fixed shapes: rows B, nodes k, the
drafter cache's whole capacity C read under a mask, and the new keys and values written at slots held on the
device. One CUDA graph per (B, k, cache storage) then replays it: the host copies the level's inputs into the
graph's buffers and launches once. The arithmetic is the eager forward's (masked columns weigh exactly zero), so
drafts are unchanged; without CUDA the fixed-shape forward runs eagerly (how the CPU tests check it).

`LevelGraphs.for_drafter` keeps one per drafter (weakly), with the drafter cache's storage, so that a later call of
the same shape reuses both the storage and the graphs.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..programs import Program
from .modeling import KV, DraftStep, EagleDrafter

#: environment variable: "off" runs draft levels eagerly; "on" at fixed shapes wherever the drafter runs (captured
#: on CUDA); unset or "auto": at fixed shapes where the target's forward is compiled (a static cache on CUDA, or
#: compile forced elsewhere), captured or compiled as the target's forward is
GRAPHS_ENV = "EAGLE_HF_DRAFTER_GRAPHS"
#: graphs kept per drafter (least recently used dropped first)
MAX_GRAPHS = 16

_PER_DRAFTER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def wanted(drafter: EagleDrafter, compiled: bool) -> bool:
    """Whether a call drafts at fixed shapes, in programs (`GRAPHS_ENV`; by default where the target's forward is
    compiled: the programs then go through the same machinery, CUDA graphs on CUDA, torch.compile elsewhere,
    `eagle_hf.programs.how_to_run`)."""
    setting = os.environ.get(GRAPHS_ENV, "auto").lower()
    if setting in ("off", "0", "false", "none"):
        return False
    if setting in ("on", "1", "true"):
        return True
    return compiled


@dataclass
class SlotWriter:
    """New keys and values written at the device slots `slots` [T] of whole buffers ``[B, kv_heads, C, d]``; a
    pass attends over all C columns (its mask says which it reads). Fixed shapes, no host value: capturable."""

    keys: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor  # [T] long

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def extended(self, new: KV) -> KV:
        self.keys.index_copy_(2, self.slots, new.keys)
        self.values.index_copy_(2, self.slots, new.values)
        return KV(self.keys, self.values)


class FixedLevel:
    """One (B, k) level forward over one cache storage: static input buffers, the captured graph (CUDA), and the
    static outputs a replay overwrites (read them before the next level runs)."""

    def __init__(self, drafter: EagleDrafter, keys: torch.Tensor, values: torch.Tensor, rows: int, k: int):
        dtype, width = drafter.fc.weight.dtype, drafter.config.hidden_size
        self._drafter, self.keys, self.values = weakref.ref(drafter), keys, values
        self.feed = keys.new_zeros(rows, k, width, dtype=dtype)  # [B, k, H]
        self.ids = keys.new_zeros(rows, k, dtype=torch.long)  # [B, k]
        self.positions = keys.new_zeros(rows, k, dtype=torch.long)  # [B, k]
        self.steps = keys.new_ones(k, dtype=torch.long).cumsum(0) - 1  # [k] 0 .. k-1
        self.slots = keys.new_zeros(k, dtype=torch.long)  # [k] where the k new rows are written
        self.mask = keys.new_zeros(rows, 1, k, keys.shape[2], dtype=torch.bool)  # [B, 1, k, C]
        self.program = Program(self._forward, (), "graph" if keys.device.type == "cuda" else "eager", "drafter's level")

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors it keeps."""
        return [self.keys, self.values, self.feed, self.ids, self.positions, self.steps, self.slots, self.mask]

    def _forward(self) -> DraftStep:
        return self._drafter().step(self.feed, self.ids, self.positions,
                                 past=SlotWriter(self.keys, self.values, self.slots), mask=self.mask)

    def run(self, feed: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, at: int,
            mask: torch.Tensor | None) -> DraftStep:
        """The level's forward: feed [B, k, H], ids and positions [B, k], the new rows written at slots
        ``at .. at+k-1``, `mask` [B|1, 1, k, at+k] bool (None: every earlier slot and causal among the k)."""
        k = self.ids.shape[1]
        self.feed.copy_(feed)
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        torch.add(self.steps, at, out=self.slots)
        self.mask.zero_()
        if mask is None:
            self.mask[..., :at] = True
            self.mask[..., at : at + k] = self.mask.new_ones(k, k).tril()
        else:
            self.mask[..., : at + k] = mask
        return self.program()


def weights_of(drafter: EagleDrafter) -> tuple:
    """Where the drafter's weights and buffers live now (and the target embedding it borrows): what its graphs read."""
    tensors = [*drafter.parameters(), *drafter.buffers()]
    embedding = getattr(drafter, "_target_embedding", None)
    if embedding is not None:
        tensors.append(embedding.weight)
    return tuple((t.data_ptr(), t.dtype, t.device) for t in tensors)


class LevelGraphs:
    """A drafter's fixed-shape levels and the cache storage they write, kept between calls."""

    def __init__(self, drafter: EagleDrafter):
        self._drafter = weakref.ref(drafter)
        self.weights = weights_of(drafter)
        self.levels: OrderedDict[tuple, FixedLevel] = OrderedDict()
        self.storage: dict[tuple, tuple] = {}  # (shape, dtype, device, mode) -> (keys, values, weakref to owner)

    @classmethod
    def for_drafter(cls, drafter: EagleDrafter) -> LevelGraphs:
        """The drafter's levels; new ones when its weights moved since (a graph replays the memory it captured)."""
        graphs = _PER_DRAFTER.get(drafter)
        if graphs is None or graphs.weights != weights_of(drafter):
            graphs = _PER_DRAFTER[drafter] = cls(drafter)
        return graphs

    def buffers(self, shape: tuple, like: torch.Tensor, owner) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `shape` ``[B, kv_heads, C, d]`` for `owner` (a drafter cache): the storage an
        earlier, finished owner left, else new storage (zeros: columns never written weigh zero, where 0 x a
        stale NaN would not). A storage a live owner holds is not handed to another (threads sharing a drafter)."""
        # (inference-mode tensors cannot be written outside inference mode: kept apart)
        key = (tuple(shape), like.dtype, like.device, torch.is_inference_mode_enabled())
        kept = self.storage.get(key)
        holder = kept[2]() if kept is not None else None
        if kept is not None and (holder is None or holder is owner):
            self.storage[key] = (kept[0], kept[1], weakref.ref(owner))
            return kept[0], kept[1]
        made = (like.new_zeros(shape), like.new_zeros(shape))
        if kept is None:
            self.storage[key] = (*made, weakref.ref(owner))
        return made

    @classmethod
    def kept_tensors(cls, drafter: EagleDrafter) -> list[torch.Tensor]:
        """The device tensors kept for `drafter` between calls (storage and the levels' buffers)."""
        graphs = _PER_DRAFTER.get(drafter)
        if graphs is None:
            return []
        out = [t for keys, values, _ in graphs.storage.values() for t in (keys, values)]
        for level in graphs.levels.values():
            out += level.tensors()
        return out

    def kept(self, key: tuple, make):
        """The fixed-shape object kept under `key` (a program over this drafter's storage: anything with a
        ``tensors()`` method), made by ``make()`` the first time; the least recently used go first."""
        kept = self.levels.get(key)
        if kept is None:
            kept = self.levels[key] = make()
            while len(self.levels) > MAX_GRAPHS:
                self.levels.popitem(last=False)
        self.levels.move_to_end(key)
        return kept

    def level(self, keys: torch.Tensor, values: torch.Tensor, rows: int, k: int) -> FixedLevel:
        key = (rows, k, keys.data_ptr(), tuple(keys.shape), torch.is_inference_mode_enabled())
        level = self.levels.get(key)
        if level is None:
            level = self.levels[key] = FixedLevel(self._drafter(), keys, values, rows, k)
            while len(self.levels) > MAX_GRAPHS:
                self.levels.popitem(last=False)
        self.levels.move_to_end(key)
        return level
