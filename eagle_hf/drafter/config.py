"""`EagleConfig`: one config class for EAGLE-3 and EAGLE-3.1 drafters (3.1 is two flags)."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

#: eagle_hf's version (the package's `__version__`; a saved drafter's config records it in its provenance)
__version__ = "0.1.0"

#: Architecture names that vLLM / SGLang map to the Llama-style EAGLE-3 drafter.
EAGLE3_ARCHITECTURES = (
    "LlamaForCausalLMEagle3",
    "Eagle3LlamaForCausalLM",
    "Eagle3Qwen2_5vlForCausalLM",
    "Eagle3Qwen3vlForCausalLM",
    "Eagle3MiniMaxM2ForCausalLM",
)
SPECULATORS_ARCHITECTURES = ("Eagle3DraftModel", "Eagle3Speculator")

#: the target's special token ids that a drafter's config repeats (transformers' pipeline compares an assistant's
#: with its model's before it takes the assistant without a tokenizer of its own)
SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


class EagleConfig(PretrainedConfig):
    r"""Configuration of an EAGLE-3 / EAGLE-3.1 drafter.

    It serialises to the flat Llama config that vLLM and SGLang read for `LlamaForCausalLMEagle3` drafters.

    Args:
        hidden_size: drafter width H.
        target_hidden_size: width H_t of the target's hidden states (defaults to `hidden_size`).
        vocab_size: the **target** vocabulary (embedding rows, `t2d` length).
        draft_vocab_size: rows of `lm_head` and length of `d2t` (defaults to `vocab_size`).
        aux_layer_ids: target layers the drafter reads, in the boundary convention (see `eagle_hf.drafter.capture`);
            `None` means the EAGLE-3 default `[2, L//2, L-3]`.
        fc_norm: EAGLE-3.1: one RMSNorm per captured target state before `fc`.
        norm_output: EAGLE-3.1: feed the post-norm hidden state to the next draft step.
        norm_before_fc: gpt-oss / speculators: one RMSNorm over the concatenated taps (exclusive with `fc_norm`).
        norm_before_residual: speculators: the first layer's residual is `hidden_norm(h)`.
        own_embedding: the drafter ships `embed_tokens`; otherwise it uses the target's embedding.
        rope_theta: drafter RoPE base; 10000 when a checkpoint does not say (as the EAGLE reference does).
        draft_settings: this drafter's overrides of the `eagle_hf.speculation.settings.DraftSettings` defaults (`mode`, `depth`, ...).
    """

    model_type = "llama"  # what vLLM / SGLang expect in an EAGLE-3 drafter's config.json

    def __init__(
        self,
        hidden_size: int = 4096,
        intermediate_size: int = 14336,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        num_hidden_layers: int = 1,
        vocab_size: int = 128256,
        draft_vocab_size: int | None = None,
        target_hidden_size: int | None = None,
        rms_norm_eps: float = 1e-5,
        hidden_act: str = "silu",
        rope_theta: float | None = None,
        rope_scaling: dict | None = None,
        rope_parameters: dict | None = None,
        max_position_embeddings: int = 2048,
        attention_bias: bool = False,
        bias: bool = False,
        aux_layer_ids: list[int] | None = None,
        num_aux_hidden_states: int | None = None,
        fc_norm: bool = False,
        norm_output: bool = False,
        norm_before_fc: bool = False,
        norm_before_residual: bool = False,
        own_embedding: bool = False,
        draft_settings: dict | None = None,
        target_model: str | None = None,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.num_hidden_layers = num_hidden_layers
        self.vocab_size = vocab_size
        self.draft_vocab_size = draft_vocab_size or vocab_size
        self.target_hidden_size = target_hidden_size or hidden_size
        self.rms_norm_eps = rms_norm_eps
        self.hidden_act = hidden_act
        self.rope_parameters = _rope_parameters(rope_theta, rope_scaling, rope_parameters)
        self.max_position_embeddings = max_position_embeddings
        self.attention_bias = attention_bias
        self.bias = bias
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids is not None else None
        self.num_aux_hidden_states = num_aux_hidden_states or (len(aux_layer_ids) if aux_layer_ids else 3)
        self.fc_norm = bool(fc_norm)
        self.norm_output = bool(norm_output)
        self.norm_before_fc = bool(norm_before_fc)
        self.norm_before_residual = bool(norm_before_residual)
        self.own_embedding = bool(own_embedding)
        self.draft_settings = dict(draft_settings or {})  # overrides of the DraftSettings defaults only
        self.target_model = target_model
        for token in SPECIAL_TOKENS:  # the target's (the drafter reads its tokenizer): pipelines compare them
            setattr(self, token, kwargs.pop(token, None))
        kwargs.pop("architectures", None)
        super().__init__(tie_word_embeddings=tie_word_embeddings, architectures=["LlamaForCausalLMEagle3"], **kwargs)
        self.validate_eagle()

    def validate_eagle(self) -> None:
        if self.fc_norm and self.norm_before_fc:
            raise ValueError(
                "This drafter config sets both `fc_norm` (EAGLE-3.1: one RMSNorm per captured layer) and "
                "`norm_before_fc` (one RMSNorm over the concatenation); they are mutually exclusive. "
                "Remove one of them from config.json (or from the keywords passed to from_pretrained / EagleConfig)."
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size ({self.draft_vocab_size}) is larger than the target vocabulary ({self.vocab_size})."
            )
        if self.num_hidden_layers != 1:
            raise NotImplementedError(
                f"Drafters with {self.num_hidden_layers} decoder layers are not supported yet (every published "
                "EAGLE-3 drafter has one)."
            )
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != self.num_aux_hidden_states:
            raise ValueError(
                f"aux_layer_ids {self.aux_layer_ids} does not match num_aux_hidden_states={self.num_aux_hidden_states}."
            )

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters["rope_theta"])

    @property
    def is_eagle31(self) -> bool:
        return self.fc_norm and self.norm_output

    @property
    def version(self) -> str:
        """"EAGLE-3.1" (both flags), "EAGLE-3" (neither), or EAGLE-3 with the one flag it has."""
        if self.is_eagle31 or not (self.fc_norm or self.norm_output):
            return "EAGLE-3.1" if self.is_eagle31 else "EAGLE-3"
        return f"EAGLE-3 + {'fc_norm' if self.fc_norm else 'norm_output'}"

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        # vLLM / SGLang read the aux ids from `eagle_config`; omit them when they are the default triple,
        # which every engine resolves the same way.
        ids = out.pop("aux_layer_ids", None)
        if ids is not None:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
        # Older engines read `rope_theta` / `rope_scaling`; newer ones `rope_parameters`: write both.
        rope = dict(out.get("rope_parameters") or {})
        out["rope_theta"] = rope.get("rope_theta", 10000.0)
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        out["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
        out["architectures"] = ["LlamaForCausalLMEagle3"]
        out["model_type"] = "llama"
        return out


def _rope_parameters(theta: float | None, scaling: dict | None, parameters: dict | None) -> dict:
    """One `rope_parameters` dict from the legacy (`rope_theta`, `rope_scaling`) or the v5 spelling.

    A checkpoint without any RoPE setting gets base 10000, as the EAGLE reference and its trainer use.
    """
    params = dict(parameters or {})
    if scaling:
        params.update(scaling)
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
    if theta is not None:
        params["rope_theta"] = float(theta)
    params.setdefault("rope_theta", 10000.0)
    params.setdefault("rope_type", "default")
    return params
