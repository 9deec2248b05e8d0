"""Targets whose layers do not all read the whole context under a draft tree: sliding-window layers (Gemma 2
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

from typing import NamedTuple

import torch

from .recurrent import RECURRENT_TYPES, is_hybrid


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
    text = target.config.get_text_config()
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
        size = target.config.get_text_config().sliding_window
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
