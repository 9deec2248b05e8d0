"""The two hooks that bring EAGLE drafters into transformers' own `generate()`; pass-through for every other call.

* ``GenerationMixin.generate`` is wrapped to validate the drafter and the call before anything runs, resolve
  the draft settings, decide once which loop runs the call (`routing.route`), and publish the call's
  :class:`SpecDecodeStats`. Transformers' assisted loop verifies a chain; eagle_hf's loop runs
  `tree_custom_generate` through generate()'s own ``custom_generate`` argument; a call that neither loop can run
  is transformers' plain generate() without the drafter.
* ``GenerationMixin._get_candidate_generator`` returns our chain adapter when the assistant is an EAGLE drafter.
"""

from __future__ import annotations

import functools
import logging
import time

from transformers.generation.utils import GenerationMixin

from ..drafter.modeling import EagleDrafter
from ..speculation.settings import CALL_KEYWORDS, OWN_KEYWORDS, DraftSettings
from ..speculation.stats import _set_last
from .attention import unroute_all
from .call import (
    EagleCall,
    active_call,
    as_keywords,
    batch_rows,
    cache_on_by_default,
    check_call,
    check_compatible,
    normalise_inputs,
    prepare_drafter,
    prompt_length,
    samples,
    set_active_call,
    speculators_for,
)
from .candidate import EagleCandidateGenerator
from .costs import keep_acceptance, keep_costs
from .routing import remember_plain, route, uncroppable_error
from .stopping import eos_ids, stop_strings_as_criterion, trim_at_stopping_criteria
from .tree_loop import tree_custom_generate
from .version import cache_in, check_transformers_version

logger = logging.getLogger(__name__)

_original_generate = GenerationMixin.generate
_original_get_candidate_generator = GenerationMixin._get_candidate_generator


@functools.wraps(_original_generate)
def generate(self, *args, **kwargs):
    drafter = kwargs.get("assistant_model")
    if drafter is None and args:
        drafter = as_keywords(args, {}).get("assistant_model")
    copy_alone = drafter is None and kwargs.get("draft_sources") == "copy"  # copy drafting needs no drafter
    if not isinstance(drafter, EagleDrafter) and not copy_alone:
        return _original_generate(self, *args, **kwargs)
    kwargs = as_keywords(args, kwargs)
    check_transformers_version()
    aux_ids = check_compatible(self, drafter) if drafter is not None else []
    cache_on_by_default(kwargs, self.generation_config)
    check_call(kwargs, self.generation_config)
    normalise_inputs(kwargs)
    saved = drafter.config.draft_settings if drafter is not None else None
    settings = DraftSettings.resolve(saved, kwargs.get("generation_config"),
                                     {k: kwargs.pop(k, None) for k in CALL_KEYWORDS})
    if drafter is not None:  # in the target's dtype and device: itself, or a copy (never converted in place)
        drafter = prepare_drafter(self, drafter)
        if "assistant_model" in kwargs:
            kwargs["assistant_model"] = drafter
    routed = route(self, drafter, settings, kwargs)  # which loop runs the call and its settings, decided once
    call = EagleCall(drafter, aux_ids, routed.settings, listeners=list(kwargs.pop("draft_listeners", None) or []),
                     streamer=kwargs.get("streamer"), sampling=samples(self, kwargs), route=routed)
    if routed.loop == "eagle_hf":
        kwargs.pop("assistant_model", None)
        kwargs["custom_generate"] = tree_custom_generate
        stop_strings_as_criterion(kwargs, self.generation_config)
    elif routed.loop == "plain":
        kwargs.pop("assistant_model", None)
    for key in OWN_KEYWORDS:
        kwargs.pop(key, None)
    if routed.loop != "assisted" or cache_in(kwargs) is not None:
        return _run(self, kwargs, call)
    try:
        return _run(self, kwargs, call)
    except ValueError as e:  # transformers' assisted loop learns only after the prefill that it cannot crop
        if not uncroppable_error(e):
            raise
    why = f"transformers' assisted loop cannot cut back {type(self).__name__}'s cache after its prefill"
    remember_plain(self, why)
    plain = route(self, drafter, settings, kwargs)  # (now "plain", with its warning)
    kwargs.pop("assistant_model", None)
    return _run(self, kwargs, EagleCall(drafter, aux_ids, plain.settings, route=plain))


def _run(self, kwargs: dict, call: EagleCall):
    """Run transformers' generate() with `call` visible to our hooks; collect and publish the stats."""
    set_active_call(call)
    start = time.perf_counter()
    returned = False
    try:
        out = _original_generate(self, **kwargs)
        returned = True
    finally:
        set_active_call(None)
        call.close(hand_over=returned)  # (after an error: dropped, so nothing masks it)
        call.stats.total_time = time.perf_counter() - start
    if call.controller is not None:
        keep_costs(self)  # what this call's timed forwards taught, for the next process
        if returned:  # and its drafting, for the next call
            keep_acceptance(call.drafter, call.settings, call.controller, call.sampling)
    prompt_len = prompt_length(kwargs)
    if batch_rows(kwargs) == 1:  # a batch was cut per row in eagle_hf's loop, and counted there
        out = trim_at_stopping_criteria(out, prompt_len, kwargs)
        sequences = getattr(out, "sequences", out)
        if prompt_len is not None:
            call.stats.new_tokens = int(sequences.shape[-1] - prompt_len)
    _set_last(call.stats)
    if logger.isEnabledFor(logging.INFO):  # (the summary's text costs a call tens of µs)
        logger.info("EAGLE generate (%s): %s", call.settings.mode, call.stats.summary())
    why = _why_no_drafts(call)
    if why:
        logger.info("This call decoded plainly, without verifying a draft: %s", why)
    return out


def _why_no_drafts(call: EagleCall) -> str | None:
    """Why a call that could speculate verified no draft (None: it verified some, or was routed to plain decoding,
    whose warning said why)."""
    stats = call.stats
    if stats.drafted or stats.cycles or getattr(call.route, "loop", None) == "plain":
        return None
    if not stats.fallback_steps:
        return "no round had room for a draft (max_new_tokens)" if stats.final_steps else None
    if call.settings.draft_sources == "copy":
        return ("copy drafting found no earlier occurrence of the text's last tokens to continue (it drafts where "
                "the output repeats the prompt or itself)")
    return ("the adaptive schedule found that drafting does not pay at the drafter's acceptance on this text "
            "(num_assistant_tokens_schedule='constant' drafts every round)")


def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                             assistant_model=None, **kwargs):
    call = active_call()
    if isinstance(assistant_model, EagleDrafter) and call is not None:
        _, (speculator,) = speculators_for(self, stop_tokens=eos_ids(generation_config))
        return EagleCandidateGenerator(generation_config, logits_processor, call, speculator)
    return _original_get_candidate_generator(
        self, generation_config=generation_config, input_ids=input_ids, inputs_tensor=inputs_tensor,
        logits_processor=logits_processor, model_kwargs=model_kwargs, assistant_model=assistant_model, **kwargs,
    )


def install() -> None:
    """Install the two hooks (idempotent). Called by ``import eagle_hf``."""
    if getattr(GenerationMixin, "_eagle_hf_installed", False):
        return
    GenerationMixin.generate = generate
    GenerationMixin._get_candidate_generator = _get_candidate_generator
    GenerationMixin._eagle_hf_installed = True


def uninstall() -> None:
    GenerationMixin.generate = _original_generate
    GenerationMixin._get_candidate_generator = _original_get_candidate_generator
    GenerationMixin._eagle_hf_installed = False
    unroute_all()
