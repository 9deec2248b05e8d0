"""One EAGLE `generate()` call: its checks before any compute, and its context (visible to the hooks in this thread)."""

from __future__ import annotations

import copy
import inspect
import logging
import threading
import weakref
from dataclasses import dataclass, field, fields

import torch
from transformers.generation.utils import GenerationMixin

from ..devices import input_device
from ..drafter.capture import num_decoder_layers, resolve_aux_layer_ids
from ..drafter.modeling import EagleDrafter
from ..errors import EagleCompatibilityError
from ..programs import how_to_run
from ..speculation.drafting import DraftState, LevelGraphs
from ..speculation.drafting import wanted as graphs_wanted
from ..speculation.rounds import Timer
from ..speculation.settings import DraftSettings
from ..speculation.speculator import DraftListener, Speculator
from ..speculation.stats import SpecDecodeStats, merge_stats
from .costs import controller_for
from .models import text_config
from .version import cache_in

logger = logging.getLogger(__name__)

_GENERATE_PARAMETERS = list(inspect.signature(GenerationMixin.generate).parameters)[1:]  # without self


def as_keywords(args: tuple, kwargs: dict) -> dict:
    """generate()'s positional arguments as keywords (in transformers' signature order): nothing is edited by
    position afterwards."""
    named = [p for p in _GENERATE_PARAMETERS if p != "kwargs"]
    if len(args) > len(named):
        raise TypeError(f"generate() takes at most {len(named)} positional arguments, got {len(args)}.")
    out = dict(zip(named, args))
    clash = set(out) & set(kwargs)
    if clash:
        raise TypeError(f"generate() got multiple values for {sorted(clash)}.")
    return {**out, **kwargs}


@dataclass
class EagleCall:
    """What the hooks of one EAGLE generate() call share: set for the call's duration in its thread."""

    drafter: EagleDrafter
    aux_ids: list[int]
    settings: DraftSettings
    stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    listeners: list[DraftListener] = field(default_factory=list)
    controller: object | None = None  # DraftLengthController of the adaptive schedule
    route: object | None = None  # which loop runs the call (`eagle_hf.hf.routing.Route`)
    streamer: object | None = None  # the call's streamer (tree mode feeds it itself)
    timers: list[Timer] = field(default_factory=list)  # the call's device clocks (`close`d when it returns)
    sampling: bool = False  # whether the call samples (its drafter's acceptance is kept apart from greedy calls')

    def close(self, hand_over: bool = True) -> None:
        """The call returned: its timers hand over what is done (`hand_over`) and let go of the rest
        (`Timer.close`)."""
        for timer in self.timers:
            timer.close(hand_over)
        self.timers.clear()


_local = threading.local()


def active_call() -> EagleCall | None:
    return getattr(_local, "call", None)


def set_active_call(call: EagleCall | None) -> None:
    _local.call = call


#: per drafter object (weakly) -> the targets it was warned about (`warn_other_target`)
_WARNED_TARGETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def warn_other_target(target, drafter: EagleDrafter) -> None:
    """A warning, once per drafter object and target, where the drafter's config.json declares another target
    (`target_model`) than `target`'s name: its drafts, trained on another model's hidden states, are mostly
    rejected (the output stays the target's). Names that differ only in their folder (a local copy, the Hugging
    Face cache's snapshot) are the same model."""
    declared = getattr(drafter.config, "target_model", None)
    name = getattr(target, "name_or_path", "") or getattr(target.config, "_name_or_path", "")
    if not declared or not name or _model_name(declared) == _model_name(name):
        return
    warned = _WARNED_TARGETS.setdefault(drafter, set())
    if name not in warned:
        warned.add(name)
        logger.warning(
            "The drafter %s declares the target %s (its config.json's target_model), not %s: its drafts were trained "
            "on another model's hidden states and may be mostly rejected (the output is the target's either way). "
            "Use the drafter trained for %s.", drafter.config.name_or_path or "(unnamed)", declared, name, name)


