"""Which loop runs a call, decided once, before any compute.

Two words, kept apart: the draft's *shape* (a chain is a tree with ``top_k = 1``) and the *loop* that verifies
it. Transformers' assisted loop (``"assisted"``) verifies one chain of one sequence through the
`CandidateGenerator` adapter; eagle_hf's own loop (``"eagle_hf"``, `tree_loop`) verifies trees, batches, copy
branches and chains where transformers' loop cannot (a prefilled cache). Where neither loop can run the call
(a recurrent model's state cannot be cut back to the accepted tokens; a batch, copy drafting alone or a static
cache on a model eagle_hf's loop cannot serve), it decodes plainly (``"plain"``: transformers' generate() without
the drafter), with one warning that names why and what would make it speculate. `route` reads the call and the
model (inputs, cache, attention kernel, batch), returns the settings the loop runs with (the caller's are left as
they were), says why where it had to fall back, and logs each decision once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from ..drafter.capture import taps_unsupported_reason
from ..speculation.schedule import choose_tree_size
from ..speculation.settings import MAX_DEPTH, DraftSettings
from .cache import (
    VERIFY_BUCKETS,
    cache_unsupported_reason,
    cacheless_reason,
    is_static,
    tree_unsupported_reason,
    windows_unsupported_reason,
)
from .call import batch_rows, empty_prompt_reason, prompt_length, samples
from .costs import cost_model
from .indexed import indexed_unsupported_reason
from .probes import positions_unsupported_reason, verify_unsupported_reason
from .recurrent import hybrid_unsupported_reason, is_hybrid, mixed_layers_reason
from .version import cache_in

logger = logging.getLogger(__name__)

#: the slots a static cache gets beyond the output in eagle_hf's loop: one verify forward of the widest bucket
STATIC_CACHE_ROOM = VERIFY_BUCKETS[-1]
#: inputs eagle_hf's loop cannot take yet: the call runs in transformers' assisted loop
CHAIN_ONLY_INPUTS = ("pixel_values", "image_grid_thw", "token_type_ids", "inputs_embeds")
#: what makes a model that decodes plainly for its cache speculate
CROPPABLE = "speculation needs a model whose cache can be cut back to the accepted tokens (attention layers)"
#: (model class, config) -> why transformers' assisted loop cannot run it, learnt at a first call (`remember_plain`)
_PLAIN_LEARNT: dict[tuple[type, str], str] = {}


@dataclass(frozen=True)
class Route:
    loop: str  # "assisted" (transformers' loop, one chain), "eagle_hf" (ours: trees, batches, copies) or "plain"
    settings: DraftSettings  # the settings the loop runs with
    reason: str | None = None  # why eagle_hf's loop cannot run this call (None: it can); "plain": why no loop can


def route(target, drafter, settings: DraftSettings, kwargs: dict) -> Route:
    """Decide the call's loop and the settings it runs with (`Route.settings`: `settings` settled for the loop, a
    new object; the caller's are not changed)."""
    reason = unsupported_reason(target, kwargs) or (empty_prompt_reason(kwargs) if drafter is not None else None)
    learnt = bool(_PLAIN_LEARNT) and _model_key(target) in _PLAIN_LEARNT  # (a config's key only where one was learnt)
    plain = plain_reason(target, settings, kwargs, reason) if reason or learnt else None
    plain = plain or _attentions_asked(target, kwargs)
    if plain:
        _log_plain_once(target, *plain)
        return Route("plain", replace(settings), plain[0])
    if reason:
        settings = _fall_back(target, settings, reason)
    elif is_hybrid(target):
        settings = _hybrid_chain(target, settings)
    elif settings.mode == "chain":
        why = _own_loop_for_chain(target, settings, kwargs)
        if why:
            logger.info("%s: eagle_hf's loop drafts the chain (a tree with top_k=1).", why)
            sources = "eagle" if settings.draft_sources == "auto" else settings.draft_sources  # (a chain's: the drafter)
            longest = MAX_DEPTH if settings.schedule.startswith("heuristic") else settings.depth  # (it grows)
            settings = replace(settings, mode="tree", top_k=1, total_tokens=longest + 1, draft_sources=sources)
    if settings.mode == "tree" and settings.total_tokens <= 0:  # -1: size the tree from the verify costs
        size = choose_tree_size(cost_model(target, drafter))  # (as learnt so far: the prior at first)
        settings = replace(settings, total_tokens=size)
        logger.info("Tree size chosen from the verify costs: %d tokens", settings.total_tokens)
    if settings.mode == "tree":
        _room_for_trees(target, kwargs)
    return Route("eagle_hf" if settings.mode == "tree" else "assisted", replace(settings), reason)


