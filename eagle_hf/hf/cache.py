"""The target's KV cache in tree mode: the tree-cache protocol (`TreeCache`) over transformers' cache, and the
attention masks of a verify forward."""

from __future__ import annotations

import logging

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..ragged import Ragged
from ..tree import DraftTree
from .version import cache_kwarg

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


def select_cache(cache, rows: torch.Tensor) -> None:
    """Keep the given batch rows (an index tensor) in every layer."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, rows.to(layer.keys.device))
        layer.values = layer.values.index_select(0, rows.to(layer.values.device))


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


class TreeCache:
    """The tree-cache protocol: what the tree loop does with the target's cache, for every row of a batch.

    * write: a verify forward writes each row's N tree nodes after the committed slots (`forward_kwargs`; its
      mask from `tree_mask`, whose width comes from the cache);
    * `commit`: each row's accepted nodes move in place into the slots after the committed ones, the rest is
      cropped (O(rows x accepted) per layer; the committed prefix is never copied);
    * `select_rows`: rows leave the batch; `compact`: the holes that shorter paths left go, once worth it.

    `ragged` says which committed slots each row reads (`eagle_hf.ragged`). Implemented here for transformers'
    dynamic cache, which grows by concatenation on every forward (plain decoding's too) and is cropped to a
    view; a cache with fixed buffers implements the same operations with a write position instead."""

    def __init__(self, cache, ragged: Ragged | None = None):
        check_tree_cache(cache)
        self.cache = cache
        self.ragged = ragged or Ragged([], 0)

    @property
    def length(self) -> int:
        """Committed slots (every row has as many; a row's holes among them are hidden by its mask)."""
        return self.cache.get_seq_length()

    def forward_kwargs(self) -> dict:
        return cache_kwarg(self.cache)

    def tree_mask(self, tree: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The verify forward's additive mask [B, 1, N, L + N] for trees `tree` [B, N, N] (bool, device)."""
        return tree_attention_mask(tree, self.ragged.valid, self.length, dtype)

    def padding_mask(self, rows: int) -> torch.Tensor | None:
        """A plain step's 2D mask [B, L + 1] (as plain generate() passes padding), or None without holes."""
        if not self.ragged.holes:
            return None
        return torch.cat([self.ragged.valid, self.ragged.valid.new_ones(rows, 1)], 1).long()

    def commit(self, past_len: int, index: torch.Tensor | None, lengths: list[int], valid: torch.Tensor | None,
               device) -> None:
        """Keep row b's accepted nodes ``index[b]`` ([B, K] relative to `past_len`; None: the first K) in place;
        row b's first ``lengths[b]`` of the K new slots are real (`valid` [B, K] says so on the device, None when
        every row kept K)."""
        width = max(lengths)
        commit_accepted(self.cache, past_len, index, width)
        self.ragged.append(lengths, width, valid, device)

    def select_rows(self, rows: list[int], index: torch.Tensor) -> None:
        """Keep these batch rows (`index`: the same on the device); slots no row reads go at the next compaction."""
        self.ragged.select(rows, index)
        select_cache(self.cache, rows=index)

    def compact(self) -> None:
        """Move each row's real slots to the front of a shorter cache, once every row has many holes."""
        if self.ragged.worth_compacting():
            regather_cache(self.cache, self.ragged.compact())


def new_cache(target):
    """An empty cache for `target` that can be cropped (for cost measurements)."""
    cache = DynamicCache(config=target.config)
    if hasattr(cache, "activate_past_recording"):  # sliding-window layers must be able to roll back
        cache.activate_past_recording()
    return cache
