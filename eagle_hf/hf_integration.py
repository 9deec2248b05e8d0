"""Everything that touches transformers internals lives here.

After ``import eagle_hf``, ``target.generate(..., assistant_model=drafter)`` with an :class:`EagleDrafter` runs
transformers' own assisted-decoding loop with :class:`EagleCandidateGenerator` drafting from the target's hidden
states. Two hooks make that happen, both pass-through for every other call:

* ``GenerationMixin.generate`` is wrapped to validate the drafter against the target before anything runs, to
  resolve the per-call draft settings and to collect :class:`SpecDecodeStats`;
* ``GenerationMixin._get_candidate_generator`` returns our generator when the assistant is an EAGLE drafter.

Tested against transformers 5.23 (``SUPPORTED_TRANSFORMERS``); other versions raise a clear error on use.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.utils import GenerationMixin

from .adaptive import choose_tree_size, controller_for, measure_costs
from .capture import gather_aux, hidden_state_request, num_decoder_layers, resolve_aux_layer_ids
from .config import DEFAULT_DRAFT_SETTINGS
from .drafting import DraftState, draft_chain
from .modeling import EagleDrafter
from .stats import SpecDecodeStats, _set_last

logger = logging.getLogger(__name__)

SUPPORTED_TRANSFORMERS = (Version("5.20.0"), Version("6.0.0"))  # [min, max)
MAX_DRAFT_TOKENS = 32

#: generate() keyword -> draft setting; transformers' own assisted-generation names where one exists.
CALL_SETTINGS = {
    "draft_mode": "mode",  # "chain" (transformers' assisted loop) or "tree" (our loop)
    "tree_depth": "depth",
    "tree_top_k": "top_k",
    "tree_total_tokens": "total_tokens",
    "num_assistant_tokens": "num_draft_tokens",
    "num_assistant_tokens_schedule": "schedule",
    "assistant_confidence_threshold": "confidence_threshold",
}

OUR_KEYWORDS = ("draft_mode", "tree_depth", "tree_top_k", "tree_total_tokens")  # not transformers' keywords
SCHEDULES = ("adaptive", "constant", "heuristic", "heuristic_transient")

_call = threading.local()  # the EAGLE call in flight in this thread: settings and stats


class EagleCompatibilityError(ValueError):
    """The drafter cannot serve this target or this generate() call; the message names the fix."""


def check_transformers_version(version: str | None = None) -> None:
    v = Version(version or transformers.__version__)
    low, high = SUPPORTED_TRANSFORMERS
    if not (low <= v < high):
        raise EagleCompatibilityError(
            f"eagle_hf hooks into transformers' assisted-generation loop and supports transformers >={low},<{high}; "
            f"found {v}. Install a supported version: pip install 'transformers>={low},<{high}'."
        )


def check_compatible(target, drafter: EagleDrafter) -> list[int]:
    """Validate that `drafter` can draft for `target`; return the boundary aux ids it reads."""
    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
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


def resolve_settings(drafter: EagleDrafter, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Draft settings: defaults < the drafter's saved settings < this call's keywords."""
    settings = {**DEFAULT_DRAFT_SETTINGS, **(drafter.config.draft_settings or {})}
    gen_config = kwargs.get("generation_config")
    for key, name in CALL_SETTINGS.items():
        if gen_config is not None and getattr(gen_config, key, None) is not None:
            settings[name] = getattr(gen_config, key)
        if kwargs.get(key) is not None:
            settings[name] = kwargs[key]
    explicit_k = kwargs.get("num_assistant_tokens") is not None or (
        gen_config is not None and getattr(gen_config, "num_assistant_tokens", None) is not None
    )
    explicit_schedule = kwargs.get("num_assistant_tokens_schedule") is not None or (
        gen_config is not None and getattr(gen_config, "num_assistant_tokens_schedule", None) is not None
    )
    if explicit_k and not explicit_schedule and settings["schedule"] == "adaptive":
        settings["schedule"] = "constant"  # a fixed draft length was asked for: measure exactly that
    source = "(from this call, its generation_config or the drafter's config.json `draft_settings`)"
    k = int(settings["num_draft_tokens"])
    if not 1 <= k <= MAX_DRAFT_TOKENS:
        raise EagleCompatibilityError(f"num_assistant_tokens must be in 1..{MAX_DRAFT_TOKENS}, got {k} {source}.")
    if settings["schedule"] not in SCHEDULES:
        raise EagleCompatibilityError(
            f"num_assistant_tokens_schedule must be one of {SCHEDULES}, got {settings['schedule']!r} {source}."
        )
    if settings["mode"] not in ("chain", "tree"):
        raise EagleCompatibilityError(f"draft_mode must be 'chain' or 'tree', got {settings['mode']!r} {source}.")
    for name, keyword in (("depth", "tree_depth"), ("top_k", "tree_top_k"), ("max_draft_tokens", "max_draft_tokens"),
                          ("probe_every", "probe_every")):
        if int(settings[name]) < 1:
            raise EagleCompatibilityError(f"{keyword} must be at least 1, got {settings[name]} {source}.")
    total = int(settings["total_tokens"])
    if total < 2 and total != -1:
        raise EagleCompatibilityError(
            f"tree_total_tokens must be at least 2 (the root and one draft), or -1 to size the tree from measured "
            f"costs; got {total} {source}."
        )
    if float(settings["keep_gain"]) > float(settings["min_gain"]):
        raise EagleCompatibilityError(
            f"keep_gain ({settings['keep_gain']}) must not exceed min_gain ({settings['min_gain']}): the adaptive "
            f"schedule starts drafting above min_gain and stops below keep_gain {source}."
        )
    return settings


