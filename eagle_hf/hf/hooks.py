"""The two hooks that bring EAGLE drafters into transformers' own `generate()`; pass-through for every other call.

* ``GenerationMixin.generate`` is wrapped to validate the drafter and the call before anything runs, resolve
  the draft settings, and publish the call's :class:`SpecDecodeStats`. Chain mode then runs transformers'
  assisted loop; tree mode runs `tree_custom_generate` through generate()'s own ``custom_generate`` argument.
* ``GenerationMixin._get_candidate_generator`` returns our chain adapter when the assistant is an EAGLE drafter.
"""

from __future__ import annotations

import functools
import logging
import time

from transformers.generation.utils import GenerationMixin

from ..adaptive import choose_tree_size
from .costs import controller_for, cost_model, keep_costs
from ..errors import EagleCompatibilityError
from ..modeling import EagleDrafter
from ..settings import CALL_KEYWORDS, OWN_KEYWORDS, DraftSettings
from ..stats import _set_last
from .call import (
    EagleCall, active_call, as_keywords, batch_rows, check_call, check_compatible, prepare_drafter, prompt_length,
    set_active_call, speculators_for,
)
from .attention import unroute_all
from .cache import cache_unsupported_reason, tree_unsupported_reason
from .candidate import EagleCandidateGenerator
from .stopping import eos_ids, trim_at_stopping_criteria
from .tree_loop import VERIFY_BUCKETS, tree_custom_generate
from .version import cache_in, check_transformers_version

logger = logging.getLogger(__name__)

_original_generate = GenerationMixin.generate
_original_get_candidate_generator = GenerationMixin._get_candidate_generator

#: the slots a static cache gets beyond the output in tree mode: one verify forward of the widest bucket
STATIC_CACHE_ROOM = VERIFY_BUCKETS[-1]

#: inputs tree mode cannot take yet: the call runs in chain mode
CHAIN_ONLY_INPUTS = ("pixel_values", "image_grid_thw", "token_type_ids", "inputs_embeds")


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
    check_call(kwargs, self.generation_config)
    saved = drafter.config.draft_settings if drafter is not None else None
    settings = DraftSettings.resolve(saved, kwargs.get("generation_config"),
                                     {k: kwargs.pop(k, None) for k in CALL_KEYWORDS})
    call = EagleCall(drafter, aux_ids, settings, listeners=list(kwargs.pop("draft_listeners", None) or []),
                     streamer=kwargs.get("streamer"))
    if drafter is not None:
        prepare_drafter(self, drafter)
    reason = _tree_unsupported(self, kwargs)  # eagle_hf's own loop cannot run here: chains in transformers' loop
    if settings.mode == "tree" and reason:
        _log_fallback_once(self, reason, asked="mode" in settings.sources)
        settings.mode = "chain"
    cache = cache_in(kwargs)
    if reason:
        if settings.draft_sources == "copy":
            raise EagleCompatibilityError(
                f"Copy drafting runs in eagle_hf's own decoding loop, which is not possible here ({reason}). "
                "Use prompt_lookup_num_tokens= (transformers' prompt lookup) or draft_sources='eagle'."
            )
        if settings.draft_sources == "eagle+copy":
            logger.info("Copy drafting is not possible here (%s); the drafter drafts alone.", reason)
            settings.draft_sources = "eagle"
    if settings.mode == "chain" and cache is not None and cache.get_seq_length() > 0:
        # transformers' assisted loop (5.23) diverges from plain decoding when the cache already holds a prefix,
        # for its own prompt lookup too; our loop with one child per node is the same chain, and exact
        logger.info("A prefilled cache: chain drafting runs in eagle_hf's loop (a tree with top_k=1).")
        _as_tree_with_top_k_1(settings)
    rows = batch_rows(kwargs)
    if rows > 1:
        if reason:
            raise EagleCompatibilityError(
                f"Batched EAGLE drafting runs in eagle_hf's own decoding loop, which is not possible here ({reason}). "
                "Call generate() once per prompt.")
        if settings.mode == "chain":  # transformers' assisted loop decodes one sequence
            logger.info("Batch of %d rows: eagle_hf's loop drafts the chains (trees with top_k=1).", rows)
            _as_tree_with_top_k_1(settings)
    if settings.mode == "chain" and settings.uses_copy and not reason:  # transformers' loop verifies one chain
        logger.info("Copy drafting in chain mode: eagle_hf's loop drafts the chain (a tree with top_k=1).")
        _as_tree_with_top_k_1(settings)
    if settings.mode == "tree" and settings.total_tokens <= 0:  # -1: size the tree from the verify costs
        settings.total_tokens = choose_tree_size(cost_model(self, drafter))  # (as learnt so far: the prior at first)
        logger.info("Tree size chosen from the verify costs: %d tokens", settings.total_tokens)
    call.controller = controller_for(self, drafter, settings)
    if settings.mode == "tree":
        _room_for_trees(self, kwargs)
        kwargs.pop("assistant_model", None)
        kwargs["custom_generate"] = tree_custom_generate
    for key in OWN_KEYWORDS:
        kwargs.pop(key, None)
    return _run(self, kwargs, call)


