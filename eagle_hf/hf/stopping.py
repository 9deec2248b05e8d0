"""Where generation stops: EOS ids of a prepared generation config, and plain generate()'s cut replayed."""

from __future__ import annotations

import torch
from transformers import StoppingCriteriaList, StopStringCriteria
from transformers.generation.stopping_criteria import ConfidenceCriteria, MaxTimeCriteria

from .version import output_cache


def eos_ids(generation_config) -> set[int]:
    """The EOS ids generate() prepared for this call (its own tensor, or the config's ids)."""
    eos = getattr(generation_config, "_eos_token_tensor", None)
    if eos is None:
        eos = generation_config.eos_token_id
        if eos is None:
            return set()
        return {int(e) for e in ([eos] if isinstance(eos, int) else eos)}
    return set(eos.reshape(-1).tolist())


def stop_strings_as_criterion(kwargs: dict, defaults) -> None:
    """`stop_strings` (the call's or its generation config's, else the model's: `defaults`) with `tokenizer`, as a
    `StopStringCriteria` among the call's `stopping_criteria` (in place). transformers hands a callable
    ``custom_generate`` (eagle_hf's loop) only the arguments its own signature adds, so the tokenizer would be
    dropped and stop strings refused; as a criterion they reach the loop like any other. Without a tokenizer
    nothing changes (transformers' own error names it)."""
    config = kwargs.get("generation_config") or defaults
    stop_strings = kwargs.get("stop_strings") or getattr(config, "stop_strings", None)
    if not stop_strings or kwargs.get("tokenizer") is None:
        return
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(kwargs.pop("tokenizer"), stop_strings))
    kwargs["stopping_criteria"], kwargs["stop_strings"] = criteria, None


def trim_at_stopping_criteria(out, prompt_len: int | None, kwargs: dict):
    """Cut the output where plain generate() would have stopped.

    The assisted loop (and our tree loop) evaluate custom stopping criteria once per round, after a whole
    accepted chunk; plain decoding evaluates them after every token. Re-evaluating the user's criteria (and
    `stop_strings`) on each prefix restores plain generate()'s output. Streamers have already seen the overshoot.
    """
    # time- or score-based criteria cannot be replayed on prefixes; the rest are functions of the tokens
    criteria = [c for c in (kwargs.get("stopping_criteria") or []) if not isinstance(c, (MaxTimeCriteria, ConfidenceCriteria))]
    gen_config = kwargs.get("generation_config")
    stop_strings = kwargs.get("stop_strings") or getattr(gen_config, "stop_strings", None)
    if stop_strings and kwargs.get("tokenizer") is not None:
        criteria.append(StopStringCriteria(kwargs["tokenizer"], stop_strings))
    if not criteria or prompt_len is None:
        return out
    seq = out if isinstance(out, torch.Tensor) else out.sequences

    def fires(criterion, ids) -> bool:
        try:
            return bool(torch.as_tensor(criterion(ids, None)).all())
        except Exception:  # noqa: BLE001 - a criterion that needs scores: leave the output as it is
            return False

    for length in range(prompt_len + 1, seq.shape[1]):
        if any(fires(c, seq[:, :length]) for c in criteria):
            break
    else:
        return out
    if isinstance(out, torch.Tensor):
        return out[:, :length]
    extra = seq.shape[1] - length
    out.sequences = seq[:, :length]
    for name in ("scores", "logits", "hidden_states"):
        if getattr(out, name, None) is not None:
            setattr(out, name, getattr(out, name)[: length - prompt_len])
    cache = output_cache(out)
    if cache is not None and extra > 0:
        cache.crop(-extra)
    return out