def _check_call(target, args, kwargs) -> None:
    inputs = kwargs.get("inputs", kwargs.get("input_ids"))
    if inputs is None and args:
        inputs = args[0]
    if isinstance(inputs, torch.Tensor):
        if inputs.dim() == 2 and inputs.shape[0] > 1:
            raise EagleCompatibilityError(
                f"EAGLE drafting supports batch size 1; got {inputs.shape[0]} sequences. Call generate() once per "
                "prompt (or generate without the drafter for batched throughput)."
            )
        if inputs.shape[-1] == 0:
            raise EagleCompatibilityError("The prompt is empty: pass at least one token (e.g. the chat template's).")
    gen_config = kwargs.get("generation_config")
    nrs = kwargs.get("num_return_sequences", getattr(gen_config, "num_return_sequences", None)) or 1
    if nrs > 1:
        raise EagleCompatibilityError(
            f"num_return_sequences={nrs} is not supported with EAGLE drafting; call generate() {nrs} times."
        )
    if (kwargs.get("num_beams") or getattr(gen_config, "num_beams", 1) or 1) > 1:
        raise EagleCompatibilityError("Beam search cannot be combined with speculative decoding; drop num_beams.")


def prepare_drafter(target, drafter: EagleDrafter) -> None:
    """Put the drafter on the target's device and dtype and give it the target's embedding when it has none."""
    emb = target.get_input_embeddings()
    device, dtype = emb.weight.device, emb.weight.dtype
    if not dtype.is_floating_point:  # quantized embeddings
        dtype = getattr(target, "dtype", torch.float32)
    if drafter.fc.weight.device != device or drafter.fc.weight.dtype != dtype:
        logger.info("Moving the drafter to %s / %s to match the target", device, dtype)
        drafter.to(device=device, dtype=dtype)
    if drafter.embed_tokens is None:
        drafter.bind_target_embedding(emb)
    drafter.eval()


