"""generate() arguments that pass through eagle_hf's own loop: stop strings with their tokenizer, and a clear
refusal of what speculation cannot serve (no cache). The oracle is plain generate() (float32 greedy)."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, tiny_drafter, tiny_target
from test_batch import left_padded

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
