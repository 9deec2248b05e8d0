"""Tree verification on every attention kernel (eagle_hf.hf.attention).

Flash-attention is not installable on this CPU machine; a stand-in kernel registered through transformers'
attention interface behaves like it where it matters: it takes a 2D padding mask or none and refuses a 4D mask.
A target pointed at it must keep tree, copy and batch drafting, with output equal to plain generate() on the same
kernel, and the user's setting unchanged.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_drafter, tiny_target
from test_batch import left_padded
from test_copying import REPEAT
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import eagle_hf
from eagle_hf.hf import attention

pytestmark = pytest.mark.usefixtures("one_thread")

KERNEL = "eagle_hf_test_2d_mask_kernel"  # (a name with "flash" in it would send transformers to import a flash package)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x.repeat_interleave(groups, dim=1)  # [B, Hkv, L, D] -> [B, Hkv*G, L, D], head h reads K/V head h // G


def flash_like(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention (bottom-right aligned, as flash-attention's) over a 2D padding mask or none; a 4D mask is
    what a flash kernel cannot read: refused."""
    assert attention_mask is None or attention_mask.dim() == 2, f"a flash kernel got a {attention_mask.dim()}D mask"
    assert attention.TREE_VERIFY not in kwargs
    n, length = query.shape[2], key.shape[2]
    mask = torch.ones(n, length, dtype=torch.bool, device=query.device).tril(length - n)[None, None]  # [1, 1, N, L]
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, -length:].bool()
        own = torch.ones(n, length, dtype=torch.bool, device=query.device)
        mask = mask | own.tril(length - n).triu(length - n)  # each query sees its own slot (padding too)
    groups = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(query, _repeat_kv(key, groups), _repeat_kv(value, groups), attn_mask=mask,
                                         scale=scaling)
    return out.transpose(1, 2).contiguous(), None


@pytest.fixture
def flash_like_kernel():
    AttentionInterface.register(KERNEL, flash_like)
    AttentionMaskInterface.register(KERNEL, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    yield KERNEL
    attention.unroute_all()
    for interface in (AttentionInterface, AttentionMaskInterface):
        interface._global_mapping.pop(KERNEL, None)


def test_tree_attention_equals_attention_with_repeated_kv():
    torch.manual_seed(0)
    b, heads, kv_heads, n, length, d = 2, 8, 2, 5, 13, 16
    q, k, v = torch.randn(b, heads, n, d), torch.randn(b, kv_heads, length, d), torch.randn(b, kv_heads, length, d)
    allowed = torch.rand(b, 1, n, length) < 0.7
    allowed[..., -n:] |= torch.eye(n, dtype=torch.bool)  # every node sees itself
    mask = torch.zeros(b, 1, n, length).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    out, weights = attention.tree_attention(None, q, k, v, mask, scaling=0.3)
    expected = F.scaled_dot_product_attention(q, _repeat_kv(k, 4), _repeat_kv(v, 4), attn_mask=mask, scale=0.3)
    assert weights is None and out.shape == (b, n, heads, d)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-5, atol=1e-6)
    again, _ = attention.tree_attention(None, q, k, v, mask, scaling=0.3)  # the tiling memo: same mask, same result
    torch.testing.assert_close(again, out)


def test_a_flash_like_target_keeps_tree_copy_and_batch_drafting(flash_like_kernel, caplog):
    target = tiny_target("llama")
    target.set_attn_implementation(flash_like_kernel)
    drafter = tiny_drafter(target)
    ref = target.generate(REPEAT, max_new_tokens=40, do_sample=False)
    with caplog.at_level("INFO", logger="eagle_hf"):
        out = target.generate(REPEAT, max_new_tokens=40, do_sample=False, assistant_model=drafter,
                              num_assistant_tokens_schedule="constant")
    assert torch.equal(out, ref)
    assert "falling back" not in caplog.text and "not possible" not in caplog.text
    s = eagle_hf.last_stats()
    assert s.drafted_by_source["copy"] > 0 and s.accepted_by_source["copy"] > 0 and s.cycles > 0
    assert target.config._attn_implementation == flash_like_kernel  # the user's setting is untouched
    # plain forwards still reach the kernel itself: plain generate() after routing is what it was before
    assert torch.equal(target.generate(REPEAT, max_new_tokens=40, do_sample=False), ref)

    ids, mask = left_padded((3, 9, 5))
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    batched = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, assistant_model=drafter,
                              draft_mode="tree", tree_top_k=2)
    assert torch.equal(batched, plain)
    assert eagle_hf.last_stats().cycles > 0


