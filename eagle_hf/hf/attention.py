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

At long contexts the masked kernels read the whole cache in one pass per K/V head: a handful of GPU blocks for
thousands of keys (219 us a layer at 8k on an H100, against 30 us for plain decoding). When every tree node sees
every committed slot (no holes: the loop says so with `TREE_PREFIX`, the committed length), `split_key_attention`
reads the committed prefix without a mask, in chunks that run as separate heads of one flash-attention call (keys
split over many blocks), the rest under the tree mask by matmuls, and merges the parts exactly by their
log-sum-exps.
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

from .models import text_config

logger = logging.getLogger(__name__)

#: the keyword a verify forward passes down to the attention function
TREE_VERIFY = "eagle_hf_tree_verify"
#: the keyword that says every node sees the first `n` cache slots (the committed prefix, no holes): split keys
TREE_PREFIX = "eagle_hf_tree_prefix"
#: keys per chunk of the prefix (at least): chunks run as heads of one flash-attention call
SPLIT_KEYS = 512
#: committed slots from which a verify forward splits its keys, per device type (a type not named: never). An
#: uncompiled verify forward is host-bound at short contexts: the split saves device time (at 8k on an H200, a tree
#: round's 19.4 ms to 12.1 ms) that the host's launches hide there; its masked attention grows by about 1.4 ms per
#: 1k tokens a round (8B shape), so the device's time passes the host's from about 16k (docs/gpu.md). The split
#: answers the GPU's masked kernels, which walk thousands of keys in a handful of blocks: other devices never split
#: (the tests and the device check set other values).
SPLIT_KEY_FROM = {"cuda": 16384}

# kernel name -> (the function registered by us, the kernel it wraps)
_ROUTED: dict[str, tuple[Callable, Callable]] = {}
# (the last mask seen, its groups, its tiled copy): a verify forward tiles its mask once for all its layers
_last_tiled: tuple = (None, 0, None)
# (the last mask seen, its cut, the masked call's bias over its columns from the cut): `_tail_bias`
_last_tail: tuple = (None, 0, None)


def kernel_name(target) -> str:
    """The attention implementation `target`'s text layers use (transformers' name)."""
    return getattr(text_config(target), "_attn_implementation", None) or "sdpa"


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


def split_keys_from(tree_kwargs: dict, cache, compiled, device: torch.device) -> int | None:
    """The committed length from which a verify forward splits its keys (`split_key_attention`), or None: never.
    `SPLIT_KEY_FROM` slots of the device's type, where the tree attention is routed (not eager), the forward is not
    compiled (it would recompile for every committed length) and the cache grows (a static cache's free slots are
    masked)."""
    if not tree_kwargs or compiled is not None or cache.free is not None:
        return None
    return SPLIT_KEY_FROM.get(device.type)


def unroute_all() -> None:
    """Give every wrapped kernel name its own function back (`eagle_hf.hf.uninstall`)."""
    for name, (function, kernel) in list(_ROUTED.items()):
        if ALL_ATTENTION_FUNCTIONS.get(name) is function:
            AttentionInterface.register(name, kernel)
        del _ROUTED[name]


def _tree_or_kernel(name: str, module, query, key, value, attention_mask, **kwargs):
    """The function registered under kernel `name`: a verify forward's attention, or the kernel's own."""
    prefix = kwargs.pop(TREE_PREFIX, None)
    if kwargs.pop(TREE_VERIFY, False):
        return tree_attention(module, query, key, value, attention_mask, prefix=prefix, **kwargs)
    return _ROUTED[name][1](module, query, key, value, attention_mask, **kwargs)


