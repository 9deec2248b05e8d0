"""Hybrid targets (recurrent or linear-attention layers beside attention layers) speculate in eagle_hf's loop:
chains whose rejected tail is undone by restoring the recurrent states and replaying the kept tokens
(`eagle_hf.hf.recurrent`). Tiny random models of the families transformers ships, float32, against plain
generate(); an oracle drafter right for a few tokens, then wrong, makes the rewind run."""

from __future__ import annotations

import contextlib
import itertools
from unittest import mock

import pytest
import torch
from conftest import patch_drafts

import eagle_hf
from benchmarks.model_zoo import prompt, tiny_model
from eagle_hf import EagleDrafter
from eagle_hf.hf import tree_loop
from eagle_hf.hf.recurrent import hybrid_unsupported_reason, is_hybrid, steps_tokens
from eagle_hf.speculation.tree import DraftTree

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.cpu_only]

#: family -> how its recurrent layers take a verify's tokens ("together", or "stepwise": their several-token form
#: drops the state, transformers' Jamba starting its scan from zeros)
FAMILIES = {"qwen3_next": "together", "qwen3_5_text": "together", "falcon_h1": "together", "jamba": "stepwise"}
NEW = 14
SAMPLES = 500  # sampled generate() calls of the distribution test
EVERY_ROUND = {"num_assistant_tokens_schedule": "constant"}
MODES = {"default": {}, "chain": {"draft_mode": "chain", "num_assistant_tokens": 4, **EVERY_ROUND}}
_MODELS: dict = {}


def models(family: str):
    if family not in _MODELS:
        target = tiny_model(family)
        torch.manual_seed(2)
        _MODELS[family] = target, EagleDrafter.for_target(target).float().eval()
    return _MODELS[family]


@contextlib.contextmanager
def oracle(reference: torch.Tensor, mask: torch.Tensor, right: int = 3):
    """The drafter proposes each row's greedy continuation (``reference`` [B, T] from plain generate(), `mask`
    its prompt's padding), right for up to `right` tokens a round (one fewer than it drafts) and then wrong:
    every drafting round keeps a part of its chain, and the recurrent states are rewound."""
    pads = (mask == 0).sum(-1).tolist()
    real = [reference[b, p:].tolist() for b, p in enumerate(pads)]  # per row: its tokens without padding
    calls = itertools.count()

    def chain(position, root_token, depth, total_tokens):
        b = next((b for b, r in enumerate(real) if position < len(r) and r[position] == root_token), 0)
        row, drafts = real[b], next(calls)
        tokens = [root_token]
        good = min(right, depth - 1) if depth > 1 else drafts // len(real) % 2  # (a chain of one: right every
        # other round, in every row: the rows of a batch keep as many tokens)
        for i, p in enumerate(range(position + 1, position + depth + 1)):
            token = row[p] if p < len(row) else 1
            tokens.append(token if i < good else (token + 1) % 512)
        tokens = tokens[:total_tokens]
        return DraftTree(torch.tensor(tokens), torch.arange(-1, len(tokens) - 1), torch.zeros(len(tokens)))

    with patch_drafts(chain):
        yield


@contextlib.contextmanager
def count_rewinds():
    """Counts the rounds whose recurrent states were restored and replayed."""
    counts = {"replays": 0}
    original = tree_loop.TreeLoop.rewind

    def rewind(self, active, outcomes, past_len, written):
        kept = max(len(o.keep) for o in outcomes)
        counts["replays"] += self.saved is not None and kept < written
        return original(self, active, outcomes, past_len, written)

    with mock.patch.object(tree_loop.TreeLoop, "rewind", rewind):
        yield counts


@pytest.mark.parametrize("family", list(FAMILIES))
def test_probe_says_how_a_verify_continues_the_state(family):
    target, _ = models(family)
    assert is_hybrid(target)
    assert hybrid_unsupported_reason(target) is None
    assert steps_tokens(target) == (FAMILIES[family] == "stepwise")


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hybrid_greedy_equals_plain_with_rewinds(family, mode, rows):
    target, drafter = models(family)
    inputs = prompt(rows)
    with torch.no_grad():
        expected = target.generate(**inputs, max_new_tokens=NEW, do_sample=False)
        with oracle(expected, inputs["attention_mask"]), count_rewinds() as counts:
            out = target.generate(**inputs, max_new_tokens=NEW, do_sample=False, assistant_model=drafter,
                                  **MODES[mode])
    assert torch.equal(out, expected)
    stats = eagle_hf.last_stats()
    assert stats.accepted > 0 and stats.accepted < stats.drafted, stats.summary()  # kept a part, dropped a part
    assert counts["replays"] > 0
    assert max(stats.draft_length_per_cycle) <= 5  # chains (a tree's top-k is 1 here)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("family", ["qwen3_next", "jamba"])
