"""What eagle_hf reads from transformers' model classes and utilities (outside generate())."""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch

#: calls of transformers' compiled forward on a new input shape that run slower than the rest: the one that
#: compiles, then (mode "reduce-overhead") the CUDA graph's warm-up run and its recording
COMPILED_WARMUP_CALLS = 3
_SHAPE_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Counter of input shapes


def final_norm_scale(target) -> torch.Tensor:
    """The effective per-channel scale of the target's final norm ([H], float32): Gemma-style norms multiply
    by ``1 + weight``, Llama-style ones by ``weight``; a target without a final norm scales by 1."""
    base = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    norm = getattr(base, "norm", None)
    if norm is None or not hasattr(norm, "weight"):
        return torch.ones(target.config.get_text_config().hidden_size)
    w = norm.weight.detach().float()
    if type(norm).__name__.startswith("Gemma"):
        w = 1.0 + w
    return w


def compiled_graphs() -> int:
    """How many graphs torch.compile has compiled in this process (read on the host: no device work)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def warming_up(model, shape: tuple) -> bool:
    """Whether this call of `model`'s compiled forward on `shape` is one of the first `COMPILED_WARMUP_CALLS` on
    it in this process (counted here, on the host): its time is no cost. A graph count alone misses the CUDA
    graph's recording, a later call than the compile; one slow observation of a width the schedule then avoids
    would never be corrected."""
    seen = _SHAPE_CALLS.setdefault(model, Counter())
    seen[shape] += 1
    return seen[shape] <= COMPILED_WARMUP_CALLS


@contextmanager
def head_on_positions(target, keep: torch.Tensor | None, shape: tuple[int, int]) -> Iterator[None]:
    """While active, the target's output head computes logits only at the positions `keep` (flat indices into
    the ``shape`` = [B, N] positions of its [B, N, H] input, on the device; None: all); the others come out as 0.
    A batch's draft trees are padded to the widest, and the padded nodes' logits are never read: on a small model
    the head is a fifth of a forward's compute. The head itself runs (once, on the kept rows), so quantized or
    hooked heads work, and the model's elementwise steps after it (soft-capping, scaling) still apply. Inputs of
    any other shape pass through unchanged."""
    if keep is None:  # (a plain step, or trees of one size: nothing to look up)
        yield
        return
    head = target.get_output_embeddings()
    if head is None:
        yield
        return
    own = head.__dict__.get("forward")  # an instance-level forward (e.g. accelerate's hooks) to restore
    original = head.forward

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if tuple(hidden.shape[:2]) != tuple(shape):
            return original(hidden)
        where = keep.to(hidden.device)  # (a target split over devices has its head on the last one)
        flat = hidden.reshape(-1, hidden.shape[-1])  # [B*N, H]
        kept = original(flat.index_select(0, where)[None])[0]  # [R, V] the real positions only
        out = kept.new_zeros(flat.shape[0], kept.shape[-1])  # [B*N, V]
        out.index_copy_(0, where, kept)
        return out.view(*shape, kept.shape[-1])

    head.forward = forward
    try:
        yield
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own