def unsupported_reason(target, kwargs: dict) -> str | None:
    """Why eagle_hf's own loop cannot run this call (None: it can)."""
    special = [k for k in CHAIN_ONLY_INPUTS if kwargs.get(k) is not None]
    if special:
        return f"tree mode does not take {', '.join(special)} yet"
    cache, implementation = cache_in(kwargs), cache_implementation(target, kwargs)
    reason = (taps_unsupported_reason(target) or tree_unsupported_reason(target)
              or cache_unsupported_reason(cache, implementation)
              or windows_unsupported_reason(target) or indexed_unsupported_reason(target)
              or verify_unsupported_reason(target) or positions_unsupported_reason(target)
              or _hybrid_unsupported_reason(target, cache, implementation))
    return f"{type(target).__name__}: {reason}" if reason else None


def _hybrid_unsupported_reason(target, cache, implementation: str | None) -> str | None:
    """Why eagle_hf's loop cannot rewind a hybrid target's recurrent layers in this call (None: it can, or the
    target is no hybrid)."""
    if not is_hybrid(target):
        return None
    if is_static(cache, implementation) and mixed_layers_reason(target):
        return mixed_layers_reason(target)
    return hybrid_unsupported_reason(target)


def plain_reason(target, settings: DraftSettings, kwargs: dict, reason: str | None = None) -> tuple[str, str] | None:
    """Why no loop can run a call that eagle_hf's loop cannot run (`reason`), and what would make it speculate
    (None: transformers' assisted loop takes it, as a chain of the drafter's drafts)."""
    name, cache, rows = type(target).__name__, cache_in(kwargs), batch_rows(kwargs)
    learnt = _PLAIN_LEARNT.get(_model_key(target)) if _PLAIN_LEARNT else None
    if learnt:
        return learnt, CROPPABLE
    if getattr(target, "_is_stateful", False):
        if is_hybrid(target):
            return reason, ("the default dynamic cache where the reason is the static cache's; otherwise a model whose "
                            "forward over several tokens continues its recurrent state as one-token decoding does")
        return f"{name} is stateful: its recurrent state cannot be cut back to the accepted tokens", CROPPABLE
    taps = taps_unsupported_reason(target)
    if taps:
        return f"{name}: {taps}", "a drafter needs hidden states of one stream per token"
    cacheless = cacheless_reason(target) or verify_unsupported_reason(target)
    if cacheless:
        return f"{name}: {cacheless}", "speculation needs a model that verifies several tokens over a cache"
    if cache is not None and _uncroppable(cache):
        return f"the cache passed in has layers that cannot be cut back to the accepted tokens ({reason})", CROPPABLE
    if is_static(cache, cache_implementation(target, kwargs)):
        why = f"eagle_hf's loop cannot run it ({reason}) and transformers' assisted loop cannot cut back a static cache"
        return why, "use the default dynamic cache (no cache_implementation) to speculate as a chain"
    if settings.draft_sources == "copy":
        fix = ("pass the drafter (assistant_model=drafter) to speculate as a chain, or prompt_lookup_num_tokens= for "
               "transformers' prompt lookup")
        return f"copy drafting runs in eagle_hf's loop only, which cannot run it ({reason})", fix
    if rows > 1:
        why = f"a batch of {rows} rows runs in eagle_hf's loop only, which cannot run it ({reason})"
        return why, "call generate() once per prompt to speculate as a chain"
    return None


def _attentions_asked(target, kwargs: dict) -> tuple[str, str] | None:
    """output_attentions in a call that returns a dict: neither loop returns the attentions of each step as plain
    decoding does, so the call decodes plainly and returns them (None: not asked)."""
    config = _generation_config(target, kwargs)
    asked = kwargs.get("output_attentions", getattr(config, "output_attentions", False))
    returned = kwargs.get("return_dict_in_generate", getattr(config, "return_dict_in_generate", False))
    if not (asked and returned):
        return None
    return ("output_attentions: speculative decoding does not return each step's attentions",
            "drop output_attentions (or return_dict_in_generate)")


def remember_plain(target, why: str) -> None:
    """transformers' assisted loop refused `target` at its first verify (a cache it could not cut back, known only
    once the prefill filled it): later calls on a model of its class and config decode plainly from the start."""
    _PLAIN_LEARNT[_model_key(target)] = why


def uncroppable_error(error: Exception) -> bool:
    """Whether `error` is transformers' assisted loop refusing a cache it cannot cut back (it knows only after the
    prefill: a linear-attention layer that keeps a recurrent state)."""
    return isinstance(error, ValueError) and "cache that can be cropped" in str(error)


def _model_key(target) -> tuple[type, str]:
    return type(target), target.config.to_json_string(use_diff=False)


def _uncroppable(cache) -> bool:
    """Whether a cache passed in holds layers whose state may not be cut back (recurrent or linear attention)."""
    from transformers import cache_utils

    linear = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)  # (transformers 5.24 and later)
    return linear is not None and any(isinstance(layer, linear) for layer in getattr(cache, "layers", ()))


