"""The target's KV cache in tree mode: the tree-cache protocol (`TreeCache`) over transformers' cache, and the
attention masks of a verify forward, by layer type where some layers do not read the whole context.

Targets whose layers do not all read the whole context under a draft tree: sliding-window layers (Gemma 2
and 3, Mistral, Qwen2 with `use_sliding_window`, gpt-oss) and chunked-attention layers (Llama 4).

A layer of sliding window W lets a query at position p read the keys at positions above p - W (transformers'
`sliding_window_overlay`); a chunked layer of chunk C the keys of p's own chunk, positions with the same p // C
(`chunked_overlay`, counted from a row's first token). During a call eagle_hf keeps every layer's keys (these
layers' too: their cache layers grow like the others, `eagle_hf.hf.cache.GrowingLayer`), so a verify forward's
mask says what each layer type reads: the tree mask for full-attention layers, the same with the keys out of
each node's window or chunk hidden for the others, by the tokens' positions (a batch's rows have holes among
their slots). transformers' models with layer types take such masks as a dict keyed by layer type; a model
without layer types (Mistral) applies its one window to every layer, and takes the one mask.

GPT-Neo names its layer types otherwise (`attention_layers`: "global" and "local", the window `window_size`) and
applies its local window inside the model, by cache slot: a tree's nodes sit in slots past their positions, so
the model itself would hide keys that plain decoding of their path reads. No mask can widen that window: such a
model runs chains in transformers' loop, whose slots are its positions.
"""

from __future__ import annotations

import inspect
import logging
from collections import OrderedDict
from typing import NamedTuple

import torch
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from ..programs import Ints, Program
from ..speculation.ragged import KeptMask, Ragged, SlotBuffers
from .attention import kernel_name, kernel_unsupported_reason
from .indexed import (
    DYNAMIC_INDEXED,
    STATIC_INDEXED,
    end_index_keys,
    move_accepted_index_keys,
    regather_index_keys,
    select_index_rows,
)
from .models import forward_parameters, text_config
from .recurrent import RECURRENT_TYPES, attention_layers, is_hybrid, recurrent_layers, select_recurrent_rows
from .version import cache_kwarg

logger = logging.getLogger(__name__)

#: the verify forward's widths with a compiled forward (beyond the last: multiples of 64); a static cache keeps
#: room for the widest after its last committed token, a dynamic one at least as much after a reallocation
#: (`eagle_hf.speculation.ragged.MIN_ROOM`)
VERIFY_BUCKETS = (1, 4, 8, 16, 32, 64)
#: the fewest slots a static cache's commit program moves (a power of two; the kept nodes padded): one program
#: serves every round that keeps up to this many. generate() makes a new static cache each call, so each call
#: makes its commit programs again (on CUDA: captures them): one, rather than one per power of two up to 8
COMMIT_WIDTH = 8


#: transformers' cache layers that keep a window (sliding and chunked layers alike)
_WINDOWED = (DynamicSlidingWindowLayer, StaticSlidingWindowLayer)
#: the cache layers that can hold draft trees: a dynamic cache's, or a static cache's (indexed layers keep their
#: indexer's keys beside the main ones: `eagle_hf.hf.indexed`)
_DYNAMIC = {DynamicLayer, DynamicSlidingWindowLayer, *DYNAMIC_INDEXED}
_STATIC = (StaticLayer, StaticSlidingWindowLayer, *STATIC_INDEXED)


def tree_unsupported_reason(target) -> str | None:
    """Why tree verification cannot run on `target` (None when it can): it needs a plain causal mask to replace."""
    text = text_config(target)
    reason = kernel_unsupported_reason(kernel_name(target))
    if reason:
        return reason
    if kernel_name(target) != "eager":  # (eager attention reads the tree mask with the model's own arithmetic)
        if getattr(text, "attn_logit_softcapping", None) is not None:
            return ("its attention soft-caps its logits, which eagle_hf's tree attention does not; load it with "
                    "attn_implementation='eager' to keep the tree")
        if getattr(text, "model_type", "") == "gpt_oss":
            return ("its attention has sinks, which eagle_hf's tree attention does not; load it with "
                    "attn_implementation='eager' to keep the tree")
    if getattr(target, "_is_stateful", False) and not is_hybrid(target):  # (a hybrid's state is rewound: chains)
        return "it is a stateful (recurrent) model whose state cannot be compacted to a tree path"
    if getattr(text, "keep_window_size", None) is not None:
        return ("its attention adds a dynamic mask of its own per head (keep_window_size), which eagle_hf's tree "
                "attention does not take")
    if getattr(text, "cross_attention_layers", None):
        return "its cross-attention layers keep cache layers of their own, which a tree commit cannot cut to a path"
    return cacheless_reason(target)