def _room_for_trees(target, kwargs: dict) -> None:
    """A static cache that generate() builds is sized to the output (`max_length - 1` slots): ask for room for
    one more verify forward of the largest padded width after it, so that trees near the end are not cut."""
    config = _generation_config(target, kwargs)
    if _cache_implementation(target, kwargs) != "static" or cache_in(kwargs) is not None:
        return
    new, prompt = kwargs.get("max_new_tokens", config.max_new_tokens), prompt_length(kwargs)
    if new is None or prompt is None:  # (generate() derives the length some other way: trees may be cut)
        return
    wanted = prompt + new - 1 + STATIC_CACHE_ROOM
    kwargs["max_cache_len"] = max(wanted, kwargs.get("max_cache_len") or config.max_cache_len or 0)


def _generation_config(target, kwargs: dict):
    return kwargs.get("generation_config") or target.generation_config


def _cache_implementation(target, kwargs: dict) -> str | None:
    """The call's `cache_implementation` (a keyword, else its generation config's)."""
    return kwargs.get("cache_implementation", _generation_config(target, kwargs).cache_implementation)


def _as_tree_with_top_k_1(settings: DraftSettings) -> None:
    """The same chain, drafted and verified by eagle_hf's loop; an "auto" source stays the chain's (the drafter)."""
    if settings.draft_sources == "auto":
        settings.draft_sources = "eagle"
    settings.mode, settings.top_k, settings.total_tokens = "tree", 1, settings.depth + 1


def _run(self, kwargs: dict, call: EagleCall):
    """Run transformers' generate() with `call` visible to our hooks; collect and publish the stats."""
    set_active_call(call)
    start = time.perf_counter()
    try:
        out = _original_generate(self, **kwargs)
    finally:
        set_active_call(None)
        call.stats.total_time = time.perf_counter() - start
    if call.controller is not None:
        keep_costs(self)  # what this call's timed forwards taught, for the next process
    prompt_len = prompt_length(kwargs)
    if batch_rows(kwargs) == 1:  # a batch was cut per row in eagle_hf's loop, and counted there
        out = trim_at_stopping_criteria(out, prompt_len, kwargs)
        sequences = getattr(out, "sequences", out)
        if prompt_len is not None:
            call.stats.new_tokens = int(sequences.shape[-1] - prompt_len)
    _set_last(call.stats)
    logger.info("EAGLE generate (%s): %s", call.settings.mode, call.stats.summary())
    return out


def _tree_unsupported(target, kwargs: dict) -> str | None:
    special = [k for k in CHAIN_ONLY_INPUTS if kwargs.get(k) is not None]
    if special:
        return f"tree mode does not take {', '.join(special)} yet"
    reason = tree_unsupported_reason(target) or cache_unsupported_reason(cache_in(kwargs),
                                                                         _cache_implementation(target, kwargs))
    return f"{type(target).__name__}: {reason}" if reason else None


def _log_fallback_once(target, reason: str, asked: bool) -> None:
    """Warn once per model when tree mode was asked for (later calls, and a default tree mode, log at info
    level): the fallback is a property of the model."""
    level = logging.INFO if getattr(target, "_eagle_hf_warned_fallback", False) or not asked else logging.WARNING
    logger.log(level, "Tree drafting is not possible here (%s); falling back to chain drafting.", reason)
    if asked:
        target._eagle_hf_warned_fallback = True


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