def tree_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor, scaling: float | None = None, softcap=None, s_aux=None,
                   prefix: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention under a tree mask, grouped-query without repeating K/V.

    query [B, H, N, D], key [B, Hkv, L, D], value [B, Hkv, L, Dv], attention_mask [B, 1, N, L] additive (float) →
    ([B, N, H, Dv], None), the layout every transformers attention function returns. The G = H / Hkv query heads
    that share a K/V head are stacked into one block of G x N queries against that head's keys; the mask, the same
    for every head, is tiled G times along the queries (once per forward, not per layer). Dropout is off: a verify
    forward runs in eval mode. `prefix`: every node sees the first `prefix` slots (`split_key_attention`)."""
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
    if prefix:
        out = split_key_attention(grouped, key, value, mask, prefix, d**-0.5 if scaling is None else scaling)
    else:
        out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling)  # [B, Hkv, G*N, Dv]
    return out.reshape(b, heads, n, -1).transpose(1, 2).contiguous(), None  # [B, N, H, Dv]


def split_key_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                        prefix: int, scale: float) -> torch.Tensor:
    """Masked attention split at the committed prefix, exactly: query [B, Hkv, Q, D] (the stacked query heads),
    key/value [B, Hkv, L, D], mask [B, 1, Q, L] additive, every query seeing slots ``0 .. prefix-1`` -> [B, Hkv, Q, Dv].

    The prefix's first ``S * c`` keys are S chunks of c (at least `SPLIT_KEYS`), viewed as S heads of one unmasked
    flash-attention call (no copy of the keys: the B and Hkv dimensions merge, the keys split), each with its
    log-sum-exp; the remaining slots (the prefix's last few and the tree's) in one masked call with its own; the
    S + 1 parts weighed by the softmax of their log-sum-exps. A handful of kernels a layer: the loop that launches
    them is the host's, and an eager verify forward is host-bound."""
    b, kv, q, d = query.shape
    splits = max(1, prefix // SPLIT_KEYS)
    chunk = prefix // splits
    cut = splits * chunk
    keys = key[:, :, :cut].reshape(b * kv, splits, chunk, d)  # [B*Hkv, S, c, D]
    values = value[:, :, :cut].reshape(b * kv, splits, chunk, value.shape[-1])
    queries = query.reshape(b * kv, 1, q, d).expand(b * kv, splits, q, d)
    out_p, lse_p = _attention_with_lse(queries, keys, values, scale)  # [B*Hkv, S, Q, Dv], [B*Hkv, S, Q]
    out_t, lse_t = _attention_with_lse(query, key[:, :, cut:], value[:, :, cut:], scale, _tail_bias(mask, cut, kv))
    lse = torch.cat([lse_p.view(b, kv, splits, q), lse_t.view(b, kv, 1, q)], 2)  # [B, Hkv, S+1, Q] float32
    parts = torch.cat([out_p.view(b, kv, splits, q, -1), out_t.view(b, kv, 1, q, -1)], 2)  # [B, Hkv, S+1, Q, Dv]
    return (lse.softmax(2)[..., None] * parts).sum(2).to(query.dtype)


def _attention_with_lse(query, key, value, scale: float, bias: torch.Tensor | None = None):
    """Attention and its log-sum-exp (the public SDPA returns none): query [B, H, Q, D], key/value [B, H, L, D],
    `bias` None or additive [B, H, Q, L] (broadcast views allowed) -> ([B, H, Q, Dv], [B, H, Q] float32). torch's
    flash kernel (the CPU's: any dtype and a mask; CUDA's: half precision, no mask), else its memory-efficient one."""
    if query.device.type != "cuda":
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, False,
                                                                          attn_mask=bias, scale=scale)
        return out[0], out[1].float()
    if bias is None and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256:
        out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, False, False, scale=scale)
        return out[0], out[1]
    out = torch.ops.aten._scaled_dot_product_efficient_attention(query.contiguous(), key, value, bias, True,
                                                                  scale=scale)
    return out[0], out[1][..., : query.shape[2]]


def _tail_bias(mask: torch.Tensor, cut: int, heads: int) -> torch.Tensor:
    """The mask's columns from `cut` on as the masked call's bias: [B, Hkv, Q, L - cut] in the query's dtype, a
    broadcast view of a fresh buffer whose rows start at multiples of 16 elements (the memory-efficient kernel's
    alignment). Every layer of a forward gets the same mask and cut: the last one's is reused."""
    global _last_tail
    seen, seen_cut, tail = _last_tail
    if seen is not None and seen() is mask and seen_cut == cut and tail.shape[1] == heads:
        return tail
    b, _, q, length = mask.shape
    width = length - cut
    buffer = mask.new_empty(b, 1, q, -(-width // 16) * 16)  # [B, 1, Q, W'] (W' >= W, aligned rows)
    buffer[..., :width] = mask[..., cut:]
    tail = buffer[..., :width].expand(b, heads, q, width)
    _last_tail = (weakref.ref(mask), cut, tail)
    return tail


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
