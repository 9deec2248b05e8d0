"""Kinds of causal LM in transformers' zoo, tiny, against plain generate(): one family of each kind through the
cases of benchmarks/model_zoo.py (which runs every family), and a regression test per kind of capability that
routing reads (positions, windows named otherwise, recurrent state, no cache, odd config fields)."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import test_device, tiny_drafter, tiny_target

import eagle_hf
from benchmarks.model_zoo import run_case, run_family, tiny_model
from eagle_hf import DrafterLoadError, EagleDrafter
from eagle_hf.hf import hooks

pytestmark = pytest.mark.cpu_only  # (the zoo's tiny models are built on the CPU)


@pytest.fixture(autouse=True)
def one_thread():
    """Models this small run several times faster on one thread than on two that wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

#: one family of each kind -> the loop its tree case runs in ("eagle_hf": trees; "assisted": the chain
#: fallback; "plain": no drafts)
SLICE = {
    "llama": "eagle_hf",  # attention with rotary positions: trees
    "marian": "assisted",  # positions counted by cache slot (no position_ids): chains
    "gpt_neo": "assisted",  # local windows named attention_layers / window_size, applied by slot: chains
    "bloom": "assisted",  # ALiBi (no position_ids; its bias reads slots): chains
    "mamba": "plain",  # recurrent state alone
    "falcon_h1": "eagle_hf",  # a hybrid (recurrent layers beside attention): chains whose states are rewound
    "openai-gpt": "plain",  # no cache at all
    "prophetnet": "plain",  # one token at a time over its cache (probed)
    "doge": "assisted",  # a dynamic mask per head
    "cohere2_moe": "eagle_hf",  # rms_norm_eps None: the drafter reads layer_norm_eps
    "mpt": "assisted",  # its generation config turns the cache off; ALiBi
    "moshi": "assisted",  # its sliding window kept by its cache, its mask full causal: chains
}

#: the cases the slice runs (the benchmark runs the default and chain cases too)
SLICE_CASES = ["tree", "batch", "copy"]


@pytest.mark.parametrize("family", list(SLICE))
def test_zoo_slice_equals_plain_decoding(family):
    """Every case equals plain generate(): speculating, or decoding plainly with its reason logged; the tree case
    runs in the loop the model's kind allows."""
    cells = run_family(family, SLICE_CASES)
    bad = {case: (cell.outcome, cell.detail) for case, cell in cells.items()
           if cell.outcome in ("DIFFERS", "CRASH", "n/a", "silent")}
    assert not bad, bad
    tree = cells["tree"]
    assert tree.loop == SLICE[family], (tree.loop, tree.detail)
    if SLICE[family] == "plain":
        assert all(cell.outcome == "plain" for cell in cells.values()), cells
    else:
        assert tree.outcome == "spec", tree


def test_a_call_that_verified_no_draft_says_why():
    """Copy drafting alone on a text that does not repeat verifies no draft: the call says so, and why."""
    cell = run_case(tiny_model("gpt2"), None, "copy")
    assert cell.outcome == "plain", cell
    assert "copy drafting found no earlier occurrence" in cell.detail


class _PositionBlind(__import__("transformers").GPT2LMHeadModel):
    """A GPT-2 that takes position_ids and ignores them (it counts positions from the cache length, as some models
    do): its config (no rotary positions) cannot say it, the probe finds it."""

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        return super().forward(input_ids=input_ids, **kwargs)


def test_a_model_whose_logits_ignore_position_ids_runs_chains(caplog):
    """The position probe: a forward that takes position_ids but does not read them keeps trees away (a tree's
    nodes would be read at their slots); the chain in transformers' loop is exact."""
    from eagle_hf.hf.probes import positions_unsupported_reason

    gpt2 = tiny_model("gpt2")
    assert positions_unsupported_reason(gpt2) is None
    blind = _PositionBlind(gpt2.config).eval()
    blind.load_state_dict(gpt2.state_dict())
    blind.generation_config.pad_token_id = 0
    assert "do not follow position_ids" in positions_unsupported_reason(blind)
    drafter = EagleDrafter.for_target(blind).float().eval()
    ids = torch.randint(1, 512, (1, 10), generator=torch.Generator().manual_seed(3))
    with caplog.at_level(logging.WARNING, logger="eagle_hf"):
        out = blind.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter, draft_mode="tree")
    assert "falling back to chain" in caplog.text and "position_ids" in caplog.text
    assert torch.equal(out, blind.generate(ids, max_new_tokens=12, do_sample=False))


