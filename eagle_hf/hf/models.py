"""What eagle_hf reads from transformers' model classes and utilities (outside generate())."""

from __future__ import annotations

import torch


def final_norm_scale(target) -> torch.Tensor:
    """The effective per-channel scale of the target's final norm ([H], float32): Gemma-style norms multiply
    by ``1 + weight``, Llama-style ones by ``weight``; a target without a final norm scales by 1."""
    base = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    norm = getattr(base, "norm", None)
    if norm is None or not hasattr(norm, "weight"):
        return torch.ones(target.config.get_text_config().hidden_size)
    w = norm.weight.detach().float()
    if type(norm).__name__.startswith("Gemma"):
        w = 1.0 + w
    return w


def rope_init(config) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention scaling) of a scaled RoPE type, from transformers' RoPE menu."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, None)
