"""Indexed (sparse) attention under a draft tree: DeepSeek V3.2's layers of type ``"indexed_attention"``.

Such a layer's indexer scores every key a query may read and keeps the top `index_topk`; the attention reads only
those. transformers' indexer (`DeepseekV32Indexer.forward`) adds the layer's 4D mask to its scores before the
top-k, and the attention masks the keys it did not select on top of that same mask. So a verify forward's tree
mask keeps a node's non-ancestor slots out of the indexer's candidates, not only out of its attention: each node
selects among the committed slots and its ancestors, as plain decoding of its path selects among that path's
keys (when a node sees fewer keys than `index_topk`, the top-k takes some hidden slots too, and the attention
mask keeps them hidden; plain decoding reads every key then). The layers take the tree mask by their layer type
(`eagle_hf.hf.cache.Window`: they read the whole context). Keys whose scores tie exactly at the top-k's edge (the
indexer's ReLU scores are exactly 0 for a key every indexer head scores below 0) are chosen by torch.topk, whose
tie-break depends on the candidate row's length: there a tree, like transformers' own prefill, may choose
otherwise than plain decoding.

The indexer keeps its own key cache beside the main one: ``indexer_keys`` [B, L, D] on transformers'
`DynamicIndexedLayer` (grown by concatenation) and `StaticIndexedLayer` (a buffer written at its own position,
``indexer_cumulative_length``). A verify forward writes every node's indexer key, so each tree-cache operation
on the main keys (`eagle_hf.hf.cache`) does the same to these: the functions here are the only code that reads
them.

Only indexers eagle_hf has checked are served (`CHECKED`): others, those that score compressed blocks or pools
of keys (a block mixes a node's ancestors with its siblings), keep the chain fallback.
"""

from __future__ import annotations

import torch
from transformers import cache_utils

from .models import text_config

#: transformers' cache layers that keep an indexer's keys (none in versions before indexed attention)
DYNAMIC_INDEXED = tuple(c for c in [getattr(cache_utils, "DynamicIndexedLayer", None)] if c is not None)
STATIC_INDEXED = tuple(c for c in [getattr(cache_utils, "StaticIndexedLayer", None)] if c is not None)
#: transformers' layer type of indexed attention
INDEXED = "indexed_attention"
#: model types whose indexer selects each query's keys under its 4D mask, one key at a time (checked)
CHECKED = ("deepseek_v32",)


def has_indexed_layers(target) -> bool:
    """Whether some of `target`'s layers select their keys with an indexer."""
    return INDEXED in (getattr(text_config(target), "layer_types", None) or ())


def indexed_unsupported_reason(target) -> str | None:
    """Why a verify forward cannot keep `target`'s indexed layers exact (None when it can, or it has none)."""
    if not has_indexed_layers(target):
        return None
    kind = getattr(text_config(target), "model_type", "")
    if kind in CHECKED:
        return None
    return (f"its {INDEXED} layers ({kind}) select keys with an indexer that eagle_hf has not checked under a tree "
            f"mask (checked: {', '.join(CHECKED)})")


def _indexed(layer) -> bool:
    keys = getattr(layer, "indexer_keys", None)
    return getattr(layer, "is_indexer_initialized", False) and keys is not None and keys.numel() > 0


def move_accepted_index_keys(layer, past_len: int, index: torch.Tensor, width: int) -> None:
    """Row b's indexer keys of nodes ``index[b]`` ([B, K] relative to `past_len`) to slots ``past_len ..
    past_len+K-1``, in place (the main keys' `eagle_hf.hf.cache._move_accepted`)."""
    if not _indexed(layer):
        return
    keys = layer.indexer_keys  # [B, L, D]
    b, _, d = keys.shape
    gather = index.to(keys.device)[:, :, None].expand(b, width, d)
    keys[:, past_len : past_len + width] = keys[:, past_len:].gather(1, gather)


def end_index_keys(layer, end: int) -> None:
    """The indexer keys end at slot `end`, as the main keys do after a commit: a dynamic layer's are cropped to a
    view, a static layer's write position is set there (on the device, in place)."""
    if not _indexed(layer):
        return
    position = getattr(layer, "indexer_cumulative_length", None)
    if position is not None:
        position.fill_(end)
    elif layer.indexer_keys.shape[1] > end:
        layer.indexer_keys = layer.indexer_keys[:, :end]


def select_index_rows(layer, rows: torch.Tensor) -> None:
    """Keep the given batch rows (an index tensor) of the indexer keys."""
    if _indexed(layer):
        layer.indexer_keys = layer.indexer_keys.index_select(0, rows.to(layer.indexer_keys.device))


def regather_index_keys(layer, index: torch.Tensor) -> None:
    """Row b keeps its indexer keys of slots ``index[b]`` ([B, L'] per row), as the main keys do (the holes'
    compaction): a static layer rewrites its first L' slots and sets its write position after them."""
    if not _indexed(layer):
        return
    keys = layer.indexer_keys
    b, _, d = keys.shape
    kept = keys.gather(1, index.to(keys.device)[:, :, None].expand(b, index.shape[1], d))
    position = getattr(layer, "indexer_cumulative_length", None)
    if position is not None:
        keys[:, : index.shape[1]] = kept
        position.fill_(index.shape[1])
    else:
        layer.indexer_keys = kept
