"""What a verify forward needs from a target that its config does not say, probed at the model's first call.

**Several new tokens over a cache.** Both speculating loops verify drafts in one forward of several tokens after
the committed ones. A few models take one token at a time once they have a cache (ProphetNet's decoder, XLM's own
past): they decode plainly. Probed with a forward of two tokens, then one of three over its cache.

**Positions.** Whether a target's logits follow the `position_ids` a verify forward passes.

A draft tree's nodes sit in consecutive cache slots (length + i) but at the positions of their depth (length +
depth): eagle_hf's loop passes those positions as `position_ids`. A model that counts positions from the cache
length instead (learned or sinusoidal positions in BART, Marian, Pegasus, Whisper's decoder), or that has none to
pass (ALiBi in Bloom and MPT: a bias by key slot), would read a tree's nodes at their slots and change the text.
Such a model runs no trees: transformers' assisted loop verifies one chain, whose slots are its positions.

The forward's signature says it where it takes no `position_ids`; otherwise a probe (two forwards of four tokens,
the last one's position moved) tells whether its logits change.

Each probe runs once per model class and config (a few tiny forwards, without gradients), and only where the
config does not say it: a config with rotary positions (`rope_parameters`) reads position_ids and keeps
transformers' cache; one with `alibi` set (Falcon's option) does not read them.
"""

from __future__ import annotations

import logging

import torch

from .models import forward_parameters, text_config

logger = logging.getLogger(__name__)

#: (probe, model class, config) -> its answer: why the model lacks what the probe checks (None: it has it)
_PROBED: dict[tuple[str, type, str], str | None] = {}


def verify_unsupported_reason(target) -> str | None:
    """Why a forward of several new tokens over the model's cache fails (None: it runs)."""
    return None if _rotary(target) else probed("verify", target, _probe_verify)


def positions_unsupported_reason(target) -> str | None:
    """Why a verify forward cannot place a tree's nodes at their depths' positions (None: it can)."""
    # (not a **kwargs catch-all either: generate() passes position_ids only to a forward that names them, so plain
    # decoding of a padded row counts its positions otherwise than the loop would)
    if "position_ids" not in forward_parameters(target):
        return ("its forward takes no position_ids (it counts positions by cache slot), so a draft tree's nodes "
                "would be read at their slots, not their depths")
    if getattr(text_config(target), "alibi", False):  # (Falcon's option)
        return ("its ALiBi bias reads cache slots, not position_ids, so a draft tree's nodes would be read at their "
                "slots, not their depths")
    return None if _rotary(target) else probed("positions", target, _probe_positions)


def _rotary(target) -> bool:
    """Whether the config says the model places tokens by rotary positions (`rope_parameters`): such a model reads
    the position_ids it is given and keeps transformers' cache, so the probes have nothing to learn."""
    text = text_config(target)
    return bool(getattr(text, "rope_parameters", None) or getattr(text, "rope_theta", None))


def probed(name: str, target, probe) -> str | None:
    """`probe(target)`'s answer, run once per probe name, model class and config."""
    key = (name, type(target), target.config.to_json_string(use_diff=False))
    if key not in _PROBED:
        _PROBED[key] = probe(target)
    return _PROBED[key]


def _probe_verify(target) -> str | None:
    """A forward of two tokens, then one of three over its cache."""
    from .version import cache_kwarg, output_cache

    device = target.get_input_embeddings().weight.device
    try:
        with torch.no_grad():
            out = target(input_ids=torch.tensor([[1, 2]], device=device), use_cache=True)
            cache = output_cache(out)
            if cache is None:
                return "its forward returns no cache"
            mask = torch.ones(1, 5, dtype=torch.long, device=device)
            target(input_ids=torch.tensor([[3, 4, 5]], device=device), attention_mask=mask, use_cache=True,
                   **cache_kwarg(cache))
    except Exception as e:  # noqa: BLE001  (the model's own refusal, whatever its type)
        logger.info("%s cannot verify several tokens over its cache: %s: %s", type(target).__name__,
                    type(e).__name__, e)
        return f"its forward cannot take several new tokens over its cache ({type(e).__name__})"
    return None


def _probe_positions(target) -> str | None:
    """Two forwards of the same four tokens, the last one at position 3 and at position 6: equal logits mean the
    model does not read position_ids (relative positions, RoPE's, change too: the gap moves)."""
    device = target.get_input_embeddings().weight.device
    ids = torch.tensor([[1, 2, 3, 4]], device=device)  # [1, 4]
    near = torch.arange(4, device=device)[None]  # [1, 4]
    far = torch.tensor([[0, 1, 2, 6]], device=device)
    try:
        with torch.no_grad():
            a = target(input_ids=ids, position_ids=near, use_cache=False).logits[:, -1]  # [1, V]
            b = target(input_ids=ids, position_ids=far, use_cache=False).logits[:, -1]
    except Exception as e:  # noqa: BLE001  (a forward this probe cannot make: no trees, and say why)
        logger.info("Probing whether %s reads position_ids failed (%s: %s)", type(target).__name__, type(e).__name__, e)
        return f"a forward with position_ids failed ({type(e).__name__}), so a tree's positions cannot be checked"
    if torch.equal(a, b):
        return ("its logits do not follow position_ids (it counts positions by cache slot), so a draft tree's nodes "
                "would be read at their slots, not their depths")
    return None
