"""`EagleDrafter`: the EAGLE-3 / EAGLE-3.1 draft head.

One decoder layer whose attention reads ``[norm(embedding), norm(hidden)]``, a linear ``fc`` fusing the target's
captured hidden states, a final norm and an ``lm_head`` over a reduced draft vocabulary (``d2t`` maps draft ids
to target ids). EAGLE-3.1 is two config flags: ``fc_norm`` (per-tap RMSNorm before ``fc``) and ``norm_output``
(feed the post-norm hidden state to the next draft step). Equations: ``docs/concepts.md`` and eagle_spec.md §5.2.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN

from ..compat import rope_init
from .config import SPECIAL_TOKENS, EagleConfig, __version__
from .shape import target_shape

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) in float32, cast back, then the weight (as EAGLE's and Llama's norm); the
        # normalisation as one call (eager: one Python call where it was five), the weight's product in it where
        # nothing is cast (float32 throughout: the same numbers, one call fewer)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE: ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``, written as a roll of the
    halves against `Rotary`'s sin, whose first half is negated (sign flips are exact: the same numbers)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class Rotary(nn.Module):
    """RoPE of the drafter, with the full transformers rope menu (default, linear, dynamic, llama3, yarn, ...)."""

    def __init__(self, config: EagleConfig):
        super().__init__()
        rope = config.rope_parameters
        dim = config.head_dim
        if rope.get("rope_type", "default") in ("default", "mrope"):  # mrope on text-only positions = default
            inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.scaling = 1.0
        else:
            inv_freq, self.scaling = rope_init(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._inv_freq32 = inv_freq.float()
        # the frequencies twice and the sign of sin's halves, [head_dim] each (`forward`), float32 as inv_freq
        self.register_buffer("twice", torch.cat((inv_freq, inv_freq)).float(), persistent=False)
        self.register_buffer("sign", torch.cat((-torch.ones(dim // 2), torch.ones(dim // 2))), persistent=False)

    def _apply(self, fn, recurse=True):
        # `.to(dtype)` / `.half()` must not round the frequencies: angles are computed in float32 (as EAGLE, vLLM).
        super()._apply(fn, recurse)
        if not self._inv_freq32.is_meta:
            self.inv_freq = self._inv_freq32.to(self.inv_freq.device)
            self.twice = torch.cat((self._inv_freq32, self._inv_freq32)).to(self.inv_freq.device)
            self.sign = self.sign.float()  # (+-1: exact in any dtype)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, head_dim], the angles' halves repeated, sin's first half
        negated (`rotate`): the angles computed over both halves at once (the same numbers as each half's, and
        as their concatenation: two operations fewer a pass)."""
        freqs = positions[:, None, :, None].float() * self.twice.to(positions.device)  # [B, 1, T, d]
        cos, sin = freqs.cos(), freqs.sin() * self.sign.to(positions.device)
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype), sin.to(dtype)