def cacheless_reason(target) -> str | None:
    """Why `target` keeps no transformers cache that drafts can be verified against (None: it keeps one): its
    forward takes no cache (every step recomputes the whole sequence), or it keeps its past in a format of its
    own (transformers builds it no `DynamicCache`)."""
    parameters = forward_parameters(target)
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())  # (a wrapper's **kwargs)
    if not open_ended and not {"cache", "past_key_values"} & set(parameters):
        return "its forward takes no cache (each step recomputes the whole sequence)"
    if not type(target)._supports_default_dynamic_cache():
        return "it keeps its past in a format of its own, not a transformers cache"
    return None


def cache_unsupported_reason(cache=None, implementation: str | None = None) -> str | None:
    """Why the tree loop cannot hold draft trees in this cache (None when it can): transformers' dynamic and
    static caches only. `cache`: a cache object passed in; `implementation`: generate()'s `cache_implementation`."""
    if cache is not None:
        if any(type(layer) in _WINDOWED and layer.is_initialized for layer in cache.layers):
            return ("the cache passed in holds sliding-window layers that keep only their window; a draft tree "
                    "needs a fresh cache (eagle_hf keeps every token's keys during a call)")
        recurrent = {id(layer) for layer in recurrent_layers(cache)}  # (a hybrid's: rewound by the loop)
        kinds = {type(layer) for layer in cache.layers if id(layer) not in recurrent} - {DummyLayer}
        if kinds and not (kinds <= {*_DYNAMIC, GrowingLayer} or kinds <= set(_STATIC)):
            names = ", ".join(sorted(k.__name__ for k in kinds))
            return f"its cache ({names} layers) cannot hold draft trees (dynamic and static caches can)"
    elif implementation not in (None, "dynamic", "static"):
        return f"its {implementation!r} cache cannot hold draft trees (dynamic and static caches can)"
    return None


def is_static(cache=None, implementation: str | None = None) -> bool:
    """Whether the call's cache is transformers' static cache (`cache` passed in, else generate()'s
    `cache_implementation`)."""
    if cache is not None:
        layers = attention_layers(cache)  # (a hybrid's recurrent layers are the same in either cache)
        return bool(layers) and all(type(layer) in _STATIC for layer in layers)
    return implementation == "static"


def hold_whole_windows(cache, slots: int) -> None:
    """A static cache's sliding and chunked layers (`StaticSlidingWindowLayer`: buffers of the window's size that
    roll) become static layers of the cache's full length, before the prefill: a tree's nodes need the keys
    behind the window of the committed tokens, and commits move nodes in place. The verify masks apply the
    windows (`Window`); the returned cache keeps every key (plain decoding on it masks by the
    config's window too). `slots`: the length when no layer gives it (every layer slides, as in Mistral)."""
    full = [layer.max_cache_len for layer in cache.layers if type(layer) is StaticLayer]
    for i, layer in enumerate(cache.layers):
        if type(layer) is StaticSlidingWindowLayer:
            cache.layers[i] = StaticLayer(max_cache_len=max(full) if full else slots)


def tree_cache(cache, ragged: Ragged | None = None, slots: int | None = None) -> TreeCache:
    """The tree-cache protocol over `cache`: `StaticTreeCache` for transformers' static cache (`slots`: the length
    its sliding layers get when no layer gives it, `hold_whole_windows`), else `TreeCache`."""
    reason = cache_unsupported_reason(cache)
    if reason:  # (generate() falls back to chain mode before this: a cache passed some other way)
        raise NotImplementedError(f"Tree mode: {reason}. Use draft_mode='chain' or cache_implementation='dynamic'.")
    if is_static(cache):
        hold_whole_windows(cache, slots or max(layer.max_cache_len for layer in attention_layers(cache)))
        return StaticTreeCache(cache, ragged)
    return TreeCache(cache, ragged)


