"""DeepSeek V3.2's indexed (sparse) attention under draft trees (eagle_hf.hf.indexed): its indexer picks each
node's top 4 keys among the keys the tree mask lets through, and keeps its own key cache, which commits, row
selection and compactions move like the main keys. The tiny family's indexer has 16 heads: with few heads its
ReLU scores are often exactly 0, and torch.topk breaks such ties differently for candidate rows of different
lengths, so transformers' own prefill and plain decoding disagree there."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_drafter, tiny_target
from test_batch import MODES, batch_oracle, left_padded, truths_of

import eagle_hf
from eagle_hf.hf import cache as tree_cache
from eagle_hf.speculation import ragged

pytestmark = pytest.mark.usefixtures("one_thread")

#: prompts longer than the indexer's top 4 (one shorter: it reads every key it sees)
LENGTHS = (6, 13, 3, 9)
NEW = 20


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_ragged_batch_of_indexed_layers_equals_plain_decoding(cache, monkeypatch):
    """Long, ragged accepted paths (an oracle tree) in a left-padded batch: nodes move in both key caches, holes
    are compacted; outputs equal plain decoding on the same cache kind, in tree and default modes."""
    monkeypatch.setattr(ragged, "MIN_HOLES_TO_COMPACT", 4)
    monkeypatch.setattr(ragged, "HOLE_FRACTION", 0.1)
    compactions = []
    regather = tree_cache.regather_cache
    monkeypatch.setattr(tree_cache, "regather_cache", lambda c, i: (compactions.append(i.shape), regather(c, i)))
    target = tiny_target("deepseek_v32")
    drafter = tiny_drafter(target)
    ids, mask = left_padded(LENGTHS)
    plain = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, cache_implementation=cache)
    ref = target.generate(ids, **plain)
    with batch_oracle(truths_of(ids, mask, ref)):
        out = target.generate(ids, assistant_model=drafter, **plain, **MODES["tree"])
    assert torch.equal(out, ref)
    assert eagle_hf.last_stats().mean_acceptance_length > 2.0 and compactions
    assert torch.equal(target.generate(ids, assistant_model=drafter, **plain), ref)


def test_indexed_layers_keep_the_tree_and_the_indexer_keys(caplog, monkeypatch):
    """Tree mode (not the chain fallback) on one row; the returned cache's indexer keys equal a plain forward's.
    Split-key attention is asked for and not taken: the indexer hides committed slots from each node."""
    from transformers import DynamicCache

    from eagle_hf.hf import attention
    from eagle_hf.hf.version import cache_kwarg, output_cache

    monkeypatch.setattr(attention, "SPLIT_KEY_FROM", {"cpu": 1, "cuda": 1})  # (from the first token, here too)
    target = tiny_target("deepseek_v32", layers=3)
    drafter = tiny_drafter(target)
    ids = torch.randint(1, 96, (1, 10), generator=torch.Generator().manual_seed(2))
    ref = target.generate(ids, max_new_tokens=24, do_sample=False)
    with batch_oracle(truths_of(ids, torch.ones_like(ids), ref)), caplog.at_level("INFO", logger="eagle_hf"):
        res = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                              return_dict_in_generate=True, **MODES["tree"])
    assert torch.equal(res.sequences, ref)
    assert eagle_hf.last_stats().mean_acceptance_length > 2.0
    assert "EAGLE generate (tree)" in caplog.text and "falling back" not in caplog.text
    cache = DynamicCache(config=target.config)
    target(ref[:, :-1].to(target.device), **cache_kwarg(cache), use_cache=True)
    for a, b in zip(output_cache(res).layers, cache.layers):
        assert type(a) is type(b) and a.indexer_keys.shape == b.indexer_keys.shape
        assert torch.allclose(a.indexer_keys, b.indexer_keys, atol=1e-5)
