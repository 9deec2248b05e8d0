"""The target's KV cache and attention masks in tree mode: what the tree loop needs from transformers' cache."""

from __future__ import annotations

import logging

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..tree import DraftTree

logger = logging.getLogger(__name__)


def tree_unsupported_reason(target) -> str | None:
    """Why tree verification cannot run on `target` (None when it can): it needs a plain causal mask to replace."""
    text = target.config.get_text_config()
    attn = getattr(text, "_attn_implementation", "sdpa")
    if attn not in ("sdpa", "eager"):
        return f"its {attn} attention reads a 4D float mask differently (use sdpa or eager attention)"
    types = getattr(text, "layer_types", None)
    if (types and any(t != "full_attention" for t in types)) or (
        getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True)
    ):
        return "it has sliding-window (or other non-causal) attention layers, which cannot take a tree mask"
    if getattr(target, "_is_stateful", False):
        return "it is a stateful (recurrent) model whose state cannot be compacted to a tree path"
    return None


def check_tree_cache(cache) -> None:
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer) or type(layer) is not DynamicLayer:
            raise NotImplementedError(
                f"Tree mode needs a plain DynamicCache; this cache has {type(layer).__name__} layers. "
                "Use draft_mode='chain' (or cache_implementation='dynamic')."
            )


def commit_accepted(cache, past_len: int, index: torch.Tensor | None, width: int) -> None:
    """Keep each row's accepted tree nodes after the prefix, in place, in every layer: row b's nodes ``index[b]``
    ([B, K] on the device, relative to `past_len`; None: the first K nodes) move to slots
    ``past_len .. past_len+K-1`` and the cache is cropped there. A shorter row's slots after its own path are holes
    its mask hides (`eagle_hf.ragged`). O(B * K) per layer: the prefix is never copied, no layer is rebuilt."""
    end = past_len + width
    for layer in cache.layers:
        if index is not None:
            b, h, _, d = layer.keys.shape
            gather = index[:, None, :, None].expand(b, h, width, d)  # [B, H, K, D]
            layer.keys[:, :, past_len:end] = layer.keys[:, :, past_len:].gather(2, gather)
            layer.values[:, :, past_len:end] = layer.values[:, :, past_len:].gather(2, gather)
        if layer.keys.shape[2] > end:  # (a view: the next update concatenates after it)
            layer.keys, layer.values = layer.keys[:, :, :end], layer.values[:, :, :end]


def select_cache(cache, rows: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> None:
    """Keep the given batch rows and/or cache slots (both index tensors) in every layer."""
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name)
            if rows is not None:
                t = t.index_select(0, rows.to(t.device))
            if slots is not None:
                t = t.index_select(2, slots.to(t.device))
            setattr(layer, name, t)


def regather_cache(cache, index: torch.Tensor) -> None:
    """Row b keeps its slots ``index[b]`` ([B, L'] per row), in every layer (the holes' compaction)."""
    for layer in cache.layers:
        b, h, _, d = layer.keys.shape
        gather = index.to(layer.keys.device)[:, None, :, None].expand(b, h, index.shape[1], d)
        layer.keys, layer.values = layer.keys.gather(2, gather), layer.values.gather(2, gather)


def stacked_ancestor_masks(trees: list[DraftTree]) -> torch.Tensor:
    """bool [B, N, N] (host): each tree's ancestor mask, padded to the largest; a padding node sees itself."""
    width = max(t.size for t in trees)
    out = torch.eye(width, dtype=torch.bool).repeat(len(trees), 1, 1)
    for b, t in enumerate(trees):
        out[b, : t.size, : t.size] = t.ancestor_mask()
    return out


def tree_attention_mask(tree: torch.Tensor, valid: torch.Tensor | None, past_len: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """Additive float mask [B, 1, N, L + N] for one verify forward of B trees padded to N nodes: each row's valid
    cache slots (`valid` [B, L]; None: all `past_len` of them), plus each node's ancestors and itself (`tree`
    [B, N, N] bool on the device; padding nodes see only themselves). Built on the device."""
    rows, width = tree.shape[0], tree.shape[1]
    mask = torch.zeros(rows, 1, width, past_len + width, dtype=dtype, device=tree.device)
    low = torch.finfo(dtype).min
    mask[:, 0, :, past_len:].masked_fill_(~tree, low)
    if valid is not None:
        mask[:, 0, :, :past_len].masked_fill_(~valid[:, None, :], low)
    return mask


def new_cache(target):
    """An empty cache for `target` that can be cropped (for cost measurements)."""
    cache = DynamicCache(config=target.config)
    if hasattr(cache, "activate_past_recording"):  # sliding-window layers must be able to roll back
        cache.activate_past_recording()
    return cache
