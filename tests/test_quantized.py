"""Targets loaded with bitsandbytes (8-bit and 4-bit, on CPU): hidden-state capture and exact greedy output."""

import pytest
import torch
from conftest import tiny_drafter, tiny_target

import eagle_hf

pytest.importorskip("bitsandbytes")


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_target(tmp_path, bits):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_target("llama", hidden_size=128, intermediate_size=256).save_pretrained(tmp_path)
    cfg = (BitsAndBytesConfig(load_in_8bit=True) if bits == 8
           else BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32))
    target = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=cfg, device_map="cpu").eval()
    assert "4bit" in type(target.model.layers[0].self_attn.q_proj).__name__ or bits == 8
    drafter = tiny_drafter(target)
    for seed in range(2):
        torch.manual_seed(seed)
        ids = torch.randint(1, 96, (1, 6))
        ref = target.generate(ids, max_new_tokens=20, do_sample=False)
        for mode in ("chain", "tree"):
            out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=drafter,
                                  num_assistant_tokens=3, draft_mode=mode, num_assistant_tokens_schedule="constant")
            assert torch.equal(out, ref), mode
            assert eagle_hf.last_stats().cycles > 0
