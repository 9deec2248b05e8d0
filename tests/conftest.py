"""Shared fixtures: tiny random targets of several families and tiny drafters, built in-process."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

import eagle_hf  # noqa: F401  (installs the generate() hooks)
from eagle_hf import EagleConfig, EagleDrafter

VOCAB = 96
HIDDEN = 64


def tiny_target(family: str = "llama", vocab: int = VOCAB, layers: int = 6, seed: int = 0, **overrides):
    """A randomly initialised tiny causal LM of the given family, float32, eval mode."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    common.update(overrides)
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    elif family == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=16, **common))
    elif family == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(sliding_window=None, **common))
    elif family == "gemma3":
        model = tf.Gemma3ForCausalLM(
            tf.Gemma3TextConfig(head_dim=16, sliding_window=8, layer_types=None, **common)
        )
    else:
        raise ValueError(family)
    model.generation_config.pad_token_id = 0
    return model.eval()


def tiny_drafter(target=None, *, vocab: int = VOCAB, draft_vocab: int | None = None, seed: int = 1, **overrides):
    """A random tiny drafter; shaped for `target` when given."""
    torch.manual_seed(seed)
    if target is not None:
        drafter = EagleDrafter.for_target(target, draft_vocab_size=draft_vocab, **overrides)
    else:
        cfg = dict(
            hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=vocab, draft_vocab_size=draft_vocab or vocab, fc_norm=True, norm_output=True,
        )
        cfg.update(overrides)
        drafter = EagleDrafter(EagleConfig(**cfg))
    if drafter.d2t is not None:  # a valid random draft vocabulary: every other id, then the tail
        vd, v = drafter.config.draft_vocab_size, drafter.config.vocab_size
        used = torch.sort(torch.randperm(v, generator=torch.Generator().manual_seed(seed))[:vd]).values
        drafter.d2t.copy_(used - torch.arange(vd))
        drafter.t2d.zero_()
        drafter.t2d[used] = True
    return drafter.float().eval()


@pytest.fixture(scope="module")
def one_thread():
    """The tiny models are dominated by thread-pool overhead; one intra-op thread is ~4x faster on a busy CPU."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def llama_target():
    return tiny_target("llama")


def patch_drafts(fake):
    """Patch the drafter's tree growth with ``fake(position, root_token, depth, total_tokens) -> DraftTree`` per
    drafting row; `position` is the root's (the drafter has read the real rows before it)."""
    from unittest import mock

    from eagle_hf import speculation

    def draft_trees(drafter, state, roots, logits, hidden, depths, top_k, total_tokens, *args, rows=None, **kwargs):
        rows = list(range(state.rows)) if rows is None else rows
        return [fake(state.positions[b], root, depth, total)
                for b, root, depth, total in zip(rows, roots, depths, total_tokens)]

    return mock.patch.object(speculation, "draft_trees", draft_trees)
