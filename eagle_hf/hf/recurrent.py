"""Hybrid targets: recurrent or linear-attention layers beside attention layers (Qwen3-Next, the Qwen3.5 line,
Falcon-H1, Nemotron-H, Granite-4 hybrids, Zamba), whose state a speculation round has to rewind.

transformers keeps such a layer's state in its unified cache (`LinearAttentionCacheLayerMixin`: a convolution
window and a recurrent state per layer, beside the attention layers' keys and values). A verify forward over k+1
tokens leaves that state after all of them, and the round accepts j+1: the attention layers keep their first
j+1 slots as for any target, but a recurrent state cannot be cut back. So eagle_hf's loop copies the recurrent
layers' states before a verify (`Snapshot`: O(the state), independent of the context), and where a round keeps
fewer tokens than it verified, puts them back and replays the kept tokens over them (`TreeLoop.rewind`: one more
forward of j+1 tokens; a round whose drafts were all accepted, and a plain step, replay nothing). A round's time,
replay included, is what the adaptive schedule weighs drafting against: on a target where drafts are often
rejected, it drafts less.

Chains only: a recurrent layer reads its tokens in order, so each branch of a tree would need its own state. A
batch advances in lockstep: every row keeps as many tokens as the row that kept fewest this round (the tokens
another row drops are drafted and verified again: a shorter accepted run is as exact as a longer one).

The verify forward must continue the state it is given, as plain decoding's one-token steps do. A probe checks
it once per model class and config (`hybrid_unsupported_reason`): two tokens over a cache in one forward against
one at a time, the recurrent states and the logits. Where the several-token form drops the state (transformers'
Jamba starts its scan from zeros; Zamba's and Nemotron-H's keep another state than their one-token form), the
recurrent mixers take a verify's tokens one at a time through the one-token form (`stepwise`: plain decoding's
arithmetic in those layers; the attention and MLP layers still take the tokens together). A model where neither
agrees (transformers' Bamba) decodes plainly, with the reason logged.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import torch

from .probes import probed

logger = logging.getLogger(__name__)

#: the cache layer types (transformers' `get_layer_types_and_kwargs`) that keep a recurrent or convolution state
RECURRENT_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding")
#: the cache layer types that keep keys and values per token (a hybrid layer keeps both)
ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "hybrid", "hybrid_sliding")
#: the relative difference between a verify's recurrent states (and logits) and plain decoding's that the probe
#: tolerates, in float32 (a scan that drops the state it was given differs by far more) and in half precision
TOLERANCE, HALF_TOLERANCE = 1e-4, 2e-2


def layer_types(target) -> list[str]:
    """The cache layer type of each of the target's layers, as transformers builds its dynamic cache ([]: a
    transformers version or a config that does not say)."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # (transformers before the unified cache)
        return []
    try:
        return list(get_layer_types_and_kwargs(target.config.get_text_config(decoder=True))[0])
    except Exception:  # noqa: BLE001  (a config whose layers it cannot list)
        return []


def is_hybrid(target) -> bool:
    """Whether `target` is stateful with recurrent layers beside attention layers in transformers' cache: the
    models whose state eagle_hf's loop rewinds."""
    if not getattr(target, "_is_stateful", False):
        return False
    types = layer_types(target)
    return any(t in RECURRENT_TYPES for t in types) and any(t in ATTENTION_TYPES for t in types)


def hybrid_unsupported_reason(target) -> str | None:
    """Why eagle_hf's loop cannot rewind this hybrid target (None: it can; call only where `is_hybrid`): its
    verify forwards must continue the recurrent state they are given (probed once per class and config)."""
    return _continuation(target)[1]


def steps_tokens(target) -> bool:
    """Whether the hybrid target's recurrent layers take a verify's tokens one at a time (`stepwise`): their
    multi-token form does not continue the state in the cache, their one-token form (plain decoding's) does."""
    return _continuation(target)[0] == "stepwise"


def _continuation(target) -> tuple[str | None, str | None]:
    """(how the recurrent layers take a verify's tokens: "together" or "stepwise"; why neither continues the
    state: None where one does), probed once per class and config."""
    answer = probed("continuation", target, _probe_continuation)
    return (answer, None) if answer in ("together", "stepwise") else (None, answer)


@contextlib.contextmanager
def stepwise(target):
    """Within the block, the target's recurrent mixers take several tokens one at a time, each through the
    one-token form plain decoding runs (the attention and MLP layers still take them together)."""
    mixers = [m for m in target.modules() if hasattr(m, "layer_idx") and hasattr(m, "conv1d")]
    for mixer in mixers:
        mixer.forward = _one_at_a_time(mixer.forward)
    try:
        yield
    finally:
        for mixer in mixers:
            del mixer.forward  # (the class's forward again)


def _one_at_a_time(forward):
    def run(hidden_states: torch.Tensor, *args, attention_mask=None, **kwargs):  # hidden_states: [B, T, H]
        length = hidden_states.shape[1]
        if length == 1:
            return forward(hidden_states, *args, attention_mask=attention_mask, **kwargs)
        per_token = attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] == length
        return torch.cat([forward(hidden_states[:, i : i + 1], *args,
                                  attention_mask=attention_mask[:, i : i + 1] if per_token else attention_mask,
                                  **kwargs) for i in range(length)], 1)  # [B, T, H]

    return run