def test_sdpa_verification_never_repeats_kv(monkeypatch):
    """transformers' sdpa function repeats K/V under a 4D mask (grouped-query attention): a verify forward never
    reaches it; eagle_hf's tree attention runs instead, with one mask tiling per forward."""
    seen, tiled = [], []
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    kernel = attention._ROUTED["sdpa"][1] if attention._ROUTED.get("sdpa", (None,))[0] is sdpa else sdpa

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(None if attention_mask is None else attention_mask.dim())
        return kernel(module, query, key, value, attention_mask, **kwargs)

    repeat = torch.Tensor.repeat
    monkeypatch.setattr(torch.Tensor, "repeat", lambda self, *a: (tiled.append(a), repeat(self, *a))[1])
    AttentionInterface.register("sdpa", spy)
    try:
        target = tiny_target("llama")  # 4 query heads over 2 K/V heads
        drafter = tiny_drafter(target)
        ref = target.generate(REPEAT, max_new_tokens=24, do_sample=False)
        tiled.clear()
        out = target.generate(REPEAT, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                              draft_mode="tree", num_assistant_tokens_schedule="constant")
    finally:
        AttentionInterface.register("sdpa", kernel)
    assert torch.equal(out, ref)
    assert 4 not in seen and seen  # plain forwards reached the kernel, verify forwards did not
    rounds = eagle_hf.last_stats().cycles
    assert rounds > 0 and sum(a == (1, 1, 2, 1) for a in tiled) == rounds  # one tiling per verify forward


def test_routing_is_per_call_and_undone_by_unroute(flash_like_kernel):
    target = tiny_target("llama")
    target.set_attn_implementation(flash_like_kernel)
    assert attention.routed_kernel(target) == {attention.TREE_VERIFY: True}
    assert ALL_ATTENTION_FUNCTIONS[flash_like_kernel] is not flash_like
    with pytest.raises(AssertionError, match="4D mask"):  # without the keyword, the kernel itself runs
        target(REPEAT.to(target.device),
               attention_mask=torch.zeros(1, 1, REPEAT.shape[1], REPEAT.shape[1], device=target.device))
    attention.unroute_all()
    assert ALL_ATTENTION_FUNCTIONS[flash_like_kernel] is flash_like
    eager = tiny_target("llama", attn_implementation="eager")
    assert attention.routed_kernel(eager) == {}  # eager attention reads the tree mask itself


@pytest.mark.parametrize("prefix,chunk", [(37, 8), (64, 16), (5, 512)])
def test_split_key_attention_is_the_masked_attention(prefix, chunk, monkeypatch):
    """Split at the committed prefix (its chunks as heads of one unmasked call, the rest under the mask, merged by
    log-sum-exps): the masked attention, against a float32 reference by matmuls."""
    from eagle_hf.hf import attention

    monkeypatch.setattr(attention, "SPLIT_KEYS", chunk)
    g = torch.Generator().manual_seed(prefix)
    b, kv, groups, n, d = 2, 2, 3, 5, 16
    query = torch.randn(b, kv, groups * n, d, generator=g)
    key, value = torch.randn(b, kv, prefix + n, d, generator=g), torch.randn(b, kv, prefix + n, d, generator=g)
    tree = torch.rand(b, n, n, generator=g) < 0.5
    tree |= torch.eye(n, dtype=torch.bool)
    allowed = torch.cat([torch.ones(b, n, prefix, dtype=torch.bool), tree], 2)  # [B, N, L]
    mask = torch.zeros(b, 1, n, prefix + n).masked_fill(~allowed[:, None], float("-inf")).repeat(1, 1, groups, 1)
    got = attention.split_key_attention(query, key, value, mask, prefix, d**-0.5)
    scores = query.double() @ key.double().transpose(-1, -2) * d**-0.5 + mask.double()
    want = scores.softmax(-1) @ value.double()
    assert (got.double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("mode", [dict(draft_mode="tree", num_assistant_tokens_schedule="constant"), {}])
def test_verify_forwards_with_split_keys_keep_greedy_output(monkeypatch, mode):
    from eagle_hf.hf import attention

    monkeypatch.setattr(attention, "SPLIT_KEYS", 4)  # (several chunks over a short prompt)
    monkeypatch.setattr(attention, "SPLIT_KEY_FROM", {"cpu": 1, "cuda": 1})  # (from the first token, here too)
    calls = []
    split = attention.split_key_attention
    monkeypatch.setattr(attention, "split_key_attention", lambda *a, **k: (calls.append(a[4]), split(*a, **k))[1])
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids = torch.randint(1, 96, (1, 30), generator=torch.Generator().manual_seed(4))
    ref = target.generate(ids, max_new_tokens=24, do_sample=False)
    out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter, **mode)
    assert torch.equal(out, ref)
    assert calls and min(calls) >= 30  # (the committed prefix: the prompt and what was accepted)


def test_the_text_configuration_is_read_once_per_configuration_object():
    """`text_config` keeps each configuration's text configuration (transformers' attribute reads are slow): a
    change to it is seen (the same object), a new configuration object is read anew."""
    from eagle_hf.hf.models import text_config

    target = tiny_target("llama")
    assert text_config(target) is target.config.get_text_config()
    target.config._attn_implementation = "eager"
    assert attention.kernel_name(target) == "eager"
    target.config = type(target.config).from_dict(target.config.to_dict())
    assert text_config(target) is target.config
