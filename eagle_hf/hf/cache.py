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


def compact_cache(cache, past_len: int, keep: torch.Tensor) -> None:
    """Keep the prefix and the accepted tree nodes (`keep`, indices relative to `past_len`) in every layer."""
    for layer in cache.layers:
        index = (past_len + keep).to(layer.keys.device)
        layer.keys = torch.cat([layer.keys[:, :, :past_len], layer.keys.index_select(2, index)], 2)
        layer.values = torch.cat([layer.values[:, :, :past_len], layer.values.index_select(2, index)], 2)


def tree_attention_mask(tree: DraftTree, past_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive float mask [1, 1, N+1, past_len + N+1]: the whole prefix, plus each node's ancestors and itself."""
    allowed = torch.cat([torch.ones(tree.size, past_len, dtype=torch.bool), tree.ancestor_mask()], 1)
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def new_cache(target):
    """An empty cache for `target` that can be cropped (for cost measurements)."""
    cache = DynamicCache(config=target.config)
    if hasattr(cache, "activate_past_recording"):  # sliding-window layers must be able to roll back
        cache.activate_past_recording()
    return cache