def test_falcon_with_alibi_runs_chains():
    """Falcon's `alibi` option: its bias reads cache slots, whatever position_ids say (its config says it)."""
    from eagle_hf.hf.probes import positions_unsupported_reason

    falcon = tiny_model("falcon")
    assert positions_unsupported_reason(falcon) is None
    falcon.config.alibi = True
    assert "ALiBi" in positions_unsupported_reason(falcon)


def test_gpt_neo_local_windows_are_read():
    """GPT-Neo names its windows `attention_layers` ("global", "local") and `window_size`: the window check reads
    them, and says why the model runs no trees (it hides keys by cache slot)."""
    from eagle_hf.hf.cache import Window, layer_windows, windows_unsupported_reason

    neo = tiny_model("gpt_neo")
    assert layer_windows(neo) == {"global": None, "local": Window(8)}
    assert "local attention layers (window_size=8) hide keys by cache slot" in windows_unsupported_reason(neo)


def test_a_recurrent_model_decodes_plainly_with_one_warning(caplog):
    """Mamba: every call decodes plainly (a batch and copy drafting alone too, never a raise), warning once per
    model and reason with what would make it speculate; later calls say it at info level."""
    mamba = tiny_model("mamba")
    drafter = EagleDrafter.for_target(mamba).float().eval()
    ids = torch.randint(1, 512, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with caplog.at_level(logging.INFO, logger="eagle_hf"):
        for kwargs in [dict(assistant_model=drafter), dict(assistant_model=drafter), dict(draft_sources="copy")]:
            for rows in (1, 2):
                out = mamba.generate(ids[:rows], attention_mask=mask[:rows], max_new_tokens=6, do_sample=False,
                                     **kwargs)
                plain = mamba.generate(ids[:rows], attention_mask=mask[:rows], max_new_tokens=6, do_sample=False)
                assert torch.equal(out, plain)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "Decoding plainly" in r.message]
    assert len(warnings) == 1 and "stateful" in warnings[0].message and "To speculate" in warnings[0].message
    assert sum("Decoding plainly" in r.message for r in caplog.records) == 6


def test_a_cache_found_uncroppable_after_the_prefill_is_remembered(monkeypatch, caplog):
    """transformers' assisted loop learns only after its prefill that a cache cannot be cut back (a linear
    attention layer's recurrent state): that call decodes plainly, and later calls on a model of the same class
    and config decode plainly from the start."""
    from test_tree import unmaskable_target

    target = unmaskable_target()
    drafter = tiny_drafter(target)
    original = type(target)._assisted_decoding
    calls = []

    def refusing(self, *args, **kwargs):
        calls.append(1)
        raise ValueError("Assisted decoding requires a cache that can be cropped to restore the states")

    monkeypatch.setattr(type(target), "_assisted_decoding", refusing)
    monkeypatch.setattr("eagle_hf.hf.routing._PLAIN_LEARNT", {})
    ids = torch.randint(1, 96, (1, 6), generator=torch.Generator().manual_seed(1)).to(test_device())
    ref = target.generate(ids, max_new_tokens=8, do_sample=False)
    with caplog.at_level(logging.WARNING, logger="eagle_hf"):
        out = target.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=drafter, draft_mode="chain")
        again = target.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=drafter, draft_mode="chain")
    assert torch.equal(out, ref) and torch.equal(again, ref) and len(calls) == 1
    assert "cannot cut back" in caplog.text
    monkeypatch.setattr(type(target), "_assisted_decoding", original)


