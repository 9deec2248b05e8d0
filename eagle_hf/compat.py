"""The drafter's seam with transformers' internals (the rest of that seam, facing generate(), is `eagle_hf.hf`):
the RoPE menu the drafter's attention reads. Below every other eagle_hf module that needs it, so that the drafter
never imports the package that imports it."""

from __future__ import annotations

import torch


def rope_init(config) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention scaling) of a scaled RoPE type, from transformers' RoPE menu."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, None)


def rope_types() -> set[str]:
    """The RoPE types the drafter's attention knows: plain ("default") and transformers' scaled ones."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return {"default", *ROPE_INIT_FUNCTIONS}
