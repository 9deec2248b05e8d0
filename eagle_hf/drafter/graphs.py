"""What the drafter keeps between calls for its fixed-shape programs: the cache storage and the programs over it.

A round's drafting is the same arithmetic however it is launched (`eagle_hf.speculation.draft_programs`): eagerly
at the round's shapes, or as programs at fixed shapes over the drafter cache's whole storage (rows B, the storage's
capacity C read under a mask), which a GPU replays as CUDA graphs: eagerly, a draft level is about thirty kernel
launches, which on a GPU take longer than the kernels themselves (2.0 ms a level at the Llama-3.1-8B shape on an
H200, against a compiled target step of 8 ms). `LevelGraphs.for_drafter` keeps one per drafter (weakly), with the
storage and its programs, so that a later call of the same shape reuses both.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .modeling import KV, EagleDrafter

#: environment variable, a debugging switch of the launch (never of the arithmetic): "off" drafts eagerly; "on" in
#: fixed-shape programs wherever the drafter runs; unset or "auto": in programs on CUDA (CUDA graphs) and where the
#: target's forward is compiled (torch.compile elsewhere, `eagle_hf.programs.how_to_run`), eagerly otherwise
GRAPHS_ENV = "EAGLE_HF_DRAFTER_GRAPHS"
#: programs kept per drafter (least recently used dropped first)
MAX_GRAPHS = 16

_PER_DRAFTER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def wanted(drafter: EagleDrafter, compiled: bool) -> bool:
    """Whether a call drafts in fixed-shape programs (`GRAPHS_ENV`; by default on CUDA and where the target's
    forward is compiled)."""
    setting = os.environ.get(GRAPHS_ENV, "auto").lower()
    if setting in ("off", "0", "false", "none"):
        return False
    if setting in ("on", "1", "true"):
        return True
    return compiled or drafter.fc.weight.device.type == "cuda"


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
        self.programs: OrderedDict[tuple, object] = OrderedDict()  # the draft programs over its storage
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
        for program in graphs.programs.values():
            out += program.tensors()
        return out

    def kept(self, key: tuple, make):
        """The fixed-shape object kept under `key` (a program over this drafter's storage: anything with a
        ``tensors()`` method), made by ``make()`` the first time; the least recently used go first."""
        kept = self.programs.get(key)
        if kept is None:
            kept = self.programs[key] = make()
            while len(self.programs) > MAX_GRAPHS:
                self.programs.popitem(last=False)
        self.programs.move_to_end(key)
        return kept