def recurrent_layers(cache) -> list:
    """The layers of `cache` that keep recurrent or convolution states."""
    from transformers import cache_utils

    recurrent = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)  # (transformers 5.23 and later)
    return [layer for layer in cache.layers if recurrent is not None and isinstance(layer, recurrent)]


def attention_layers(cache) -> list:
    """The layers of `cache` that keep keys and values per token (hybrid layers too; not the recurrent-only ones,
    nor the placeholders of layers without attention), before their first write too."""
    from transformers.cache_utils import DummyLayer

    return [layer for layer in cache.layers if hasattr(layer, "keys") and not isinstance(layer, DummyLayer)]


def mixed_layers_reason(target) -> str | None:
    """Why a static cache cannot hold this hybrid target in eagle_hf's loop (None: it can): layers that keep keys
    and a recurrent state in one cache layer (Falcon-H1's, Zamba's)."""
    if any(t in ("hybrid", "hybrid_sliding") for t in layer_types(target)):
        return "its layers keep keys and a recurrent state together, which a static tree cache does not hold yet"
    return None


class Snapshot:
    """The recurrent layers' states, copied before a verify and put back in place (their storage stays: a
    compiled forward keeps their addresses)."""

    def __init__(self, cache):
        self.layers = recurrent_layers(cache)
        self.saved = [self._states(layer) for layer in self.layers]  # per layer: [(dict, index, copy)]

    @staticmethod
    def _states(layer) -> list[tuple[dict, int, torch.Tensor]]:
        out = []
        for states in (layer.conv_states, layer.recurrent_states):
            for i, tensor in states.items():
                if tensor is not None:
                    out.append((states, i, tensor.clone()))
        return out

    def restore(self) -> None:
        for saved in self.saved:
            for states, i, tensor in saved:
                if states[i].shape == tensor.shape:
                    states[i].copy_(tensor)
                else:  # (a layer that reassigns its state, recording its past)
                    states[i] = tensor.clone()


def select_recurrent_rows(layer, rows: torch.Tensor) -> None:
    """Keep the given batch rows (an index tensor) of a recurrent layer's states."""
    layer.reorder_cache(rows)


def _probe_continuation(target) -> str:
    """Eight tokens, then two more over a copy of the cache in one forward (with a 4D mask, as a verify passes)
    and, beside it, one at a time (as plain decoding runs them): the recurrent layers' states and the last logits
    must agree ("together"), else with the mixers stepping (`stepwise`: "stepwise"); otherwise why not."""
    for how in ("together", "stepwise"):
        try:
            with stepwise(target) if how == "stepwise" else contextlib.nullcontext():
                gap = _continuation_gap(target)
        except Exception as e:  # noqa: BLE001  (the model's own refusal, whatever its type)
            logger.info("%s cannot verify several tokens over its recurrent state: %s: %s", type(target).__name__,
                        type(e).__name__, e)
            return f"its forward cannot take several new tokens over its recurrent state ({type(e).__name__})"
        half = target.dtype in (torch.float16, torch.bfloat16)
        if gap <= (HALF_TOLERANCE if half else TOLERANCE):
            return how
        logger.info("%s: several tokens over its recurrent state differ from one at a time by %.2g (%s)",
                    type(target).__name__, gap, how)
    return ("its forward over several new tokens does not continue its cache as one token at a time does (the "
            "recurrent states or the logits differ), so a verify forward would not be plain decoding")


def _continuation_gap(target) -> float:
    """The largest relative difference between two tokens over a cache in one forward and one at a time: of the
    recurrent layers' states, and of the last logits."""
    from .version import cache_kwarg, output_cache

    device = target.get_input_embeddings().weight.device
    with torch.no_grad():
        prefix = torch.tensor([[1, 2, 3, 4, 8, 9, 10, 11]], device=device)
        together = output_cache(target(input_ids=prefix, use_cache=True))
        stepped = copy.deepcopy(together)
        mask = torch.zeros(1, 1, 2, 10, dtype=target.dtype, device=device)  # [1, 1, 2, 10] causal, additive
        mask[..., 0, 9] = torch.finfo(target.dtype).min
        a = target(input_ids=torch.tensor([[5, 6]], device=device), attention_mask=mask,
                   position_ids=torch.tensor([[8, 9]], device=device), use_cache=True,
                   **cache_kwarg(together)).logits[:, -1]
        for token in (5, 6):
            b = target(input_ids=torch.tensor([[token]], device=device), use_cache=True,
                       **cache_kwarg(stepped)).logits[:, -1]
    pairs = [(a, b)]
    for x, y in zip(recurrent_layers(together), recurrent_layers(stepped)):
        for kind in ("conv_states", "recurrent_states"):
            pairs += [(s, t) for s, t in zip(getattr(x, kind).values(), getattr(y, kind).values())
                      if s is not None and t is not None]
    return max(float((s.float() - t.float()).abs().max() / t.float().abs().max().clamp(min=1e-6)) for s, t in pairs)