class EagleCandidateGenerator(CandidateGenerator):
    """Chain drafting for transformers' assisted-decoding loop, from the target's own hidden states.

    Round r: the target's last forward returned aux taps for the positions it verified; the accepted ones become
    real drafter rows, then the drafter proposes up to K tokens. With ``do_sample`` the drafts are sampled from
    the drafter's distribution after the same logits processors as the target, and those exact distributions
    are returned as ``candidate_logits`` for lossless rejection sampling.
    """

    requires_model_outputs = True

    def __init__(self, target, drafter, generation_config, logits_processor, aux_ids, settings, stats):
        self.drafter = drafter
        self.aux_ids = list(aux_ids)
        # a user who asked for all hidden states keeps them; we read our taps from the full tuple
        wanted = True if generation_config.output_hidden_states else hidden_state_request(self.aux_ids)
        self.model_kwargs_overrides = {"output_hidden_states": wanted}
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        self.max_length = generation_config.max_length
        self.settings = settings
        self.num_draft_tokens = int(settings["num_draft_tokens"])
        self.controller = settings.get("controller")  # DraftLengthController when schedule == "adaptive"
        self.stats: SpecDecodeStats = stats
        self.state = DraftState()
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # real rows not yet run through the drafter
        self._round = "prefill"  # what the current round does: prefill | fallback | draft
        self._last_drafted = 0
        self.listeners = list(settings.get("listeners") or [])
        self._last_draft: list[int] = []
        self._last_probs: list[float] = []
        self._round_start: float | None = None

    # -- choosing a draft token -------------------------------------------------------------------------
    def _choose(self, draft_logits: torch.Tensor, prefix: torch.Tensor, drafted: list[int]):
        """draft_logits: [1, Vd] -> (target id, processed target logits [1, V] or None, its probability)."""
        if not self.do_sample and len(self.logits_processor) == 0:
            probs = torch.softmax(draft_logits.float(), dim=-1)
            p, idx = probs.max(dim=-1)
            return self.drafter.draft_to_target(idx)[0], None, float(p)
        logits = self.drafter.target_logits(draft_logits.float())  # [1, V]
        if len(self.logits_processor) > 0:
            ids = torch.cat([prefix, torch.tensor([drafted], dtype=prefix.dtype, device=prefix.device)], 1) if drafted else prefix
            logits = self.logits_processor(ids, logits)
        probs = torch.softmax(logits, dim=-1)
        token = torch.multinomial(probs, 1)[0, 0] if self.do_sample else probs.argmax(-1)[0]
        return token, (logits if self.do_sample else None), float(probs[0, token])

    # -- CandidateGenerator API ---------------------------------------------------------------------------
    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False, n_last_matches=0):
        if is_first_iteration or model_outputs is None:
            self._round = "prefill"
            return input_ids, None  # the target prefills; drafting starts from its hidden states
        start = time.perf_counter()
        if self.controller is not None and self._round == "fallback" and self._round_start is not None:
            self.controller.observe_plain_round(start - self._round_start)  # the whole plain round that just ended
        self._round_start = start
        after_cycle = self._round == "draft"  # the drafter catches up on accepted+1 rows, not on a backlog
        with torch.no_grad():
            device = self.drafter.fc.weight.device
            aux = gather_aux(model_outputs.hidden_states, self.aux_ids, device)  # [1, t, A*H_t]
            n_new = aux.shape[1] if self._round == "prefill" else n_last_matches + 1
            next_tokens = input_ids[:, -n_new:].to(self.drafter.fc.weight.device)
            self._pending.append((aux[:, :n_new], next_tokens))  # rows: (features of t, token t+1)
            wanted = self._draft_length()
            k = min(wanted, self.max_length - input_ids.shape[1] - 1)
            if k <= 0:  # plain decoding this round; the drafter catches up lazily when drafting resumes
                self._round = "fallback" if wanted <= 0 else "last"  # "last": no room left to draft
                self._last_drafted = 0
                self.stats.drafter_time += time.perf_counter() - start
                return input_ids, None
            aux_rows = torch.cat([a for a, _ in self._pending], 1).to(self.drafter.fc.weight.dtype)
            next_tokens = torch.cat([t for _, t in self._pending], 1)
            self._pending.clear()
            logits, hidden = self.state.extend(self.drafter, aux_rows, next_tokens)
            caught_up = time.perf_counter()
            tokens, q_logits, probs = draft_chain(
                self.drafter,
                self.state,
                logits,
                hidden,
                k,
                lambda lg, drafted: self._choose(lg, input_ids.to(device), drafted),
                float(self.settings.get("confidence_threshold") or 0.0),
            )
        self._round = "draft"
        if self.controller is not None and after_cycle:
            self.controller.observe_drafter(caught_up - start, time.perf_counter() - caught_up, len(tokens))
        self._last_drafted = len(tokens)
        self._last_draft = tokens
        self._last_probs = probs
        candidates = torch.cat([input_ids, torch.tensor([tokens], dtype=input_ids.dtype, device=input_ids.device)], 1)
        candidate_logits = torch.stack(q_logits, dim=1) if q_logits else None  # [1, k, V]
        self.stats.drafter_time += time.perf_counter() - start
        return candidates, candidate_logits

    def _draft_length(self) -> int:
        return self.controller.choose() if self.controller is not None else self.num_draft_tokens

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        if self._round == "fallback":
            self.stats.fallback_steps += 1
        elif self._round == "last":
            self.stats.final_steps += 1
        if self._round != "draft":
            if self._round != "prefill":
                for listener in self.listeners:  # a plain step: no drafts, the target's own token
                    listener([], 0, int(input_ids[0, -1]))
            return
        num_matches = int(num_matches)
        self.stats.record_cycle(self._last_drafted, num_matches)
        if self.controller is not None:
            self.controller.update(self._last_drafted, num_matches, self._last_probs)
        for listener in self.listeners:
            listener(self._last_draft, num_matches, int(input_ids[0, -1]))
        if self.settings["schedule"] in ("heuristic", "heuristic_transient"):
            if num_matches == self._last_drafted:
                self.num_draft_tokens = min(self.num_draft_tokens + 2, MAX_DRAFT_TOKENS)
            else:
                self.num_draft_tokens = max(1, self.num_draft_tokens - 1)