class GrowingLayer(DynamicLayer):
    """transformers' dynamic cache layer, grown in place. Its keys and values are views [B, H, L, D] of buffers
    with room after the L live slots; a forward writes its slots into that room and the views lengthen. transformers'
    `DynamicLayer` concatenates instead: a copy of the whole cache every forward, and on a GPU a slow strided one
    once a commit has cropped the cache to a view (3.3x the contiguous copy at 8k tokens on an H100: docs/gpu.md).
    Here a forward writes only its own slots into buffers that grow in place (`SlotBuffers`: reallocated by the
    growth rule of both caches, `eagle_hf.speculation.ragged.grown_capacity`), never past `slot_limit` slots when
    there is one (the call's longest sequence and a verify forward). A layer writes in place only into buffers it
    allocated in this call (`_buffers`): a cache passed in, or keys that something else replaced, get buffers of
    their own at the next write; rows leave and holes are compacted in its buffers (`select_rows`, `regather`).
    `TreeCache.begin` turns the dynamic layers of the call's cache into these, `release` back."""

    slot_limit: int | None = None
    _buffers: SlotBuffers | None = None  # keys and values [B, H, capacity, D]; the live slots: `keys`, `values`

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or self.keys.numel() == 0:  # the first write (a prefill): a plain tensor
            return super().update(key_states, value_states, *args, **kwargs)
        b, h, length, d = self.keys.shape
        n = key_states.shape[2]
        if key_states.shape != (b, h, n, d) or key_states.dtype != self.keys.dtype:  # (no silent broadcast or cast)
            return super().update(key_states, value_states, *args, **kwargs)  # what transformers does with it
        slots = self._owned()
        if slots is None:  # someone else's tensors: copied into buffers of its own, with room for these slots
            slots = self._buffers = SlotBuffers.holding((self.keys, self.values), n, self.slot_limit)
        self.keys, self.values = slots.write(length, (key_states, value_states))
        return self.keys, self.values

    def _owned(self) -> SlotBuffers | None:
        """Its buffers, while its keys and values are their live slots (a commit crops them to a shorter view)."""
        slots = self._buffers
        return slots if slots is not None and slots.holds((self.keys, self.values)) else None

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the given batch rows (an index tensor): in its buffers, room included, when they hold the keys."""
        slots = self._owned()
        if slots is None:
            self.keys, self.values = (t.index_select(0, rows.to(t.device)) for t in (self.keys, self.values))
            return
        slots.select(rows)
        self.keys, self.values = slots.live(self.keys.shape[2])

    def regather(self, index: torch.Tensor) -> None:
        """Row b keeps its slots ``index[b]`` ([B, L'] per row; the holes' compaction), in new buffers with room."""
        slots = self._owned()
        if slots is None:
            self.keys, self.values = (t.gather(2, _slots(index, t)) for t in (self.keys, self.values))
            return
        slots.compact(index)
        self.keys, self.values = slots.live(index.shape[1])


def grow_in_place(cache, slot_limit: int | None = None) -> None:
    """The call's dynamic cache layers grow in place (`GrowingLayer`), layers the prefill adds too, until
    `stop_growing_in_place`. Indexed layers (DeepSeek V3.2's, `eagle_hf.hf.indexed`) keep transformers' own
    growth by concatenation: correct, but a copy of the layer's cache per round, dearer at long context."""
    for layer in cache.layers:
        if type(layer) is DynamicSlidingWindowLayer:  # (it keeps every key too: the verify forward's mask
            layer.slides = True  # applies its window, `Window`)
            layer.__class__ = GrowingLayer
        if type(layer) is DynamicLayer:
            layer.__class__ = GrowingLayer
        if type(layer) is GrowingLayer:
            layer.slot_limit = slot_limit
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:  # (a DynamicCache() without a config)

        def replicate() -> GrowingLayer:
            layer = GrowingLayer()
            layer.slot_limit = slot_limit
            return layer

        replicate.grows_in_place = True
        cache.layer_class_to_replicate = replicate


def stop_growing_in_place(cache) -> None:
    """Back to transformers' own layers (the views stay: the next concatenation copies from them)."""
    for layer in cache.layers:
        if type(layer) is GrowingLayer:
            layer.__class__ = DynamicSlidingWindowLayer if layer.__dict__.pop("slides", False) else DynamicLayer
            layer.__dict__.pop("_buffers", None)
            layer.__dict__.pop("slot_limit", None)
            if type(layer) is DynamicSlidingWindowLayer and layer.is_initialized:  # its window, as it keeps it
                layer.cumulative_length = layer.keys.shape[-2]
                keep = layer.sliding_window - 1
                layer.keys, layer.values = layer.keys[:, :, -keep:], layer.values[:, :, -keep:]
    if getattr(getattr(cache, "layer_class_to_replicate", None), "grows_in_place", False):
        cache.layer_class_to_replicate = DynamicLayer


def _slots(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`index` [B, K] (slots along dimension 2) expanded to gather from `like` [B, H, L, D]: [B, H, K, D]. Keys and
    values may differ in heads and widths (multi-head latent attention caches a latent and a rotary key)."""
    b, h, _, d = like.shape
    return index.to(like.device)[:, None, :, None].expand(b, h, index.shape[1], d)


def _move_accepted(layer, past_len: int, index: torch.Tensor, width: int, expanded: dict | None = None) -> None:
    """Row b's nodes ``index[b]`` ([B, K] relative to `past_len`) to slots ``past_len .. past_len+K-1``, in place.
    `expanded`: the index expanded per shape and device (`_slots`), shared by the layers of one commit."""
    end = past_len + width
    expanded = {} if expanded is None else expanded
    for t in (layer.keys, layer.values):
        shape = (t.shape[1], t.shape[3], t.device)
        slots = expanded.get(shape)
        if slots is None:
            slots = expanded[shape] = _slots(index, t)
        t[:, :, past_len:end] = t[:, :, past_len:].gather(2, slots)
    move_accepted_index_keys(layer, past_len, index, width)


def commit_accepted(cache, past_len: int, index: torch.Tensor | None, width: int) -> None:
    """Keep each row's accepted tree nodes after the prefix, in place, in every layer: row b's nodes ``index[b]``
    ([B, K] on the device, relative to `past_len`; None: the first K nodes) move to slots
    ``past_len .. past_len+K-1`` and the cache is cropped there. A shorter row's slots after its own path are holes
    its mask hides (`eagle_hf.speculation.ragged`). O(B * K) per layer: the prefix is never copied, no layer is rebuilt."""
    end, expanded = past_len + width, {}
    for layer in attention_layers(cache):  # (a recurrent layer's state is rewound by the loop: `hf.recurrent`)
        if index is not None:
            _move_accepted(layer, past_len, index, width, expanded)
        if layer.keys.shape[2] > end:  # (a view: the next forward writes after it, `GrowingLayer`)
            layer.keys, layer.values = layer.keys[:, :, :end], layer.values[:, :, :end]
        end_index_keys(layer, end)


def select_cache(cache, rows: torch.Tensor) -> None:
    """Keep the given batch rows (an index tensor) in every layer."""
    for layer in recurrent_layers(cache):
        select_recurrent_rows(layer, rows)
    for layer in attention_layers(cache):
        if isinstance(layer, GrowingLayer):
            layer.select_rows(rows)
        else:
            layer.keys = layer.keys.index_select(0, rows.to(layer.keys.device))
            layer.values = layer.values.index_select(0, rows.to(layer.values.device))
        select_index_rows(layer, rows)


def regather_cache(cache, index: torch.Tensor) -> None:
    """Row b keeps its slots ``index[b]`` ([B, L'] per row), in every layer (the holes' compaction)."""
    for layer in attention_layers(cache):
        if isinstance(layer, GrowingLayer):
            layer.regather(index)
        else:
            keys, values = layer.keys.gather(2, _slots(index, layer.keys)), layer.values.gather(2, _slots(index, layer.values))
            if isinstance(layer, StaticLayer):  # the buffers stay: the first L' slots are rewritten
                layer.keys[:, :, : index.shape[1]], layer.values[:, :, : index.shape[1]] = keys, values
                layer.cumulative_length.fill_(index.shape[1])
            else:
                layer.keys, layer.values = keys, values
        regather_index_keys(layer, index)


class TreeCache:
    """The tree-cache protocol: what the tree loop does with the target's cache, for every row of a batch.

    * write: a verify forward writes each row's N tree nodes after the committed slots (`forward_kwargs`; its
      mask from `tree_mask`, whose width comes from the cache);
    * `commit`: each row's accepted nodes move in place into the slots after the committed ones, the rest is
      cropped (O(rows x accepted) per layer; the committed prefix is never copied);
    * `select_rows`: rows leave the batch; `compact`: the holes that shorter paths left go, once worth it.

    `ragged` says which committed slots each row reads (`eagle_hf.speculation.ragged`). Implemented here for transformers'
    dynamic cache, whose layers grow in place for the call (`GrowingLayer`: a forward writes its slots into room
    after the live ones, where transformers concatenates) and are cropped to a view; a cache with fixed buffers
    implements the same operations with a write position instead."""

    def __init__(self, cache, ragged: Ragged | None = None):
        self.cache = cache
        self.ragged = ragged or Ragged([], 0)
        # [B, 1, R, C] the verify forward's additive mask, kept between rounds: columns below `length` hold each
        # row's slot validity (0 or the dtype's min) for every query row, written as slots are committed; the
        # tree block after them is rewritten each round: O(new slots x R) per round
        self._mask = KeptMask()

    @property
    def length(self) -> int:
        """Committed slots (every row has as many; a row's holes among them are hidden by its mask)."""
        return self.cache.get_seq_length()

    def forward_kwargs(self) -> dict:
        return cache_kwarg(self.cache)

    def tree_mask(self, tree: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The verify forward's additive mask [B, 1, N, L + N] for trees `tree` [B, N, N] (bool, device): each
        row's valid slots, then each node's ancestors and itself. A view of the kept mask (`KeptMask`): only the
        tree block is written (O(N x N) per row), the committed slots' part was written as they were committed."""
        return self._mask.view(tree, self.length, self._valid(), dtype)

    def _valid(self) -> torch.Tensor | None:
        """[B, L] which committed slots each row reads (None: all)."""
        return self.ragged.valid if self.ragged.holes else None

    def begin(self, slot_limit: int | None = None) -> None:
        """The call starts: dynamic layers grow in place (`GrowingLayer`), to `slot_limit` slots at most."""
        grow_in_place(self.cache, slot_limit)

    def release(self) -> None:
        """The call is over: the cache's layers are transformers' own again."""
        stop_growing_in_place(self.cache)

    def _keep(self, past_len: int, index: torch.Tensor | None, width: int, written: int | None) -> None:
        """The accepted nodes into the slots after the committed ones; the cache ends after them."""
        commit_accepted(self.cache, past_len, index, width)

    @property
    def free(self) -> int | None:
        """The slots a forward may still write (None: any number, a dynamic cache grows)."""
        return None

    def room(self, width: int) -> int | None:
        """How many nodes a verify forward may write now, `width` wanted (None: any number)."""
        return None

    def padding_mask(self) -> torch.Tensor | None:
        """A plain step's 2D mask [B, L + 1] (bool, as plain generate() passes padding), or None without holes:
        a view of the rows' validity (`Ragged.with_next`)."""
        return self.ragged.with_next(1) if self.ragged.holes else None

    def commit(self, past_len: int, index: torch.Tensor | None, lengths: list[int], valid: torch.Tensor | None,
               device, written: int | None = None) -> None:
        """Keep row b's accepted nodes ``index[b]`` ([B, K] relative to `past_len`; None: the first K) in place;
        row b's first ``lengths[b]`` of the K new slots are real (`valid` [B, K] says so on the device, None when
        every row kept K). `written`: the nodes the verify forward wrote (None: unknown; K with no index: nothing
        to move or crop, as in a plain step)."""
        width = max(lengths)
        if index is not None or written != width:
            self._keep(past_len, index, width, written)
        self.ragged.append(lengths, width, valid, device)
        self._mask.arrive(past_len, width, valid)  # the new slots' columns, for every query row

    def drop_written(self, past_len: int, written: int) -> None:
        """The `written` slots a verify wrote after the `past_len` committed ones go (a hybrid target's replay
        writes the kept ones again: `eagle_hf.hf.recurrent`)."""
        self._keep(past_len, None, 0, written)

    def select_rows(self, rows: list[int], index: torch.Tensor) -> None:
        """Keep these batch rows (`index`: the same on the device); slots no row reads go at the next compaction."""
        self.ragged.select(rows, index)
        select_cache(self.cache, rows=index)
        self._mask.select(index)

    def compact(self) -> None:
        """Move each row's real slots to the front of a shorter cache, once every row has many holes."""
        if self.ragged.worth_compacting():
            self._compact()

    def _compact(self) -> None:
        regather_cache(self.cache, self.ragged.compact())
        self._mask.drop()


class StaticTreeCache(TreeCache):
    """The tree-cache protocol over transformers' static cache: fixed buffers [B, H, capacity, D] that a forward
    writes at a position kept on the device (`cumulative_length`). Nothing is cropped or reallocated (a compiled
    forward keeps its buffers): a commit moves the accepted nodes in place and sets the write position after them,
    and a compaction rewrites the first slots. A verify forward attends over the whole buffer, so its mask spans
    every slot: the committed ones as the rows read them, the tree block, and the rest hidden (the slots of
    earlier rounds' rejected nodes among them). The committed length is the rows' layout (`ragged.length`), a
    host number: the device's write position is never read in the loop."""

    def __init__(self, cache, ragged: Ragged | None = None):
        super().__init__(cache, ragged)
        self.layers = attention_layers(cache)  # (a hybrid's recurrent layers are rewound by the loop)
        self._start = int(cache.get_seq_length())  # (once, before the prefill: a static cache passed in may hold a
        # prefix; transformers keeps the position as a tensor)
        self._dirty = 0  # the kept mask's tree-block columns end here at most (cleared before the next block)
        self.how = "eager"  # how its commits run (`eagle_hf.programs.how_to_run`; the loop sets it)
        self._commits: dict[int, CommitProgram] = {}  # by width (over the layers' buffers now: rows leaving empty it)

    @property
    def capacity(self) -> int:
        return self.layers[0].max_cache_len

    @property
    def length(self) -> int:
        return self.ragged.length if self.ragged.rows else self._start

    @property
    def free(self) -> int:
        return self.capacity - self.length

    def room(self, width: int) -> int:
        """The nodes a verify forward may write now: the buffer's free slots, after compacting the holes of a
        ragged batch once they stand in the way."""
        if width > self.free and self.ragged.holes:
            self._compact()
        return max(1, min(width, self.free))

    def tree_mask(self, tree: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, N, capacity]: the kept mask's first N query rows (see `TreeCache.tree_mask`); the columns after
        the tree block stay hidden (those of the previous block past this one are cleared first; this block's
        columns are written for the N rows read, and hidden again for every row once they fall past a block)."""
        rows, width, length = tree.shape[0], tree.shape[1], self.length
        kept = self._mask
        m = kept.mask
        if m is None or m.dtype != dtype or m.shape[0] != rows or m.shape[2] < width:
            m = kept.fresh(rows, -(-max(width, 64) // 64) * 64, length, self._valid(), dtype, tree.device,
                           columns=self.capacity)  # (64 query rows at least: the views of every tree width
            # share one stride, which a compiled forward's guards check)
            kept.hide(length, self.capacity)
            self._dirty = length
        if self._dirty > length + width:
            kept.hide(length + width, self._dirty)
        kept.write(length, tree)  # [B, N, N] the tree block
        self._dirty = length + width
        return m[:, :, :width]

    def _keep(self, past_len: int, index: torch.Tensor | None, width: int, written: int | None) -> None:
        """The accepted nodes moved in place and the write position set after them, in every layer at once (one
        `CommitProgram` launch); layers with an indexer's keys (`eagle_hf.hf.indexed`), or on several devices (a
        `device_map`), one by one. When the first K nodes are kept (a chain, or a tree's greedy path: it comes
        first), nothing moves: every layer's write position, `written` after the committed ones since the verify,
        steps back in one operation."""
        indexed = any(type(layer) in STATIC_INDEXED for layer in self.layers)
        if index is None and written is not None and not indexed:
            torch._foreach_sub_([layer.cumulative_length for layer in self.layers], written - width)
            return
        if indexed or len({layer.keys.device for layer in self.layers}) > 1:  # (a `device_map` over devices)
            expanded = {}
            for layer in self.layers:
                if index is not None:
                    _move_accepted(layer, past_len, index, width, expanded)
                layer.cumulative_length.fill_(past_len + width)
                end_index_keys(layer, past_len + width)
            return
        bucket = max(COMMIT_WIDTH, 1 << (width - 1).bit_length())
        program = self._commits.get(bucket)
        if program is None:
            program = self._commits[bucket] = self._commit_program(bucket)
        program(past_len, index, width)

    def _commit_program(self, width: int) -> CommitProgram:
        """The commit program of `width` slots over these layers: one an earlier call left over layers of the same
        shapes, bound to these (transformers makes a static cache a call), where its launches take the buffers
        (compiled or eager; a CUDA graph holds its own: made anew), else a new one."""
        rows = self.layers[0].keys.shape[0]
        if self.how == "graph":
            return CommitProgram(self.layers, rows, width, self.how)
        key = (width, self.how, torch.is_inference_mode_enabled(),
               tuple((tuple(t.shape), t.dtype, t.device, t.stride()) for layer in self.layers
                     for t in (layer.keys, layer.values, layer.cumulative_length)))
        program = _KEPT_COMMITS.get(key)
        if program is not None and program.bound:  # (another call is using it: a thread of its own)
            program = None
        if program is None:
            program = CommitProgram(self.layers, rows, width, self.how)
        else:
            program.bind(self.layers)
        _KEPT_COMMITS[key] = program
        _KEPT_COMMITS.move_to_end(key)
        while len(_KEPT_COMMITS) > MAX_KEPT_COMMITS:
            _KEPT_COMMITS.popitem(last=False)
        return program

    def select_rows(self, rows: list[int], index: torch.Tensor) -> None:
        super().select_rows(rows, index)
        self._unbind()  # (the layers' buffers are new)

    def release(self) -> None:
        super().release()
        self._unbind()

    def _unbind(self) -> None:
        """Its commit programs go: a program kept for a later call keeps none of these buffers alive."""
        if self.how != "graph":
            for program in self._commits.values():
                program.bind([])
        self._commits = {}


#: commit programs kept between calls (bound to no buffers while no call uses them), by width, how they run and
#: their layers' shapes; the least recently used go first
_KEPT_COMMITS: OrderedDict[tuple, CommitProgram] = OrderedDict()
MAX_KEPT_COMMITS = 8


class CommitProgram:
    """A verify's commit into a static cache as one program (`eagle_hf.programs`): in every layer, row b's kept
    nodes ``index[b]`` (relative to the committed length `past`) move to the slots after it, and every layer's
    write position (`cumulative_length`) is set after the K kept ones, one launch for all layers. Fixed shapes
    (rows B, W slots, a power of two at least K): `ints` = (past, K, whether nodes move), the kept nodes'
    places [B, W] (the first K are read). Moving is not repeatable (run twice, it moves twice): a CUDA graph's
    warm-ups move nothing."""

    def __init__(self, layers: list, rows: int, width: int, how: str):
        device = layers[0].keys.device
        self.ints = Ints(3, device)  # past, K, whether nodes move
        self.index = torch.zeros(rows, width, dtype=torch.long, device=device)  # [B, W]
        self.steps = torch.arange(width, device=device)  # [W]
        still = torch.tensor([1, 1, 0], device=device)  # (the launch's past and K; nothing moves)
        buffers = [t for layer in layers for t in (layer.keys, layer.values)]
        positions = [layer.cumulative_length for layer in layers]
        self.program = Program(commit_kept, (buffers, positions, self.ints.tensor, self.index, self.steps), how,
                               "cache commit",
                               warm_args=lambda: (buffers, positions, self.ints.tensor * still, self.index, self.steps))

    @property
    def bound(self) -> bool:
        """Whether a call's buffers are bound to it."""
        return bool(self.program.args[0])

    def bind(self, layers: list) -> None:
        """Its launches over another cache's layers of the same shapes (never a captured graph's: it holds its
        buffers); none (`layers` empty) between calls."""
        buffers = [t for layer in layers for t in (layer.keys, layer.values)]
        self.program.args = (buffers, [layer.cumulative_length for layer in layers], *self.program.args[2:])

    def __call__(self, past: int, index: torch.Tensor | None, kept: int) -> None:
        """index: [B, K] on the device (None: the first K nodes stay where they are)."""
        if index is not None:
            self.index[:, : index.shape[1]].copy_(index)
        self.ints.write([past, kept, int(index is not None)])
        self.program()


def commit_kept(buffers: list[torch.Tensor], positions: list[torch.Tensor], ints: torch.Tensor, index: torch.Tensor,
                steps: torch.Tensor) -> None:
    """`CommitProgram`'s body: keys and values ``[B, H, C, D]`` of every layer, their write positions, and the
    program's inputs."""
    past, kept, moves = ints[0], ints[1], ints[2]
    rows, width = index.shape
    # [W] the slot each column writes: the K kept ones, then the last kept one's again (the same value twice),
    # never a slot past the K: those may lie past the cache's end
    column = torch.minimum(steps, (kept - 1).clamp(min=0))
    place = torch.where(moves > 0, index.gather(1, column.expand(rows, width)), column)  # [B, W]
    source, target = place + past, column + past  # [B, W], [W]
    for buffer in buffers:
        h, d = buffer.shape[1], buffer.shape[3]
        moved = buffer.gather(2, source[:, None, :, None].expand(rows, h, width, d))  # [B, H, W, D]
        buffer.index_copy_(2, target, moved)
    for position in positions:
        position.copy_(past + kept)


# ------------------------------------------------------------------ sliding-window and chunked layers
class Window(NamedTuple):
    """What a layer type reads besides the causal rule: the last `size` positions, or (`chunked`) the positions
    of the query's chunk of `size`."""

    size: int
    chunked: bool = False


#: the layer types a verify forward can mask (transformers' names; indexed layers read the whole context, their
#: indexer choosing among the keys the mask lets through: `eagle_hf.hf.indexed`)
MASKABLE = ("full_attention", "sliding_attention", "chunked_attention", "indexed_attention")
#: layer types that read the whole context or no context: a hybrid layer's attention beside its recurrent state,
#: MLP or MoE layers without attention; a hybrid model's recurrent layers too (`RECURRENT_TYPES`: rewound by the
#: loop, `eagle_hf.hf.recurrent`), not those of a model whose convolutions its cache crops (LFM2's: a tree's branches
#: would run through them in a row)
WHOLE_CONTEXT = ("hybrid", "mlp", "moe", "dummy")
#: layer types whose window the model applies itself by cache slot (GPT-Neo's), whatever mask it is passed
BY_SLOT = ("local",)
#: model types whose `sliding_window` their cache keeps (it drops the keys that leave the window) while their layers
#: build a full causal mask (Moshi's): a tree's cache keeps every key, so its forwards would read past the window
WINDOW_BY_CACHE = ("moshi",)


def layer_windows(target) -> dict[str, Window | None] | None:
    """Per layer type, the window its layers read (None: the whole context); None when every layer reads the
    whole context. A config without layer types whose sliding window is on (Mistral) has one type, ``""``."""
    text = text_config(target)
    window = getattr(text, "sliding_window", None) if getattr(text, "use_sliding_window", True) else None
    chunk = getattr(text, "attention_chunk_size", None)
    local = getattr(text, "window_size", None)
    types = getattr(text, "layer_types", None) or _attention_layers(text)
    if types:
        unmasked = ("full_attention", "global", *WHOLE_CONTEXT, *(RECURRENT_TYPES if is_hybrid(target) else ()))
        if all(t in unmasked for t in types):
            return None
        reach = {"full_attention": None, "indexed_attention": None, "sliding_attention": window and Window(window),
                 "chunked_attention": chunk and Window(chunk, chunked=True), "global": None,
                 "local": local and Window(local)}
        return {t: reach.get(t) for t in sorted(set(types))}  # (other types: `windows_unsupported_reason`)
    return {"": Window(window)} if window is not None else None


def _attention_layers(text) -> list[str] | None:
    """GPT-Neo's layer types (`attention_layers`, a list of "global" and "local"), where the config has them."""
    types = getattr(text, "attention_layers", None)
    return list(types) if isinstance(types, (list, tuple)) and all(isinstance(t, str) for t in types) else None


def windows_unsupported_reason(target) -> str | None:
    """Why a verify forward cannot mask `target`'s layers (None when it can): layer types it does not know, or
    windows the model applies itself by cache slot."""
    windows = layer_windows(target) or {}
    if windows and getattr(target.config, "model_type", None) in WINDOW_BY_CACHE:
        size = text_config(target).sliding_window
        return (f"its cache keeps its window (sliding_window={size}) and its layers "
                "mask nothing more, while a draft tree's cache keeps every key")
    by_slot = [t for t in BY_SLOT if windows.get(t) is not None]
    if by_slot:
        size = windows[by_slot[0]].size
        return (f"its {', '.join(by_slot)} attention layers (window_size={size}) hide keys by cache slot, which a "
                "draft tree's nodes do not follow")
    other = sorted(set(windows) - {"", *MASKABLE, "global", *WHOLE_CONTEXT})
    return f"its {', '.join(other)} layers cannot take a tree mask yet" if other else None


def key_positions(valid: torch.Tensor | None, rows: int, length: int, device) -> torch.Tensor:
    """[B, L] the position of the token in each committed slot: its index among the row's real slots (`valid`
    [B, L] bool; None: every slot is real). A hole gets its neighbour's (it is hidden anyway)."""
    if valid is None:
        return torch.arange(length, device=device).expand(rows, length)
    return valid.long().cumsum(-1) - 1


def window_masks(mask: torch.Tensor, windows: dict[str, Window | None], keys: torch.Tensor,
                 queries: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """What each layer type reads: `mask` [B, 1, N, L] additive (the tree mask over every slot), with the keys
    out of each query's window or chunk hidden; keys [B, L] and queries [B, N] the positions. A dict by layer
    type, or the one mask of a config without layer types. Not in place: `mask` may be a kept one."""
    low = torch.finfo(mask.dtype).min
    out = {}
    for kind, window in windows.items():
        if window is None:
            out[kind] = mask
            continue
        key, query = keys[:, None, None, :], queries[:, None, :, None]  # [B, 1, 1, L], [B, 1, N, 1]
        if window.chunked:
            far = torch.div(key, window.size, rounding_mode="floor") != torch.div(query, window.size, rounding_mode="floor")
        else:
            far = key <= query - window.size  # [B, 1, N, L]
        out[kind] = mask.masked_fill(far, low)
    return out.get("", out)