@pytest.mark.parametrize("family,field,value", [
    ("mamba", "num_attention_heads", 1),  # no attention heads: heads of 64 channels
    ("cohere2_moe", "rms_norm_eps", 1e-5),  # rms_norm_eps None: layer_norm_eps
    ("gemma3n_text", "intermediate_size", 128),  # a size per layer: the widest
    ("gemma4_text", "head_dim", None),  # a field transformers answers per layer only: the widest layer's
])
def test_drafters_for_odd_configs(family, field, value):
    target = tiny_model(family)
    drafter = EagleDrafter.for_target(target)
    if value is None:
        value = max(getattr(layer, field) for layer in target.config.get_text_config().per_layer_config)
    assert getattr(drafter.config, field) == value


def test_a_config_without_a_width_is_refused_by_name():
    from types import SimpleNamespace

    text = SimpleNamespace(vocab_size=96, num_hidden_layers=2)  # no hidden_size, d_model or n_embd
    target = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text))
    with pytest.raises(DrafterLoadError, match="no integer hidden_size"):
        EagleDrafter.for_target(target)


def test_the_cache_a_model_turns_off_by_default_is_kept(monkeypatch):
    """MPT's generation config turns the cache off: a call that does not say keeps one and speculates (its
    output is plain generate()'s); use_cache=False passed explicitly stays refused by name."""
    mpt = tiny_model("mpt")
    assert mpt.generation_config.use_cache is False
    drafter = EagleDrafter.for_target(mpt).float().eval()
    ids = torch.randint(1, 512, (1, 8), generator=torch.Generator().manual_seed(0))
    out = mpt.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=drafter,
                       num_assistant_tokens_schedule="constant")
    assert torch.equal(out, mpt.generate(ids, max_new_tokens=8, do_sample=False))
    assert eagle_hf.last_stats().drafted > 0
    with pytest.raises(eagle_hf.EagleCompatibilityError, match="use_cache=False"):
        mpt.generate(ids, max_new_tokens=4, use_cache=False, assistant_model=drafter)
    assert hooks.generate is not None


def test_the_text_generation_pipeline_takes_the_drafter_as_its_assistant():
    """transformers' pipeline compares an assistant's special tokens with its model's: a drafter's config repeats
    its target's, so `pipeline(..., assistant_model=drafter)` needs no assistant tokenizer, and its text is plain
    decoding's."""
    from conftest import word_tokenizer
    from transformers import pipeline

    target = tiny_target("llama", layers=2)
    drafter = tiny_drafter(target)
    assert drafter.config.pad_token_id == target.config.pad_token_id
    tok = word_tokenizer()
    plain = pipeline("text-generation", model=target, tokenizer=tok)
    spec = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=drafter)
    kwargs = dict(max_new_tokens=8, do_sample=False)
    assert spec("wa wb wc", **kwargs)[0]["generated_text"] == plain("wa wb wc", **kwargs)[0]["generated_text"]


def test_output_attentions_are_returned_as_plain_decoding_returns_them(caplog):
    """With eager attention, output_attentions in a dict-returning call decodes plainly (a warning names it) and
    returns each step's attentions as plain generate() does; without return_dict_in_generate it speculates."""
    target = tiny_target("llama", layers=2, attn_implementation="eager")
    drafter = tiny_drafter(target)
    ids = torch.randint(1, 96, (1, 6), generator=torch.Generator().manual_seed(4)).to(test_device())
    kwargs = dict(max_new_tokens=5, do_sample=False, output_attentions=True, return_dict_in_generate=True)
    plain = target.generate(ids, **kwargs)
    with caplog.at_level(logging.WARNING, logger="eagle_hf"):
        out = target.generate(ids, assistant_model=drafter, **kwargs)
    assert "output_attentions" in caplog.text and torch.equal(out.sequences, plain.sequences)
    assert len(out.attentions) == len(plain.attentions)
    assert all(torch.equal(a, b) for step, ref in zip(out.attentions, plain.attentions) for a, b in zip(step, ref))