def _model_name(name_or_path: str) -> str:
    """A model's name without its folder: "org/Model" and "/data/Model" name "model"; so does the Hugging Face
    cache's ".../models--org--Model/snapshots/<commit>"."""
    parts = [p for p in str(name_or_path).replace("\\", "/").split("/") if p]
    cached = [p for p in parts if p.startswith("models--")]
    return (cached[-1].split("--")[-1] if cached else parts[-1] if parts else "").lower()


def check_compatible(target, drafter: EagleDrafter) -> list[int]:
    """Validate that `drafter` can draft for `target`; return the boundary aux ids it reads."""
    warn_other_target(target, drafter)
    text = text_config(target)
    cfg = drafter.config
    where = f"drafter {cfg.name_or_path or '(unnamed)'} and target {getattr(target, 'name_or_path', '?')}"
    if cfg.vocab_size != text.vocab_size:
        raise EagleCompatibilityError(
            f"Vocabulary mismatch between {where}: the drafter was built for a {cfg.vocab_size}-token vocabulary, "
            f"the target has {text.vocab_size}. This drafter belongs to another target model; use the drafter "
            "trained for this target (or train one with `eagle-hf train`)."
        )
    if cfg.target_hidden_size != text.hidden_size:
        raise EagleCompatibilityError(
            f"Hidden-size mismatch between {where}: the drafter reads {cfg.target_hidden_size}-wide target hidden "
            f"states, the target's are {text.hidden_size}-wide. This drafter belongs to another target model."
        )
    if drafter.embed_tokens is None:
        emb = target.get_input_embeddings()
        if emb.weight.shape[-1] != cfg.hidden_size:
            raise EagleCompatibilityError(
                f"The drafter ships no embedding and its width {cfg.hidden_size} differs from the target's "
                f"embedding width {emb.weight.shape[-1]}; it cannot share the target's embedding."
            )
    ids = resolve_aux_layer_ids(cfg.aux_layer_ids, num_decoder_layers(target), "boundary")
    if len(ids) != cfg.num_aux_hidden_states:
        raise EagleCompatibilityError(
            f"The {where} disagree on the captured layers: the drafter's fc reads {cfg.num_aux_hidden_states} "
            f"target hidden states but resolves to the {len(ids)} taps {ids} on this {num_decoder_layers(target)}-layer "
            "target. Load the drafter with `EagleDrafter.from_pretrained(..., aux_layer_ids=[...])`, one id per tap "
            "the drafter was trained on."
        )
    return ids


def check_call(kwargs: dict, defaults=None) -> None:
    """Inputs and generation modes EAGLE drafting cannot serve, before any compute. defaults: the target's
    generation config (what the call does not set)."""
    inputs = kwargs.get("inputs", kwargs.get("input_ids"))
    if isinstance(inputs, (list, tuple)):
        raise EagleCompatibilityError(
            "The prompts are a Python list; generate() takes one left-padded tensor with its attention mask: "
            "tokenizer(prompts, padding=True, padding_side='left', return_tensors='pt')."
        )
    check_prompt(kwargs, inputs)
    if (kwargs.get("num_beams") or getattr(kwargs.get("generation_config"), "num_beams", 1) or 1) > 1:
        raise EagleCompatibilityError("Beam search cannot be combined with speculative decoding; drop num_beams.")
    guidance = kwargs.get("guidance_scale", getattr(kwargs.get("generation_config") or defaults, "guidance_scale", None))
    if guidance is not None and guidance != 1:
        raise EagleCompatibilityError(
            "guidance_scale: classifier-free guidance runs an unconditional forward beside every step, which draft "
            "verification does not; drop guidance_scale (or drop assistant_model)."
        )
    use_cache = kwargs.get("use_cache", getattr(kwargs.get("generation_config") or defaults, "use_cache", True))
    if use_cache is False:
        raise EagleCompatibilityError(
            "use_cache=False: speculative decoding verifies drafts against the target's KV cache; drop use_cache=False "
            "(or drop assistant_model to decode without a cache)."
        )
    if batch_rows(kwargs) > 1:
        check_batch(kwargs, inputs, defaults)


