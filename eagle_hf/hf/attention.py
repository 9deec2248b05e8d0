"""Tree verification on every attention kernel: one function registered through transformers' attention interface.

A verify forward attends with a 4D additive mask (each tree node sees the committed slots, its ancestors and
itself). Flash-attention and flex kernels cannot read such a mask, and transformers' sdpa path reads it by
repeating K/V for grouped-query attention in every layer (O(context) per layer per round). So the tree loop marks
its verify forwards with the keyword `TREE_VERIFY`, which transformers hands down to the attention function;
`routed_kernel` registers, under the target's own kernel name, one function that computes `tree_attention` when
it sees the keyword and otherwise calls the kernel it wraps, unchanged.

The switch travels with the forward call: nothing about the user's model changes (its `attn_implementation`
stays), a plain forward never takes the tree path, and two threads sharing a model never see each other's
switch. Eager attention reads the 4D mask itself (with its model-specific extras): it is not wrapped.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

logger = logging.getLogger(__name__)

#: the keyword a verify forward passes down to the attention function
TREE_VERIFY = "eagle_hf_tree_verify"

# kernel name -> (the function registered by us, the kernel it wraps)
_ROUTED: dict[str, tuple[Callable, Callable]] = {}
# (the last mask seen, its groups, its tiled copy): a verify forward tiles its mask once for all its layers
_last_tiled: tuple = (None, 0, None)


def kernel_name(target) -> str:
    """The attention implementation `target`'s text layers use (transformers' name)."""
    return getattr(target.config.get_text_config(), "_attn_implementation", None) or "sdpa"


def kernel_unsupported_reason(name: str) -> str | None:
    """Why a verify forward cannot be routed on kernel `name` (None when it can)."""
    if name.startswith("paged"):
        return f"its {name} attention serves transformers' continuous batching, which has no draft trees"
    if name != "eager" and name not in ALL_ATTENTION_FUNCTIONS:
        return f"its attention implementation {name!r} is not registered in transformers' AttentionInterface"
    return None


def routed_kernel(target) -> dict:
    """The keywords that route `target`'s verify forwards to `tree_attention`, registering the routing function
    under its kernel's name first (once; again if someone registered another function under that name since).
    Eager attention takes the tree mask as it is: no keywords."""
    name = kernel_name(target)
    if name == "eager":
        return {}
    current = ALL_ATTENTION_FUNCTIONS[name]
    routed = _ROUTED.get(name)
    if routed is None or current is not routed[0]:
        function = functools.partial(_tree_or_kernel, name)
        _ROUTED[name] = (function, current)
        AttentionInterface.register(name, function)
        logger.info("Tree verification routed through eagle_hf's attention function on %s targets.", name)
    return {TREE_VERIFY: True}


def unroute_all() -> None:
    """Give every wrapped kernel name its own function back (`eagle_hf.hf.uninstall`)."""
    for name, (function, kernel) in list(_ROUTED.items()):
        if ALL_ATTENTION_FUNCTIONS.get(name) is function:
            AttentionInterface.register(name, kernel)
        del _ROUTED[name]


def _tree_or_kernel(name: str, module, query, key, value, attention_mask, **kwargs):
    """The function registered under kernel `name`: a verify forward's attention, or the kernel's own."""
    if kwargs.pop(TREE_VERIFY, False):
        return tree_attention(module, query, key, value, attention_mask, **kwargs)
    return _ROUTED[name][1](module, query, key, value, attention_mask, **kwargs)


def tree_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor, scaling: float | None = None, softcap=None, s_aux=None,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """Attention under a tree mask, grouped-query without repeating K/V.

    query [B, H, N, D], key [B, Hkv, L, D], value [B, Hkv, L, Dv], attention_mask [B, 1, N, L] additive (float) →
    ([B, N, H, Dv], None), the layout every transformers attention function returns. The G = H / Hkv query heads
    that share a K/V head are stacked into one block of G x N queries against that head's keys; the mask, the same
    for every head, is tiled G times along the queries (once per forward, not per layer). Dropout is off: a verify
    forward runs in eval mode."""
    if softcap is not None or s_aux is not None:
        raise NotImplementedError(
            "eagle_hf's tree verification does not implement attention soft-capping or sinks; "
            "load the target with attn_implementation='eager' or use draft_mode='chain'."
        )
    b, heads, n, d = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    grouped = query.reshape(b, kv_heads, groups * n, d)  # head h = kv * G + g  ->  head kv, queries g*N .. g*N+N-1
    mask = _tiled(attention_mask.to(query.dtype), groups)  # [B, 1, G*N, L]
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling)  # [B, Hkv, G*N, Dv]
    return out.reshape(b, heads, n, -1).transpose(1, 2).contiguous(), None  # [B, N, H, Dv]


def _tiled(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """`mask` [B, 1, N, L] repeated `groups` times along the queries: [B, 1, G*N, L]. Every layer of a forward gets
    the same mask object: the last one's tiling is reused."""
    global _last_tiled
    if groups == 1:
        return mask
    if torch.compiler.is_compiling():  # (a compiled forward fuses the tiling; no memo to trace)
        return mask.repeat(1, 1, groups, 1)
    seen, seen_groups, tiled = _last_tiled
    if seen is not None and seen() is mask and seen_groups == groups:
        return tiled
    tiled = mask.repeat(1, 1, groups, 1)
    _last_tiled = (weakref.ref(mask), groups, tiled)
    return tiled