def test_hybrid_on_a_static_cache(family, rows):
    """transformers' static cache for a hybrid: static attention layers beside the recurrent ones (rewound the
    same way); a model whose layers keep both in one cache layer (Falcon-H1) decodes plainly there."""
    target, drafter = models(family)
    inputs = prompt(rows)
    static = {"cache_implementation": "static", "max_new_tokens": NEW, "do_sample": False}
    with torch.no_grad():
        expected = target.generate(**inputs, **static)
        with oracle(expected, inputs["attention_mask"]), count_rewinds() as counts:
            out = target.generate(**inputs, assistant_model=drafter, **static, **MODES["chain"])
    assert torch.equal(out, expected)
    assert eagle_hf.last_stats().accepted > 0 and counts["replays"] > 0


def test_hybrid_with_a_random_drafter_and_copy_drafting_alone():
    target, drafter = models("qwen3_next")
    inputs = prompt(2)
    with torch.no_grad():
        expected = target.generate(**inputs, max_new_tokens=NEW, do_sample=False)
        out = target.generate(**inputs, max_new_tokens=NEW, do_sample=False, assistant_model=drafter, **EVERY_ROUND)
        assert torch.equal(out, expected)
        one = {k: v[:1] for k, v in inputs.items()}
        copied = target.generate(**one, max_new_tokens=NEW, do_sample=False, draft_sources="copy")
    assert torch.equal(copied, expected[:1])


def test_a_hybrid_whose_several_token_forward_differs_decodes_plainly(caplog):
    """transformers' Bamba: two tokens over its cache differ from one at a time (mixers stepping or not)."""
    target = tiny_model("bamba")
    torch.manual_seed(2)
    drafter = EagleDrafter.for_target(target).float().eval()
    inputs = prompt(1)
    with torch.no_grad(), caplog.at_level("WARNING", logger="eagle_hf"):
        expected = target.generate(**inputs, max_new_tokens=6, do_sample=False)
        out = target.generate(**inputs, max_new_tokens=6, do_sample=False, assistant_model=drafter)
    assert torch.equal(out, expected)
    assert "several new tokens does not continue its cache" in caplog.text
    assert eagle_hf.last_stats().drafted == 0


def test_hybrid_tree_falls_back_to_a_chain_with_a_warning(caplog):
    target, drafter = models("qwen3_5_text")
    inputs = prompt(1)
    with torch.no_grad(), caplog.at_level("WARNING", logger="eagle_hf"):
        expected = target.generate(**inputs, max_new_tokens=8, do_sample=False)
        out = target.generate(**inputs, max_new_tokens=8, do_sample=False, assistant_model=drafter,
                              draft_mode="tree", tree_top_k=3, **EVERY_ROUND)
    assert torch.equal(out, expected)
    assert "a tree's branches would each need their own state" in caplog.text


def test_hybrid_speculative_sampling_is_lossless():
    """Sampled chains on a hybrid target (vocabulary 12, sharpened): the first three new tokens' pairs follow the
    target's exact distribution (a chi-square test, as tests/test_sampling.py runs for attention-only targets)."""
    from test_sampling import ALPHA, chi_square, exact_distribution, marginal
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
    )

    target = tiny_model("jamba", vocab=12)
    with torch.no_grad():
        target.model.final_layernorm.weight.mul_(6.0)  # (structure in p: the random logits are near uniform)
    torch.manual_seed(2)
    drafter = EagleDrafter.for_target(target).float().eval()
    ids = torch.tensor([[3, 7, 1, 5]])
    rows, accepted, drafted = [], 0, 0
    torch.manual_seed(4321)
    with torch.no_grad():
        for _ in range(SAMPLES):
            out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=True,
                                  temperature=0.9, top_k=6, max_new_tokens=4, draft_mode="chain",
                                  num_assistant_tokens=3, **EVERY_ROUND)
            rows.append(tuple(out[0, 4:].tolist()))
            stats = eagle_hf.last_stats()
            accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(6)])
    exact = exact_distribution(target, processors, 3, ids)
    p12 = chi_square(rows, marginal(exact, (0, 1)), (0, 1))
    p23 = chi_square(rows, marginal(exact, (1, 2)), (1, 2))
    assert accepted > 0.1 * SAMPLES and accepted < drafted, (accepted, drafted)
    assert p12 > ALPHA and p23 > ALPHA, (p12, p23)