def cache_on_by_default(kwargs: dict, defaults) -> None:
    """A model whose own generation config turns the cache off (MPT's) decodes with it when the call does not say:
    drafts are verified against the cache (in place in `kwargs`; an explicit use_cache=False is `check_call`'s)."""
    asked = "use_cache" in kwargs or getattr(kwargs.get("generation_config"), "use_cache", None) is not None
    if not asked and getattr(defaults, "use_cache", True) is False:
        logger.info("The model's generation config turns the cache off; drafts are verified against it, so this call "
                    "keeps one (the output is the same)")
        kwargs["use_cache"] = True


def check_prompt(kwargs: dict, inputs) -> None:
    """The prompt's tensors: shapes plain generate() reads, or fails on deep inside; ids that drafting needs."""
    mask = kwargs.get("attention_mask")
    if inputs is None and kwargs.get("inputs_embeds") is not None:
        raise EagleCompatibilityError(
            "inputs_embeds without input_ids: the drafter reads the prompt's token ids beside the target's hidden "
            "states; pass the input_ids the embeddings were made from too (input_ids=ids, inputs_embeds=embeds), "
            "or drop assistant_model.")
    if not isinstance(inputs, torch.Tensor):
        return
    if inputs.dim() != 2:
        raise EagleCompatibilityError(
            f"input_ids has shape {tuple(inputs.shape)}; generate() takes [batch, length] (a single prompt: "
            "ids[None], or tokenizer(prompt, return_tensors='pt')).")
    if inputs.shape[-1] == 0:
        raise EagleCompatibilityError("The prompt is empty: pass at least one token (e.g. the chat template's).")
    if inputs.dtype not in (torch.long, torch.int32):  # (what the embedding takes)
        raise EagleCompatibilityError(f"input_ids are {inputs.dtype}; token ids are torch.long (or torch.int32).")
    if isinstance(mask, torch.Tensor) and (mask.dim() != 2 or mask.shape[0] != inputs.shape[0]
                                           or mask.shape[1] < inputs.shape[1]):
        raise EagleCompatibilityError(
            f"attention_mask has shape {tuple(mask.shape)} for input_ids of shape {tuple(inputs.shape)}: it needs "
            "a row per prompt and a column per token (and per cached token before them, with past_key_values); "
            "pass the attention_mask the tokenizer returned with these input_ids.")


def normalise_inputs(kwargs: dict) -> None:
    """int32 token ids as torch.long (in place), as plain generate() returns them: it appends its int64 tokens
    to int32 ids, which promotes the output to int64."""
    for key in ("inputs", "input_ids"):
        ids = kwargs.get(key)
        if isinstance(ids, torch.Tensor) and ids.dtype != torch.long:
            kwargs[key] = ids.long()


