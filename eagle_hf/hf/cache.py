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


def commit_paths(cache, past_len: int, keeps: list[list[int]]) -> torch.Tensor:
    """Keep each row's accepted tree nodes after the prefix, in every layer; returns their validity [B, K].

    Row b's nodes ``keeps[b]`` (indices relative to `past_len`) move to slots ``past_len .. past_len+len-1``; the
    round's cache grows by K = the longest path, and a shorter row's slots after its own path are holes that its
    mask hides (`RaggedRows`). O(B * K) copies per layer besides the prefix."""
    width = max(len(k) for k in keeps)
    device = cache.layers[0].keys.device
    valid = torch.arange(width) < torch.tensor([len(k) for k in keeps])[:, None]  # [B, K]
    if all(keep == list(range(len(keep))) for keep in keeps):  # every path is a prefix (chains): crop in place
        if cache.layers[0].keys.shape[2] > past_len + width:  # (plain steps keep every slot)
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[:, :, : past_len + width], layer.values[:, :, : past_len + width]
        return valid.to(device)
    index = torch.tensor([keep + [0] * (width - len(keep)) for keep in keeps], device=device)  # [B, K]
    for layer in cache.layers:
        b, h, _, d = layer.keys.shape
        gather = index[:, None, :, None].expand(b, h, width, d)  # [B, H, K, D]
        layer.keys = torch.cat([layer.keys[:, :, :past_len], layer.keys[:, :, past_len:].gather(2, gather)], 2)
        layer.values = torch.cat([layer.values[:, :, :past_len], layer.values[:, :, past_len:].gather(2, gather)], 2)
    return valid.to(device)


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


def tree_attention_mask(trees: list[DraftTree], valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive float mask [B, 1, N, L + N] for one verify forward of B trees padded to N nodes: each row's valid
    cache slots (`valid` [B, L]), plus each node's ancestors and itself; padding nodes see only themselves."""
    rows, width = len(trees), max(t.size for t in trees)
    tree_part = torch.eye(width, dtype=torch.bool).repeat(rows, 1, 1)  # [B, N, N]
    for b, tree in enumerate(trees):
        tree_part[b, : tree.size, : tree.size] = tree.ancestor_mask()
    allowed = torch.cat([valid[:, None, :].expand(rows, width, valid.shape[1]), tree_part.to(valid.device)], 2)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=valid.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def new_cache(target):
    """An empty cache for `target` that can be cropped (for cost measurements)."""
    cache = DynamicCache(config=target.config)
    if hasattr(cache, "activate_past_recording"):  # sliding-window layers must be able to roll back
        cache.activate_past_recording()
    return cache
