"""Whether a target's logits follow the `position_ids` a verify forward passes.

A draft tree's nodes sit in consecutive cache slots (length + i) but at the positions of their depth (length +
depth): eagle_hf's loop passes those positions as `position_ids`. A model that counts positions from the cache
length instead (learned or sinusoidal positions in BART, Marian, Pegasus, Whisper's decoder), or that has none to
pass (ALiBi in Bloom and MPT: a bias by key slot), would read a tree's nodes at their slots and change the text.
Such a model runs no trees: transformers' assisted loop verifies one chain, whose slots are its positions.

The forward's signature says it where it takes no `position_ids`; otherwise a probe at the model's first call (two
forwards of four tokens, the last one's position moved) tells whether its logits change, kept per model class and
config.
"""

from __future__ import annotations

import inspect
import logging

import torch

logger = logging.getLogger(__name__)

#: (model class, config) -> why its logits do not follow position_ids (None: they do), probed once
_PROBED: dict[tuple[type, str], str | None] = {}


def positions_unsupported_reason(target) -> str | None:
    """Why a verify forward cannot place a tree's nodes at their depths' positions (None: it can)."""
    if "position_ids" not in inspect.signature(type(target).forward).parameters:
        return ("its forward takes no position_ids (it counts positions by cache slot), so a draft tree's nodes "
                "would be read at their slots, not their depths")
    key = (type(target), target.config.to_json_string(use_diff=False))
    if key not in _PROBED:
        _PROBED[key] = _probe(target)
    return _PROBED[key]


def _probe(target) -> str | None:
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
