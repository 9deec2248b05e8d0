"""Which target hidden states an EAGLE-3 drafter reads, and how to get them from a stock transformers model.

Two conventions name the captured layers (eagle_spec.md §4.2):

* ``"boundary"`` (vLLM, speculators, our own checkpoints): id ``k`` is the residual stream after ``k`` decoder
  layers, i.e. the input of layer ``k``. In transformers this is ``outputs.hidden_states[k]``.
* ``"output"`` (SpecForge / TorchSpec training configs, first id 1): id ``k`` is the output of decoder layer ``k``,
  i.e. boundary id ``k + 1``.

Everything in this package works with boundary ids; :func:`resolve_aux_layer_ids` converts once and logs.
Capture itself uses transformers' own ``output_hidden_states=[ids]`` layer selection: no forked modeling code.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

CONVENTIONS = ("boundary", "output")


def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """The EAGLE-3 default taps: inputs of layers 2, L//2 and L-3 (boundary convention)."""
    n = num_target_layers
    return [2, n // 2, n - 3] if n >= 6 else sorted({min(1, n - 1), n // 2, max(n - 2, 1)})


def guess_convention(ids: Sequence[int], layout: str) -> str:
    """sglang's rule (PR #25454): SpecForge/TorchSpec-style configs whose first id is 1 use the output convention."""
    if layout in ("eagle", "specforge") and len(ids) > 0 and ids[0] == 1:
        return "output"
    return "boundary"


def resolve_aux_layer_ids(
    ids: Sequence[int] | None,
    num_target_layers: int,
    convention: str = "boundary",
) -> list[int]:
    """Return boundary ids (= indices into ``outputs.hidden_states``) for the given ids and convention."""
    if convention not in CONVENTIONS:
        raise ValueError(f"aux_layer_convention must be one of {CONVENTIONS}, got {convention!r}.")
    if ids is None or len(ids) == 0:
        resolved = default_aux_layer_ids(num_target_layers)
    else:
        shift = 1 if convention == "output" else 0
        resolved = [int(i) + shift for i in ids]
    bad = [k for k in resolved if not 0 <= k < num_target_layers]
    if bad:
        raise ValueError(
            f"The drafter reads target hidden states at boundary ids {resolved} but the target has "
            f"{num_target_layers} decoder layers (valid ids 0..{num_target_layers - 1}; id {num_target_layers}, "
            "the pre-norm output of the last layer, is not supported). The drafter was probably trained for a "
            "different target, or the aux-layer convention is wrong: pass `aux_layer_ids=` / "
            "`aux_layer_convention=` to `EagleDrafter.from_pretrained` to override."
        )
    return resolved


def num_decoder_layers(target) -> int:
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    return int(config.num_hidden_layers)


def hidden_state_request(aux_ids: Sequence[int], with_final: bool = False) -> list[int]:
    """The ``output_hidden_states`` list that makes a transformers forward return the aux taps.

    With ``with_final`` the last index (L, the final-normed hidden state) is included as well.
    """
    ids = sorted({int(i) for i in aux_ids})
    return ids + [-1] if with_final else ids


def gather_aux(hidden_states: Sequence[torch.Tensor | None], aux_ids: Sequence[int], device=None) -> torch.Tensor:
    """Concatenate the selected taps in ascending-id order: ``[B, T, num_aux * H_t]``.

    With a target split over devices the taps live on different devices: they are gathered on `device`
    (default: the first tap's)."""
    taps = []
    for k in aux_ids:
        h = hidden_states[k]
        if h is None:
            raise RuntimeError(
                f"The target returned no hidden state at index {k}. Its modeling code may not support "
                "`output_hidden_states` layer selection; please report the model class."
            )
        taps.append(h)
    device = device or taps[0].device
    return torch.cat([t.to(device) for t in taps], dim=-1)


def taps_unsupported_reason(target) -> str | None:
    """Why an EAGLE drafter cannot read `target`'s hidden states (None: it can): they carry several residual
    streams per token (Hunyuan V4's hyper-connections, `hc_mult`: [B, T, k, H]; Gemma 3n's AltUp,
    `altup_num_inputs`: [k, B, T, H]; rather than [B, T, H])."""
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    for field in ("hc_mult", "altup_num_inputs"):  # (Hunyuan V4's hyper-connections, Gemma 3n's AltUp)
        streams = getattr(config, field, None)
        if isinstance(streams, int) and streams > 1:
            return (f"its hidden states carry {streams} streams per token ({field}: 4D hidden states), which an "
                    "EAGLE drafter does not read")
    return None