def _log_plain_once(target, reason: str, fix: str) -> None:
    """One warning per model and reason (later calls log at info level): the call decodes plainly."""
    warned = target.__dict__.setdefault("_eagle_hf_warned_plain", set())
    level = logging.INFO if reason in warned else logging.WARNING
    warned.add(reason)
    logger.log(level, "Decoding plainly, without drafts: %s. To speculate: %s.", reason, fix)


def _fall_back(target, settings: DraftSettings, reason: str) -> DraftSettings:
    """The settings of transformers' assisted loop: a chain of the drafter's drafts, one sequence, in a cache it
    can crop (`plain_reason` sends the calls it cannot take to plain decoding)."""
    if settings.mode == "tree":
        _log_fallback_once(target, reason, asked="mode" in settings.sources)
        settings = replace(settings, mode="chain")
    if settings.draft_sources == "eagle+copy":
        logger.info("Copy drafting is not possible here (%s); the drafter drafts alone.", reason)
        settings = replace(settings, draft_sources="eagle")
    return settings


def _hybrid_chain(target, settings: DraftSettings) -> DraftSettings:
    """A hybrid target's settings: chains in eagle_hf's loop, which rewinds its recurrent layers
    (`eagle_hf.hf.recurrent`); a tree asked for falls back to a chain of its depth, copy branches beside the
    drafter are left out (they would make a tree), and copy drafting alone drafts one branch."""
    why = "its recurrent layers read tokens in order, so a tree's branches would each need their own state"
    if settings.mode == "tree" and settings.top_k > 1 and settings.uses_eagle:
        _log_fallback_once(target, f"{type(target).__name__}: {why}", asked="mode" in settings.sources)
    if settings.draft_sources == "eagle+copy" or (settings.draft_sources == "auto" and settings.mode == "tree"):
        logger.info("Copy branches beside the drafter are left out on %s: %s.", type(target).__name__, why)
    sources = "copy" if settings.draft_sources == "copy" else "eagle"
    longest = MAX_DEPTH if settings.schedule.startswith("heuristic") else settings.depth  # (a heuristic grows)
    return replace(settings, mode="tree", top_k=1, total_tokens=longest + 1, draft_sources=sources, copy_branches=1)


def _own_loop_for_chain(target, settings: DraftSettings, kwargs: dict) -> str | None:
    """Why a chain runs in eagle_hf's loop rather than transformers' (None: it does not)."""
    cache = cache_in(kwargs)
    if is_static(cache, cache_implementation(target, kwargs)):
        # transformers 5.23's assisted loop refuses static caches; ours holds a chain in one on every version
        # (and runs transformers' compiled forward on it)
        return "A static cache"
    if cache is not None and cache.get_seq_length() > 0:
        # transformers' assisted loop (5.23) diverges from plain decoding when the cache already holds a prefix,
        # for its own prompt lookup too; our loop with one child per node is the same chain, and exact
        return "A prefilled cache"
    rows = batch_rows(kwargs)
    if rows > 1:  # transformers' assisted loop decodes one sequence
        return f"Batch of {rows} rows"
    if settings.uses_copy:  # transformers' loop verifies one chain
        return "Copy drafting in chain mode"
    if not samples(target, kwargs):  # ours drafts and verifies a round with one read; a sampled chain keeps
        return "A greedy chain"       # transformers' loop and its exact-q acceptance
    return None


def _log_fallback_once(target, reason: str, asked: bool) -> None:
    """Warn once per model when tree mode was asked for (later calls, and a default tree mode, log at info
    level): the fallback is a property of the model."""
    level = logging.INFO if getattr(target, "_eagle_hf_warned_fallback", False) or not asked else logging.WARNING
    logger.log(level, "Tree drafting is not possible here (%s); falling back to chain drafting.", reason)
    if asked:
        target._eagle_hf_warned_fallback = True


def cache_implementation(target, kwargs: dict) -> str | None:
    """The call's `cache_implementation` (a keyword, else its generation config's)."""
    return kwargs.get("cache_implementation", _generation_config(target, kwargs).cache_implementation)


def _generation_config(target, kwargs: dict):
    return kwargs.get("generation_config") or target.generation_config


def _room_for_trees(target, kwargs: dict) -> None:
    """A static cache that generate() builds is sized to the output (`max_length - 1` slots): ask for room for
    one more verify forward of the largest padded width after it, so that trees near the end are not cut."""
    config = _generation_config(target, kwargs)
    if cache_implementation(target, kwargs) != "static" or cache_in(kwargs) is not None:
        return
    new, prompt = kwargs.get("max_new_tokens", config.max_new_tokens), prompt_length(kwargs)
    if new is None or prompt is None:  # (generate() derives the length some other way: trees may be cut)
        return
    wanted = prompt + new - 1 + STATIC_CACHE_ROOM
    kwargs["max_cache_len"] = max(wanted, kwargs.get("max_cache_len") or config.max_cache_len or 0)
