"""What eagle_hf reads from transformers' model classes and utilities (outside generate())."""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

logger = logging.getLogger(__name__)

#: calls of transformers' compiled forward on a new input shape that run slower than the rest: the one that
#: compiles, then (mode "reduce-overhead") the CUDA graph's warm-up run and its recording
COMPILED_WARMUP_CALLS = 3
_SHAPE_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Counter of input shapes


def forward_parameters(model) -> Mapping[str, inspect.Parameter]:
    """The parameters of `model`'s class's forward, read once per forward function (`inspect.signature` costs a
    call's routing tens of microseconds; a forward patched on the class is read anew)."""
    return _parameters_of(type(model).forward)


@functools.lru_cache(maxsize=64)
def _parameters_of(forward) -> Mapping[str, inspect.Parameter]:
    return inspect.signature(forward).parameters


#: id(configuration) -> (it, its text configuration), held weakly (`text_config`)
_TEXT_CONFIGS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def text_config(model):
    """`model`'s text configuration (``config.get_text_config()``), looked up once per configuration object: a
    transformers configuration's attribute reads cost microseconds each, and a call's routing and loop read it
    some eighteen times."""
    config = model.config
    kept = _TEXT_CONFIGS.get(id(config))
    if kept is not None and kept[0]() is config and (text := kept[1]()) is not None:
        return text
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    key = id(config)
    try:
        _TEXT_CONFIGS[key] = (weakref.ref(config, lambda _, k=key: _TEXT_CONFIGS.pop(k, None)), weakref.ref(text))
    except TypeError:  # (a stand-in configuration that takes no weak reference: read every time)
        pass
    return text


def compiled_graphs() -> int:
    """How many graphs torch.compile has compiled in this process (read on the host: no device work)."""
    return _dynamo_counters()["stats"]["unique_graphs"]


@functools.cache
def _dynamo_counters() -> dict:
    """torch.compile's counters of this process (imported once: a round reads them twice)."""
    from torch._dynamo.utils import counters

    return counters


#: whether the compiled verify forward keeps a graph per width (`specialise_width`); False leaves the width to
#: torch.compile's automatic dynamic shapes (one dynamic-shape graph for every width after the second), which the
#: device check times beside it
STATIC_WIDTHS = True
#: torch.compile's recompile limit while the compiled forward runs a graph per verify width (bucket, with and
#: without a tree mask, as the batch size changes): its default 8 would send later shapes to eager
RECOMPILE_ROOM = 32


def specialise_width(ids: torch.Tensor, kwargs: dict) -> None:
    """The compiled forward keeps one graph per verify width: the inputs' width dimension is marked static, so
    that torch.compile's automatic dynamic shapes (a dimension seen with a second value becomes dynamic) does not
    turn it into one dynamic-shape graph, whose generic kernels would then run every width, plain rounds' too (a
    plain generate() step runs a graph specialised to width 1). The widths are a few buckets
    (`eagle_hf.hf.cache.VERIFY_BUCKETS`); the batch dimension and the cache's length may still become dynamic.
    Nothing where `STATIC_WIDTHS` is off."""
    import torch._dynamo

    if not STATIC_WIDTHS:
        return
    config = torch._dynamo.config
    if config.recompile_limit < RECOMPILE_ROOM:
        logger.info("torch._dynamo.config.recompile_limit raised from %d to %d: a compiled graph per verify width",
                    config.recompile_limit, RECOMPILE_ROOM)
        config.recompile_limit = RECOMPILE_ROOM
    torch._dynamo.mark_static(ids, 1)  # [B, N]
    if kwargs.get("position_ids") is not None:
        torch._dynamo.mark_static(kwargs["position_ids"], 1)  # [B, N]
    mask = kwargs.get("attention_mask")
    for tensor in mask.values() if isinstance(mask, dict) else [mask]:
        if tensor is not None and tensor.dim() == 4:  # [B, 1, N, C] (a 2D padding mask [B, L + 1] grows)
            torch._dynamo.mark_static(tensor, 2)


def query_scale_step(target) -> int | None:
    """Every how many cache slots transformers steps the query scale of `target`'s layers (None: it does not
    scale by slot). Llama 4's NoPE layers (`attn_temperature_tuning`) multiply a query at slot x by
    ``1 + attn_scale * log1p(floor((x + 1) / floor_scale))``; a tree's node sits at slot length + i but at
    position length + depth, so a tree must stop short of the next step (`slots_before_step`) to be scaled as
    plain decoding scales it (a batch's holes still shift the slots, as they shift plain decoding's padding)."""
    text = text_config(target)
    nope = [not rope for rope in getattr(text, "no_rope_layers", None) or []]
    return text.floor_scale if getattr(text, "attn_temperature_tuning", False) and any(nope) else None


def slots_before_step(step: int, length: int) -> int:
    """The nodes a verify forward may hold from slot `length` on before the query scale's next step."""
    return ((length + 1) // step + 1) * step - 1 - length


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