# ------------------------------------------------------------------------------------------------- tree mode
def tree_supported(target) -> bool:
    """Tree verification needs a plain causal mask we can replace: no sliding-window or other layer types."""
    text = target.config.get_text_config()
    if getattr(text, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return False  # flash / flex attention read a 4D float mask differently
    types = getattr(text, "layer_types", None)
    if types and any(t != "full_attention" for t in types):
        return False
    if getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True):
        return False
    return not getattr(target, "_is_stateful", False)


def compact_cache(cache, past_len: int, keep: torch.Tensor) -> None:
    """Keep the prefix and the accepted tree nodes (`keep`, indices relative to `past_len`) in every layer."""
    for layer in cache.layers:
        if type(layer).__name__ != "DynamicLayer":
            raise NotImplementedError(
                f"Tree mode needs a plain DynamicCache; this cache has {type(layer).__name__} layers. "
                "Use draft_mode='chain' (or cache_implementation='dynamic')."
            )
        index = (past_len + keep).to(layer.keys.device)
        layer.keys = torch.cat([layer.keys[:, :, :past_len], layer.keys.index_select(2, index)], 2)
        layer.values = torch.cat([layer.values[:, :, :past_len], layer.values.index_select(2, index)], 2)


def _tree_custom_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
    """`custom_generate` callable: generate() has prepared processors, criteria and the cache."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    from .tree_decoding import tree_generate

    active = _call.active
    cache = model_kwargs.get("past_key_values")
    seq, scores = tree_generate(
        model, active["drafter"], input_ids, cache, logits_processor, stopping_criteria, generation_config,
        active["aux_ids"], active["settings"], active["stats"], active.get("streamer"),
    )
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(
            sequences=seq, scores=tuple(scores) if generation_config.output_scores else None, past_key_values=cache
        )
    return seq


# ------------------------------------------------------------------------------------------------- hooks
_original_generate = GenerationMixin.generate
_original_get_candidate_generator = GenerationMixin._get_candidate_generator
_GENERATE_SIGNATURE = inspect.signature(_original_generate)


def _assistant_of(args, kwargs):
    if "assistant_model" in kwargs:
        return kwargs["assistant_model"]
    try:
        bound = _GENERATE_SIGNATURE.bind_partial(None, *args)
    except TypeError:
        return None
    return bound.arguments.get("assistant_model")


@functools.wraps(_original_generate)
def generate(self, *args, **kwargs):
    drafter = _assistant_of(args, kwargs)
    if not isinstance(drafter, EagleDrafter):
        return _original_generate(self, *args, **kwargs)
    check_transformers_version()
    aux_ids = check_compatible(self, drafter)
    _check_call(self, args, kwargs)
    settings = resolve_settings(drafter, kwargs)
    for key in OUR_KEYWORDS:
        kwargs.pop(key, None)
    listeners = kwargs.pop("draft_listeners", None)
    if listeners:
        settings["listeners"] = list(listeners)
    prepare_drafter(self, drafter)
    special = [k for k in ("pixel_values", "image_grid_thw", "token_type_ids", "past_key_values", "inputs_embeds")
               if kwargs.get(k) is not None]
    if settings["mode"] == "tree" and special:
        logger.warning("Tree mode does not take %s yet; falling back to chain drafting.", ", ".join(special))
        settings["mode"] = "chain"
    if settings["mode"] == "tree" and not tree_supported(self):
        logger.warning(
            "%s has sliding-window (or other non-causal) attention layers, which cannot take a tree mask; "
            "falling back to chain drafting.", type(self).__name__,
        )
        settings["mode"] = "chain"
    if settings["mode"] == "tree":
        if int(settings["total_tokens"]) <= 0:  # -1: size the tree from this device's measured verify costs
            settings["total_tokens"] = choose_tree_size(measure_costs(self, drafter, max_tokens=32))
            logger.info("Tree size chosen from measured verify costs: %d tokens", settings["total_tokens"])
    settings["controller"] = controller_for(self, drafter, settings)
    if settings["mode"] == "tree":
        return _generate_tree(self, drafter, args, kwargs, aux_ids, settings)
    return _run_with_stats(self, args, kwargs, {"aux_ids": aux_ids, "settings": settings})


def _run_with_stats(self, args, kwargs, active: dict, custom_generate=None):
    """Run transformers' generate() with `active` visible to our hooks; collect and publish the stats."""
    stats = SpecDecodeStats()
    _call.active = {**active, "stats": stats}
    extra = {"custom_generate": custom_generate} if custom_generate is not None else {}
    start = time.perf_counter()
    try:
        out = _original_generate(self, *args, **extra, **kwargs)
    finally:
        _call.active = None
        stats.total_time = time.perf_counter() - start
    prompt_len = _prompt_length(args, kwargs)
    out = trim_at_stopping_criteria(out, prompt_len, kwargs)
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    if prompt_len is not None:
        stats.new_tokens = int(sequences.shape[-1] - prompt_len)
    _set_last(stats)
    logger.info("EAGLE generate (%s): %s", active["settings"]["mode"], stats.summary())
    return out