def empty_prompt_reason(kwargs: dict) -> str | None:
    """Why the drafter has nothing to draft from: an attention_mask with no token at all (None: it has)."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.numel() and not bool(mask.bool().any()):
        return "the attention_mask holds no token (all zeros), so the drafter has no context"
    return None


def batch_rows(kwargs: dict) -> int:
    """Rows decoded together: prompts times num_return_sequences."""
    inputs = kwargs.get("inputs", kwargs.get("input_ids"))
    prompts = int(inputs.shape[0]) if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 else 1
    gen_config = kwargs.get("generation_config")
    return prompts * int(kwargs.get("num_return_sequences", getattr(gen_config, "num_return_sequences", None)) or 1)


def check_batch(kwargs: dict, inputs, defaults=None) -> None:
    """What batched drafting needs: left padding with its mask, and outputs that exist per row."""
    gen_config = kwargs.get("generation_config")

    def asked(name: str):
        if name in kwargs:
            return kwargs[name]
        return getattr(gen_config, name, None) if gen_config is not None else getattr(defaults, name, None)

    mask = kwargs.get("attention_mask")
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 and inputs.shape[0] > 1:
        empty = mask.sum(-1) == 0 if mask is not None else None  # [B] rows all padding (plain generate() takes them)
        if mask is not None and bool(((mask[:, -1] == 0) & ~empty).any()):
            raise EagleCompatibilityError(
                "The batch is right-padded (its attention_mask ends in 0 on some rows); generation appends after the "
                "last column, so pad on the left: tokenizer(prompts, padding=True, padding_side='left', "
                "return_tensors='pt')."
            )
        pad = asked("pad_token_id")
        if mask is None and pad is not None and bool((inputs == pad).any()):
            raise EagleCompatibilityError(
                f"The batch holds padding (token {pad}) but no attention_mask: pass the tokenizer's attention_mask "
                "with the left-padded input_ids (tokenizer(prompts, padding=True, padding_side='left', "
                "return_tensors='pt') returns both)."
            )
    cache = cache_in(kwargs)
    refused = {
        "output_hidden_states": "hidden states per step",
        "streamer": "a streamer (transformers' streamers take one sequence)",
        "prefix_allowed_tokens_fn": "prefix_allowed_tokens_fn (it is called per batch index)",
    }
    for name, what in refused.items():
        if asked(name):
            raise EagleCompatibilityError(
                f"Batched EAGLE drafting does not support {what} yet; call generate() once per prompt for it.")
    if cache is not None and cache.get_seq_length() > 0:
        raise EagleCompatibilityError(
            "Batched EAGLE drafting does not continue from a prefilled cache (past_key_values) yet; pass the whole prompts "
            "(or call generate() once per prompt).")


def samples(target, kwargs: dict) -> bool:
    """Whether the call samples: its ``do_sample``, else its generation config's, else the target's."""
    if kwargs.get("do_sample") is not None:
        return bool(kwargs["do_sample"])
    return bool(getattr(kwargs.get("generation_config") or target.generation_config, "do_sample", False))


def prompt_length(kwargs: dict) -> int | None:
    inputs = kwargs.get("inputs", kwargs.get("input_ids"))
    return int(inputs.shape[-1]) if isinstance(inputs, torch.Tensor) else None


#: per drafter passed to generate() (weakly): its copies in other dtypes / on other devices, with the weights'
#: version each was made from (`_weights_version`), and its views bound to other targets' embeddings
_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PLACING = threading.Lock()


def prepare_drafter(target, drafter: EagleDrafter) -> EagleDrafter:
    """The drafter a call on `target` drafts with: on the target's device, in its dtype, reading the target's
    embedding when it ships none. The drafter passed in is never changed under another call that shares it:

    * In the target's dtype and device it is used itself; otherwise a copy there is made once and kept as long
      as the drafter lives (made again when the drafter's weights change, e.g. by more training). So one drafter
      serves a float32 and a bf16 target at once, each call with weights in its target's dtype (converting the
      shared drafter in place would change it under the other call, and round a float32 drafter to bf16 for good).
    * An embedding-less drafter is bound to the first target's embedding; a call on another target drafts with a
      view of it (its weights shared, not copied) bound to that target's embedding, kept while both live.
    """
    emb = target.get_input_embeddings()
    device, dtype = emb.weight.device, emb.weight.dtype
    if not dtype.is_floating_point:  # quantized embeddings
        dtype = getattr(target, "dtype", torch.float32)
    with _PLACING:
        placed = drafter
        if drafter.fc.weight.device != device or drafter.fc.weight.dtype != dtype:
            copies = _COPIES.setdefault(drafter, {})
            version = _weights_version(drafter)
            kept = copies.get((dtype, device))
            if kept is None or kept[1] != version:
                logger.info("Drafting with a copy of the drafter on %s in %s, the target's (the drafter passed in "
                            "stays on %s in %s)", device, dtype, drafter.fc.weight.device, drafter.fc.weight.dtype)
                # the bound embedding is the target's (not copied); the config is the drafter's own (shared)
                bound = drafter._target_embedding
                made = copy_module(drafter, keep=[drafter.config] + ([bound] if bound is not None else []))
                object.__setattr__(made, "_target_embedding", None)
                kept = copies[(dtype, device)] = (made.to(device=device, dtype=dtype).eval(), version)
            placed = kept[0]
        if placed.embed_tokens is None:
            if placed._target_embedding is None:
                placed.bind_target_embedding(emb)
            elif placed._target_embedding is not emb:  # another target's: a view bound to this one's
                views = _VIEWS.setdefault(placed, weakref.WeakKeyDictionary())
                view = views.get(emb)
                if view is None:
                    view = views[emb] = copy.copy(placed)  # (the same modules and tensors)
                    # held weakly: the view must not keep the embedding it is filed under alive
                    object.__setattr__(view, "_target_embedding", weakref.proxy(emb))
                placed = view
    if any(m.training for m in placed.modules()):  # (looking costs a quarter of setting every module's mode)
        placed.eval()
    return placed


def _weights_version(drafter: EagleDrafter) -> tuple:
    """Where the drafter's tensors are and how often they were written in place (an optimizer step, a
    load_state_dict): a copy made from another version is stale."""
    def version(t: torch.Tensor) -> int:
        try:
            return t._version
        except RuntimeError:  # an inference-mode tensor: it cannot be written in place outside inference mode
            return 0

    return tuple((t.data_ptr(), version(t)) for t in (*drafter.parameters(), *drafter.buffers()))


def copy_module(module, keep=()):
    """A deep copy of `module` that shares the objects in `keep` instead of copying them."""
    return copy.deepcopy(module, {id(obj): obj for obj in keep})


def speculators_for(target, rows: int = 1, stop_tokens=(), compiled: bool = False) -> tuple[EagleCall, list[Speculator]]:
    """The active call and a fresh speculator per batch row (one set per decoding loop); a batch's rows record
    into stats of their own (merged by `finish_rows`) and share the call's controller, built here once the loop
    knows which forward verifies (`controller_for`). `stop_tokens`: the EOS ids, where copy branches end;
    `compiled`: the target runs transformers' compiled forward (the schedule plans on its costs, and the drafter's
    levels run as CUDA graphs, `eagle_hf.speculation.drafting`)."""
    call = active_call()
    if call.controller is None:
        call.controller = controller_for(target, call.drafter, call.settings, compiled, call.sampling)
    stats = [call.stats] if rows == 1 else [SpecDecodeStats() for _ in range(rows)]
    graphs = (LevelGraphs.for_drafter(call.drafter)
              if call.drafter is not None and call.settings.uses_eagle and graphs_wanted(call.drafter, compiled) else None)
    how = how_to_run(call.drafter.fc.weight.device, compiled) if graphs is not None else "eager"
    # the drafter's cache: one for the batch
    state = (DraftState.for_drafter(call.drafter, rows, graphs, how) if call.drafter is not None
             else DraftState(positions=[0] * rows))
    timer = Timer(input_device(target))  # one for the batch: the loop's read-backs resolve its marks
    call.timers.append(timer)
    return call, [Speculator(call.drafter, call.settings, s, call.controller, call.listeners, timer=timer,
                             row=None if rows == 1 else b, state=state, stop_tokens=stop_tokens)
                             for b, s in enumerate(stats)]


def finish_rows(call: EagleCall, speculators: list[Speculator], new_tokens: list[int]) -> None:
    """The call's stats after the loop: a batch's are the rows' merged, each row's kept in ``per_row``."""
    for sp, n in zip(speculators, new_tokens):
        sp.stats.new_tokens = n
    if len(speculators) > 1:
        per_row = [sp.stats for sp in speculators]
        merged = merge_stats(per_row)
        for f in fields(SpecDecodeStats):
            setattr(call.stats, f.name, getattr(merged, f.name))
        call.stats.per_row = per_row
