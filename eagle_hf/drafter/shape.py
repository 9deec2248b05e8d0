"""A drafter's sizes read from its target's config, whatever names the target's family gives them."""

from __future__ import annotations

from .checkpoint import DrafterLoadError


def target_shape(text) -> dict:
    """The drafter's sizes read from a target's text config, whatever names the family gives them: a per-layer
    size (a list, or a field the config only answers per layer) takes its widest layer; a config without attention
    heads (a recurrent model) gets heads of 64 channels; the norm epsilon is `rms_norm_eps`, else `layer_norm_eps`
    or `layer_norm_epsilon`. A field the drafter cannot do without (the width, the vocabulary) raises
    `DrafterLoadError` naming it."""
    def read(*names, default=None):
        for name in names:
            try:
                value = getattr(text, name, None)
            except Exception:  # noqa: BLE001  (a per-layer field read globally: transformers refuses)
                value = _widest_per_layer(text, name)
            if isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
                value = max(value)
            if value is not None:
                return value
        return default

    hidden, vocab = read("hidden_size", "d_model", "n_embd"), read("vocab_size")
    for name, value in (("hidden_size", hidden), ("vocab_size", vocab)):
        if not isinstance(value, int):
            raise DrafterLoadError(
                f"EagleDrafter.for_target: the target's config ({type(text).__name__}) has no integer {name} "
                f"(found {value!r}); pass {name}= to for_target, or build the drafter from an EagleConfig.")
    heads = read("num_attention_heads") or max(1, hidden // 64)
    if hidden % heads:
        heads = 1
    head_dim = read("head_dim") or hidden // heads
    return dict(
        hidden_size=hidden,
        intermediate_size=read("intermediate_size", "ffn_hidden_size", default=4 * hidden),
        num_attention_heads=heads,
        num_key_value_heads=read("num_key_value_heads", default=heads) if read("num_attention_heads") else heads,
        head_dim=head_dim,
        vocab_size=vocab,
        rms_norm_eps=read("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", default=1e-6),
        rope_theta=(read("rope_parameters") or {}).get("rope_theta", 10000.0),
        max_position_embeddings=read("max_position_embeddings", default=2048),
    )


def _widest_per_layer(text, name: str):
    """The largest value of a per-layer field (`per_layer_config[i].<name>`), or None."""
    layers = getattr(text, "per_layer_config", None) or []
    values = [getattr(layer, name, None) for layer in layers]
    values = [v for v in values if isinstance(v, (int, float))]
    return max(values) if values else None