def _generate_tree(self, drafter, args, kwargs, aux_ids, settings):
    kwargs = dict(kwargs)
    kwargs.pop("assistant_model", None)
    args = list(args)
    if len(args) > 6:  # assistant_model passed positionally
        args[6] = None
    for key in CALL_SETTINGS:
        kwargs.pop(key, None)
    active = {"drafter": drafter, "aux_ids": aux_ids, "settings": settings, "streamer": kwargs.get("streamer")}
    return _run_with_stats(self, args, kwargs, active, custom_generate=_tree_custom_generate)


def trim_at_stopping_criteria(out, prompt_len: int | None, kwargs: dict):
    """Cut the output where plain generate() would have stopped.

    The assisted loop (and our tree loop) evaluate custom stopping criteria once per round, after a whole
    accepted chunk; plain decoding evaluates them after every token. Re-evaluating the user's criteria (and
    `stop_strings`) on each prefix restores plain generate()'s output. Streamers have already seen the overshoot.
    """
    from transformers import StopStringCriteria

    from transformers.generation.stopping_criteria import ConfidenceCriteria, MaxTimeCriteria

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
        except Exception:  # a criterion that needs scores: leave the output as it is
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
    for name in ("scores", "logits"):
        if getattr(out, name, None) is not None:
            setattr(out, name, getattr(out, name)[: length - prompt_len])
    if getattr(out, "past_key_values", None) is not None and extra > 0:
        out.past_key_values.crop(-extra)
    return out


def _prompt_length(args, kwargs) -> int | None:
    inputs = kwargs.get("inputs", kwargs.get("input_ids"))
    if inputs is None and args:
        inputs = args[0]
    return int(inputs.shape[-1]) if isinstance(inputs, torch.Tensor) else None


def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, assistant_model=None, **kwargs):
    active = getattr(_call, "active", None)
    if isinstance(assistant_model, EagleDrafter) and active is not None:
        return EagleCandidateGenerator(
            self, assistant_model, generation_config, logits_processor, active["aux_ids"], active["settings"], active["stats"]
        )
    return _original_get_candidate_generator(
        self,
        generation_config=generation_config,
        input_ids=input_ids,
        inputs_tensor=inputs_tensor,
        logits_processor=logits_processor,
        model_kwargs=model_kwargs,
        assistant_model=assistant_model,
        **kwargs,
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


def write_custom_generate(folder) -> str:
    """Copy the Hub-hostable `custom_generate/` strategy (and its README) into `folder`; returns the folder."""
    import shutil
    from pathlib import Path

    src = Path(__file__).resolve().parent / "hub_template"
    dst = Path(folder)
    shutil.copytree(src / "custom_generate", dst / "custom_generate", dirs_exist_ok=True)
    if not (dst / "README.md").exists():
        shutil.copy(src / "README.md", dst / "README.md")
    return str(dst)
