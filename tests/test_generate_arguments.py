"""generate()'s whole surface with a drafter: every argument of the installed transformers is classified
(tests/generate_arguments.py) and holds in every mode, at batch 1 and 2: plain generate()'s output (float32 greedy),
a sampling run, or a refusal by name before any compute; stop strings with their tokenizer on their own."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import VOCAB, tiny_drafter, tiny_target
from generate_arguments import ARGUMENTS, VERDICTS, table_markdown
from test_batch import left_padded
from transformers import GenerationConfig, GenerationMixin

from eagle_hf import EagleCompatibilityError

pytestmark = pytest.mark.usefixtures("one_thread")
MODES = {"default": {}, "tree": dict(draft_mode="tree"), "chain": dict(draft_mode="chain"),
         "copies alone": dict(draft_sources="copy")}


def byte_level_tokenizer():
    """A byte-level BPE tokenizer of VOCAB tokens (stop strings need one whose tokens decode to their text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = sorted(set("abcdefghijklmnopqrstuvwxyz .,"))
    words = "the cat sat on the mat, and the dog ran to the park. " * 20
    tok.train_from_iterator([words], trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=alphabet,
                                                         special_tokens=["<pad>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")


@pytest.fixture(scope="module")
def setup():
    tok = byte_level_tokenizer()
    target = tiny_target("llama", vocab=VOCAB)
    return tok, target, tiny_drafter(target)


def a_stop_string(tok, out: torch.Tensor, prompt_len: int) -> str:
    """The text of a generated token (from the fourth on) that decodes to letters: plain generate() stops there."""
    for i in range(prompt_len + 3, out.shape[1]):
        text = tok.decode(out[0, i : i + 1])
        if text.strip().isalpha():
            return text.strip()
    pytest.skip("no generated token decodes to letters")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("rows", [1, 2])
def test_stop_strings_with_their_tokenizer_stop_where_plain_generate_stops(setup, mode, rows):
    tok, target, drafter = setup
    ids, mask = left_padded((9, 6)[:rows] if rows > 1 else (9,), vocab=VOCAB)
    # (an EOS id: without one, plain generate() goes on writing a stopped row's tokens, eagle_hf pads it)
    call = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=VOCAB - 1)
    free = target.generate(ids, **call)
    stop = a_stop_string(tok, free, ids.shape[1])
    plain = target.generate(ids, **call, stop_strings=[stop], tokenizer=tok)
    assert plain.shape[1] < free.shape[1] or rows > 1  # (the stop string does stop plain generate())
    assist = {} if mode == "copies alone" else dict(assistant_model=drafter)
    out = target.generate(ids, **call, stop_strings=[stop], tokenizer=tok, **assist, **MODES[mode])
    assert torch.equal(out, plain)


@pytest.mark.parametrize("mode", list(MODES))
def test_use_cache_false_is_refused_by_name_before_any_compute(setup, mode, monkeypatch):
    _, target, drafter = setup
    monkeypatch.setattr(type(target), "forward", lambda *a, **k: pytest.fail("a forward ran"))
    assist = {} if mode == "copies alone" else dict(assistant_model=drafter)
    with pytest.raises(EagleCompatibilityError, match="use_cache=False"):
        target.generate(torch.tensor([[5, 9, 12]]), max_new_tokens=8, use_cache=False, **assist, **MODES[mode])


# ---------------------------------------------------------------- the whole surface (tests/generate_arguments.py)

#: arguments a batch refuses by name (a row per step that batch rows drafting apart do not have)
BATCH_REFUSED = {"output_hidden_states"}


def transformers_arguments() -> set[str]:
    """Every GenerationConfig field and named parameter of generate() in the installed transformers."""
    params = set(inspect.signature(GenerationMixin.generate).parameters) - {"self"}
    return set(GenerationConfig().to_dict()) | params


def test_every_argument_of_generate_is_classified():
    missing = sorted(transformers_arguments() - set(ARGUMENTS))
    assert not missing, f"unclassified generate() arguments (add them to tests/generate_arguments.py): {missing}"
    assert all(verdict in VERDICTS for verdict, _, _ in ARGUMENTS.values())


def _call(target, drafter, rows: int, mode: str | None, extra: dict):
    ids, mask = left_padded((9, 6)[:rows], vocab=VOCAB)
    call = {"attention_mask": mask, "max_new_tokens": 12, "do_sample": False, **extra}
    if mode is not None:
        call.update(MODES[mode], **({} if mode == "copies alone" else dict(assistant_model=drafter)))
    torch.manual_seed(0)
    out = target.generate(ids, **call)
    return getattr(out, "sequences", out)


@pytest.mark.parametrize("name", [n for n, (v, x, _) in ARGUMENTS.items() if v == "equal" and x is not None])
def test_an_argument_keeps_plain_generate_output_in_every_mode(setup, name):
    _, target, drafter = setup
    value = ARGUMENTS[name][1]
    for rows in (1, 2):
        ref = _call(target, drafter, rows, None, {name: value})
        for mode in MODES:
            if rows > 1 and name in BATCH_REFUSED:
                with pytest.raises(EagleCompatibilityError):
                    _call(target, drafter, rows, mode, {name: value})
                continue
            assert torch.equal(_call(target, drafter, rows, mode, {name: value}), ref), (rows, mode)


@pytest.mark.parametrize("name", [n for n, (v, x, _) in ARGUMENTS.items() if v == "sampling"])
def test_a_sampling_argument_runs_in_every_mode(setup, name):
    _, target, drafter = setup
    extra = {"do_sample": True, name: ARGUMENTS[name][1]}
    for mode in MODES:
        out = _call(target, drafter, 1, mode, extra)
        assert out.shape[1] > 9


@pytest.mark.parametrize("name", [n for n, (v, x, _) in ARGUMENTS.items() if v == "refused"])
def test_a_refused_argument_is_named_before_any_compute(setup, name, monkeypatch):
    _, target, drafter = setup
    monkeypatch.setattr(type(target), "forward", lambda *a, **k: pytest.fail("a forward ran"))
    for mode in MODES:
        with pytest.raises(EagleCompatibilityError, match=name):
            _call(target, drafter, 1, mode, {name: ARGUMENTS[name][1]})


def test_the_usage_page_shows_the_table():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    assert table_markdown() in page, "docs/usage.md: paste table_markdown() of tests/generate_arguments.py"


# ---------------------------------------------------------------------------- the prompt's tensors
def _every_mode(target, drafter, ids, **call):
    """Each mode's output (or the error it raised) for one call."""
    outs = {}
    for mode, extra in MODES.items():
        assist = {} if mode == "copies alone" else dict(assistant_model=drafter)
        try:
            outs[mode] = target.generate(ids, **call, **assist, **extra)
        except EagleCompatibilityError as err:
            outs[mode] = err
    return outs


def _plain_everywhere(target, drafter, ids, **call):
    plain = target.generate(ids, **call)
    for mode, out in _every_mode(target, drafter, ids, **call).items():
        assert isinstance(out, torch.Tensor), (mode, out)
        assert out.dtype == plain.dtype and torch.equal(out, plain), mode


def test_a_prompt_without_any_token_in_its_mask_gives_plain_output(setup):
    """A batch of one whose attention_mask is all zeros: plain generate() takes it; the drafter has no context,
    so the call drafts a chain in transformers' loop."""
    _, target, drafter = setup
    ids, _ = left_padded((7,), vocab=VOCAB)
    _plain_everywhere(target, drafter, ids, attention_mask=torch.zeros_like(ids), max_new_tokens=10, do_sample=False)


def test_a_batch_row_that_is_all_padding_gives_plain_output(setup, caplog):
    """A left-padded batch with an empty prompt: not right padding, and every row as plain generate() writes it.
    A batch where no row has a token decodes plainly (the drafter has no context), saying so."""
    _, target, drafter = setup
    ids, mask = left_padded((7, 5, 1), vocab=VOCAB)
    ids[2], mask[2] = 0, 0  # the third prompt: all padding
    _plain_everywhere(target, drafter, ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    ids, mask = torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long)  # no row has a token
    with caplog.at_level("INFO", logger="eagle_hf"):
        _plain_everywhere(target, drafter, ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert "Decoding plainly" in caplog.text and "holds no token" in caplog.text


def test_int32_ids_give_plain_generates_int64_output(setup):
    _, target, drafter = setup
    for rows in (1, 2):
        ids, mask = left_padded((9, 6)[:rows], vocab=VOCAB)
        _plain_everywhere(target, drafter, ids.int(), attention_mask=mask, max_new_tokens=8, do_sample=False)


def _refused_before_any_compute(target, drafter, monkeypatch, match, ids=None, **call):
    monkeypatch.setattr(type(target), "forward", lambda *a, **k: pytest.fail("a forward ran"))
    for mode, out in _every_mode(target, drafter, ids, max_new_tokens=5, **call).items():
        assert isinstance(out, EagleCompatibilityError), mode
        assert match in str(out), (mode, str(out))


@pytest.mark.parametrize("mask", [torch.ones(1, 5, dtype=torch.long), torch.ones(7, dtype=torch.long),
                                  torch.ones(2, 7, dtype=torch.long)], ids=["short", "1-D", "rows"])
def test_an_attention_mask_that_does_not_fit_the_ids_is_refused_by_name(setup, monkeypatch, mask):
    """Plain generate() fails deep inside (a size mismatch) or, in its tree loop, eagle_hf went on silently."""
    _, target, drafter = setup
    ids, _ = left_padded((7,), vocab=VOCAB)
    _refused_before_any_compute(target, drafter, monkeypatch, "attention_mask has shape", ids, attention_mask=mask)


def test_one_dimensional_ids_are_refused_by_name(setup, monkeypatch):
    _, target, drafter = setup
    _refused_before_any_compute(target, drafter, monkeypatch, "input_ids has shape (7,)", torch.arange(1, 8))


@pytest.mark.parametrize("dtype", [torch.int16, torch.float32])
def test_ids_the_embedding_cannot_take_are_refused_by_name(setup, monkeypatch, dtype):
    """Plain generate() refuses them in its embedding; eagle_hf names them before any compute."""
    _, target, drafter = setup
    ids = torch.arange(1, 8)[None].to(dtype)
    _refused_before_any_compute(target, drafter, monkeypatch, f"input_ids are {dtype}", ids)


def test_inputs_embeds_without_ids_are_refused_by_name(setup, monkeypatch):
    """The drafter reads the prompt's token ids: embeddings alone cannot be drafted from (eagle_hf's loop failed
    on a size mismatch after the prefill)."""
    _, target, drafter = setup
    ids, _ = left_padded((7,), vocab=VOCAB)
    embeds = target.get_input_embeddings()(ids).detach()
    _refused_before_any_compute(target, drafter, monkeypatch, "inputs_embeds without input_ids", inputs_embeds=embeds)