@dataclass
class KV:
    """Keys and values of the drafter's one layer: ``[B, kv_heads, S, head_dim]`` each (already rotated)."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def append(self, other: KV) -> KV:
        return KV(torch.cat([self.keys, other.keys], 2), torch.cat([self.values, other.values], 2))

    def extended(self, new: KV) -> KV:
        """This cache followed by the `new` rows (what a pass attends over)."""
        return new if self.length == 0 else self.append(new)


@dataclass
class KVWriter:
    """A write position in preallocated keys and values ``[B, kv_heads, capacity, head_dim]``: `extended` writes
    the new rows at slot `at` in place and returns the cache up to them (no copy of the rows before `at`)."""

    keys: torch.Tensor
    values: torch.Tensor
    at: int

    @property
    def length(self) -> int:
        return self.at

    def extended(self, new: KV) -> KV:
        end = self.at + new.length
        self.keys[:, :, self.at : end] = new.keys
        self.values[:, :, self.at : end] = new.values
        return KV(self.keys[:, :, :end], self.values[:, :, :end])


class EagleAttention(nn.Module):
    #: a list only inside `EagleDrafter.recording_attention()`: each pass appends its attention probabilities
    probs_record: list[torch.Tensor] | None = None

    def __init__(self, config: EagleConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        bias = config.attention_bias
        self.q_proj = nn.Linear(2 * h, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)

    def forward(self, u, cos, sin, past: KV | None, mask: torch.Tensor | None) -> tuple[torch.Tensor, KV]:
        # u: [B, T, 2H]; mask: bool [B or 1, 1, T, S + T] (True = attend) or None for plain causal
        b, t, _ = u.shape
        q = self.q_proj(u).view(b, t, self.heads, self.head_dim).transpose(1, 2)  # [B, h, T, d]
        k = self.k_proj(u).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, kvh, T, d]
        v = self.v_proj(u).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        new = KV(k, v)
        full = past.extended(new) if past is not None else new
        if mask is None and full.length > t:  # past fully visible, causal among the new rows
            mask = causal_mask(t, full.length - t, u.device)
        if mask is not None and u.device.type == "cpu" and torch.compiler.is_compiling():
            # (a compiled CPU program: inductor fuses the softmax form into its kernels, where its SDPA is a call to
            # a flash-attention kernel that costs a level's few query rows more)
            probs = attention_probs(q, full.keys, mask, t).view(b, self.kv_heads, -1, full.length)  # [B, kvh, g*T, S]
            out = (probs @ full.values.float()).view(b, self.heads, t, self.head_dim).to(q.dtype)  # [B, h, T, d]
        else:
            out = F.scaled_dot_product_attention(
                q, full.keys, full.values, attn_mask=mask, is_causal=mask is None and t > 1, enable_gqa=True
            )  # [B, h, T, d]
        if self.probs_record is not None:  # opt-in diagnostics: computed beside SDPA, the output is unchanged
            self.probs_record.append(attention_probs(q, full.keys, mask, t).detach())
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), new


def attention_probs(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, t: int) -> torch.Tensor:
    """The probabilities SDPA applies in `EagleAttention.forward`, computed eagerly: float32 ``[B, h, T, S]``.

    q: [B, h, T, d]; keys: [B, kvh, S, d] (rotated); mask: bool [B|1, 1, T, S] (True = attend) or None (causal
    when T > 1, which then equals S)."""
    b, h, _, d = q.shape
    grouped = q.float().reshape(b, keys.shape[1], -1, d)  # [B, kvh, g*T, d]: each key head's query heads (enable_gqa)
    scores = (grouped @ keys.float().transpose(-1, -2)).view(b, h, t, -1) / math.sqrt(d)  # [B, h, T, S]
    if mask is None and t > 1:
        mask = causal_mask(t, keys.shape[2] - t, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1)


def causal_mask(new: int, past: int, device) -> torch.Tensor:
    """bool ``[1, 1, new, past + new]``: every past key visible, causal among the new rows."""
    rows = torch.arange(new, device=device)[:, None]
    cols = torch.arange(past + new, device=device)[None, :]
    return (cols <= rows + past)[None, None]


class EagleMLP(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class EagleDecoderLayer(nn.Module):
    """The "midlayer": attention over ``[input_layernorm(embedding), hidden_norm(hidden)]``."""

    def __init__(self, config: EagleConfig):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)  # on the token embedding
        self.hidden_norm = RMSNorm(h, eps)  # on the hidden input
        self.self_attn = EagleAttention(config)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = EagleMLP(config)
        self.norm_before_residual = config.norm_before_residual

    def forward(self, embeds, hidden, cos, sin, past, mask):
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        u = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)  # [B, T, 2H], embedding first
        attn, new_kv = self.self_attn(u, cos, sin, past, mask)
        h = residual + attn
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, new_kv


@dataclass
class DraftStep:
    """Output of one drafter pass over T rows."""

    logits: torch.Tensor | None  # [B, T, draft_vocab] (None when not asked for)
    hidden: torch.Tensor  # [B, T, H], fed to the next draft step (pre-norm for EAGLE-3, post-norm for 3.1)
    normed: torch.Tensor  # [B, T, H], what lm_head reads
    kv: KV  # keys/values of these T rows


class EagleDrafter(PreTrainedModel):
    """An EAGLE-3 / EAGLE-3.1 drafter. Load with :meth:`from_pretrained` (every published layout).

    Use it as ``target.generate(**inputs, assistant_model=drafter)`` after ``import eagle_hf``.
    """

    config_class = EagleConfig
    base_model_prefix = ""
    main_input_name = "input_ids"
    _no_split_modules = ("EagleDecoderLayer",)
    _supports_sdpa = True

    def __init__(self, config: EagleConfig):
        super().__init__(config)
        h, ht, a = config.hidden_size, config.target_hidden_size, config.num_aux_hidden_states
        self.embed_tokens = nn.Embedding(config.vocab_size, h) if config.own_embedding else None
        self.fc_norm = nn.ModuleList(RMSNorm(ht, config.rms_norm_eps) for _ in range(a)) if config.fc_norm else None
        self.input_norm = RMSNorm(a * ht, config.rms_norm_eps) if config.norm_before_fc else None
        self.fc = nn.Linear(a * ht, h, bias=config.bias)
        self.midlayer = EagleDecoderLayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        if config.draft_vocab_size != config.vocab_size:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        else:
            self.d2t = None
            self.t2d = None
        self.rotary = Rotary(config)
        self._target_embedding = None
        self.post_init()

    # ------------------------------------------------------------------ loading and saving
    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path,
        *,
        revision: str | None = None,
        aux_layer_ids: list[int] | None = None,
        aux_layer_convention: str | None = None,
        fc_norm: bool | None = None,
        norm_output: bool | None = None,
        dtype: torch.dtype | None = None,
        **hub_kwargs,
    ):
        """Load a drafter from a Hub repo id or a local folder, in any published layout.

        Args:
            revision: Hub branch, tag or commit.
            aux_layer_ids / aux_layer_convention: override which target layers the drafter reads
                (``"boundary"``: id k = input of layer k, as vLLM; ``"output"``: id k = output of layer k, as SpecForge).
            fc_norm / norm_output: override the EAGLE-3.1 flags, e.g. ``norm_output=False`` for drafters trained by
                SpecForge <= 0.2.0, which fed back the pre-norm state whatever their config says.
            dtype: cast the weights (by default they keep the checkpoint's dtype; `generate()` drafts with a copy in
                the target's dtype and device where they differ, and leaves this drafter as it is).
            hub_kwargs: passed to ``huggingface_hub.snapshot_download`` (``cache_dir``, ``token``, ``local_files_only``...).
        """
        from .checkpoint import load_drafter

        overrides = {k: v for k, v in (("fc_norm", fc_norm), ("norm_output", norm_output)) if v is not None}
        return load_drafter(
            cls,
            pretrained_model_name_or_path,
            revision=revision,
            aux_layer_ids=aux_layer_ids,
            aux_layer_convention=aux_layer_convention,
            dtype=dtype,
            config_overrides=overrides,
            **hub_kwargs,
        )

    def save_pretrained(self, save_directory, target_model: str | None = None, **kwargs):
        """Save in the EAGLE-3 layout vLLM and SGLang read (``model.safetensors`` + flat Llama ``config.json``).

        The EAGLE-3.1 flags are top-level keys; our provenance (library version, aux-id convention, target) sits in
        an ``eagle_hf`` block that engines ignore.
        """
        if target_model is not None:
            self.config.target_model = target_model
        self.config.eagle_hf = {
            "version": __version__,
            "aux_layer_convention": "boundary",
            "target_model": self.config.target_model,
        }
        return super().save_pretrained(save_directory, **kwargs)

    @classmethod
    def for_target(cls, target, draft_vocab_size: int | None = None, eagle31: bool = True, aux_layer_ids=None, **overrides):
        """A freshly initialised drafter shaped for `target` (same width and heads, target's embedding; the sizes
        its family names otherwise or per layer: `target_shape`)."""
        text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        if aux_layer_ids is None:  # shallow targets (< 5 layers) have fewer than 3 distinct default taps
            from .capture import default_aux_layer_ids

            default_ids = default_aux_layer_ids(int(text.num_hidden_layers))
            aux_layer_ids = default_ids if len(default_ids) != 3 else None
        kwargs = dict(
            **target_shape(text),
            draft_vocab_size=draft_vocab_size or text.vocab_size,
            fc_norm=eagle31,
            norm_output=eagle31,
            aux_layer_ids=aux_layer_ids,
            target_model=getattr(target, "name_or_path", None),
            **{token: getattr(text, token, None) for token in SPECIAL_TOKENS},
        )
        embedding = target.get_input_embeddings().weight  # [V, E]
        if embedding.shape[-1] != kwargs["hidden_size"]:  # (ELECTRA, RemBERT: embeddings narrower than the layers)
            kwargs["own_embedding"] = True  # the target's cannot be shared: the drafter ships one of its width
        kwargs.update(overrides)
        drafter = cls(EagleConfig(**kwargs))
        return drafter.to(embedding.dtype)

    # ------------------------------------------------------------------ target binding
    def bind_target_embedding(self, embedding: nn.Module) -> None:
        """Use the target's input embedding (drafters that ship none). Not registered: never saved."""
        object.__setattr__(self, "_target_embedding", embedding)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        if self._target_embedding is None:
            raise RuntimeError(
                "This drafter ships no token embedding and is not bound to a target. Call "
                "`drafter.bind_target_embedding(target.get_input_embeddings())`, or pass it to `target.generate(..., "
                "assistant_model=drafter)` which binds it."
            )
        return self._target_embedding(input_ids)

    @contextmanager
    def recording_attention(self):
        """Record the attention probabilities of every drafter pass inside the block (for `eagle_hf.tools.diagnose`).

        Yields a list to which each pass appends float32 ``[B, heads, T, S]`` probabilities, computed eagerly
        beside the unchanged SDPA path: drafts are bit-identical with and without recording. Off (no cost) by
        default.
        """
        attn = self.midlayer.self_attn
        attn.probs_record = []
        try:
            yield attn.probs_record
        finally:
            attn.probs_record = None

    # ------------------------------------------------------------------ the algorithm
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """Target taps ``[B, T, num_aux * H_t]`` (ascending layers) -> first hidden input ``[B, T, H]``."""
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        elif self.input_norm is not None:
            aux = self.input_norm(aux)
        return self.fc(aux.to(self.fc.weight.dtype))

    def step(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        past: KV | None = None,
        mask: torch.Tensor | None = None,
        compute_logits: bool = True,
    ) -> DraftStep:
        """One pass over T rows. Row t pairs hidden state ``hidden[:, t]`` with the *next* token ``input_ids[:, t]``.

        hidden: [B, T, H]; input_ids, position_ids: [B, T]; past: cached rows; mask: bool [B|1, 1, T, S+T].
        """
        embeds = self.embed(input_ids).to(hidden.dtype)  # [B, T, H]
        cos, sin = self.rotary(position_ids, hidden.dtype)
        pre, kv = self.midlayer(embeds, hidden, cos, sin, past, mask)  # [B, T, H]
        post = self.norm(pre)
        logits = self.lm_head(post) if compute_logits else None  # [B, T, Vd]
        return DraftStep(logits=logits, hidden=post if self.config.norm_output else pre, normed=post, kv=kv)

    def forward(self, aux_hidden_states, input_ids, position_ids=None, **kwargs):
        """Step 0 over target features (no cache): returns the draft logits ``[B, T, draft_vocab]``."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        return self.step(self.fuse(aux_hidden_states), input_ids, position_ids).logits

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids (``target = draft + d2t[draft]``)."""
        if self.d2t is None:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Scatter ``[..., Vd]`` draft logits into ``[..., V]`` target-vocabulary logits (``-inf`` elsewhere)."""
        if self.d2t is None:
            return draft_logits
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        index = self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=draft_logits.device))
        out[..., index] = draft_logits
        return out

    def _init_weights(self, module):
        std = 0.02
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, EagleDrafter) and module.d2t is not None:
            module.d2t.zero_()
            module.t2d.zero_()
            module.t2d[: module.config.draft_vocab_size] = True
