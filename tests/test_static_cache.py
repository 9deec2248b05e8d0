"""Tree mode on transformers' static cache (`cache_implementation="static"`): the tree-cache protocol over fixed
buffers (eagle_hf.hf.cache.StaticTreeCache). The oracle is plain generate() on the same cache."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_drafter, tiny_target, tree_attention_mask
from test_batch import LENGTHS, MODES, NEW, batch_oracle, left_padded, truths_of
from test_copying import REPEAT
from transformers import CompileConfig, DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer

import eagle_hf
from eagle_hf import programs
from eagle_hf.hf import cache as tree_cache
from eagle_hf.hf import tree_loop
from eagle_hf.hf.cache import VERIFY_BUCKETS, StaticTreeCache, cache_unsupported_reason
from eagle_hf.hf.costs import cost_model
from eagle_hf.hf.routing import STATIC_CACHE_ROOM
from eagle_hf.hf.version import cache_kwarg, output_cache
from eagle_hf.speculation import copying, ragged, speculator

pytestmark = pytest.mark.usefixtures("one_thread")
STATIC = dict(cache_implementation="static")


def test_default_mode_runs_on_a_static_cache(caplog, monkeypatch):
    cuts = []  # copy branches the plan cut to a static cache's free slots (`cut_branches`)

    def cut_branches(branches, nodes):
        kept = copying.cut_branches(branches, nodes)
        if kept != branches:
            cuts.append(nodes)
        return kept

    monkeypatch.setattr(speculator, "cut_branches", cut_branches)
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ref = target.generate(REPEAT, max_new_tokens=40, do_sample=False)
    assert torch.equal(target.generate(REPEAT, max_new_tokens=40, do_sample=False, **STATIC), ref)
    with caplog.at_level("INFO", logger="eagle_hf"):
        out = target.generate(REPEAT, max_new_tokens=40, do_sample=False, assistant_model=drafter, **STATIC,
                              return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        assert "EAGLE generate (tree)" in caplog.text and "falling back" not in caplog.text
    # the cache generate() built has room for one more verify forward of the widest bucket after the output
    assert output_cache(out).layers[0].max_cache_len == ref.shape[1] - 1 + STATIC_CACHE_ROOM
    assert not cuts
    exact = StaticCache(config=target.config, max_cache_len=ref.shape[1] - 1)  # a cache passed in: no room
    out = target.generate(REPEAT, max_new_tokens=40, do_sample=False, draft_sources="copy", **cache_kwarg(exact))
    assert torch.equal(out, ref)
    s = eagle_hf.last_stats()
    assert s.accepted_by_source["copy"] > 10 and s.cycles > 0
    out = target.generate(REPEAT, max_new_tokens=40, do_sample=False, assistant_model=drafter,
                          num_assistant_tokens_schedule="constant",
                          **cache_kwarg(StaticCache(config=target.config, max_cache_len=ref.shape[1] - 1)))
    assert torch.equal(out, ref)
    assert cuts  # near the end, the copy branches beside the drafter's tree were cut to the free slots


def test_a_chain_on_a_static_cache_runs_in_eagle_hfs_loop(caplog):
    """transformers 5.23's assisted loop refuses static caches: a chain on one runs in eagle_hf's loop (a tree with
    top_k 1) on every version, equal to plain generate() on the same cache."""
    target = tiny_target("llama")
    ref = target.generate(REPEAT, max_new_tokens=30, do_sample=False, **STATIC)
    with caplog.at_level("INFO", logger="eagle_hf"):
        out = target.generate(REPEAT, max_new_tokens=30, do_sample=False, assistant_model=tiny_drafter(target),
                              num_assistant_tokens=5, **STATIC)
    assert torch.equal(out, ref)
    assert "A static cache: eagle_hf's loop drafts the chain" in caplog.text and "EAGLE generate (tree)" in caplog.text


def test_a_ragged_batch_on_a_static_cache_equals_the_plain_batch(monkeypatch):
    """Long, ragged accepted paths in a left-padded batch: commits move nodes inside the fixed buffers, holes are
    compacted in place (also when the next tree would not fit), trees are cut to the free slots near the end; the
    kept verify mask spans the whole buffer and equals one built from scratch up to the tree, hidden after."""
    monkeypatch.setattr(ragged, "MIN_HOLES_TO_COMPACT", 4)
    monkeypatch.setattr(ragged, "HOLE_FRACTION", 0.1)
    masks, compactions = [], []
    tree_mask = StaticTreeCache.tree_mask

    def checked(self, tree, dtype):
        kept = tree_mask(self, tree, dtype)
        end = self.length + tree.shape[1]
        assert kept.shape[-1] == self.capacity
        assert torch.equal(kept[..., :end], tree_attention_mask(tree, self.ragged.valid, self.length, dtype))
        assert bool((kept[..., end:] == torch.finfo(dtype).min).all())
        masks.append(end)
        return kept

    monkeypatch.setattr(StaticTreeCache, "tree_mask", checked)
    regather = tree_cache.regather_cache
    monkeypatch.setattr(tree_cache, "regather_cache", lambda c, i: (compactions.append(i.shape), regather(c, i)))
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids, mask = left_padded()
    plain = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    ref = target.generate(ids, **plain, **STATIC)
    assert torch.equal(ref, target.generate(ids, **plain))
    with batch_oracle(truths_of(ids, mask, ref)):
        out = target.generate(ids, assistant_model=drafter, **plain, **STATIC, **MODES["tree"])
    assert torch.equal(out, ref)
    stats = eagle_hf.last_stats()
    assert stats.mean_acceptance_length > 2.0 and stats.new_tokens == len(LENGTHS) * NEW, stats.summary()
    assert masks and compactions
    out = target.generate(ids, assistant_model=drafter, **plain, **STATIC, **MODES["eagle+copy"])
    assert torch.equal(out, ref)


@pytest.mark.parametrize("mode", ["tree", "eagle+copy"])
def test_commits_captured_as_cuda_graphs_move_each_node_once(graphs_on_the_cpu, mode):
    """On a GPU a static cache's commit is a CUDA graph, captured at its first launch after two warm-ups. Moving
    nodes in place is not repeatable (run three times, a kept node's keys come from a slot already overwritten):
    the warm-ups move nothing, and the output is the plain batch's."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids, mask = left_padded()
    plain = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    ref = target.generate(ids, **plain, **STATIC)
    with batch_oracle(truths_of(ids, mask, ref)):  # (long, ragged accepted paths: nodes move)
        out = target.generate(ids, assistant_model=drafter, **plain, **STATIC, **MODES[mode])
    assert torch.equal(out, ref)
    assert any(p.name == "cache commit" for p in graphs_on_the_cpu)


def test_commit_programs_serve_the_next_call_without_holding_its_buffers(monkeypatch):
    """transformers makes a static cache a call, with new buffers of the same shapes: the commit programs of one call
    (eager or compiled: their launches take the buffers) serve the next call's cache, and between calls hold none
    of the call's buffers."""
    monkeypatch.setattr(tree_cache, "_KEPT_COMMITS", type(tree_cache._KEPT_COMMITS)())
    made = []
    init = tree_cache.CommitProgram.__init__
    monkeypatch.setattr(tree_cache.CommitProgram, "__init__", lambda self, *a: (made.append(self), init(self, *a))[1])
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids, mask = left_padded()
    plain = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    ref = target.generate(ids, **plain, **STATIC)
    for call in range(2):
        with batch_oracle(truths_of(ids, mask, ref)):  # (long, ragged accepted paths: nodes move)
            out = target.generate(ids, assistant_model=drafter, **plain, **STATIC, **MODES["tree"])
        assert torch.equal(out, ref)
        kept = list(tree_cache._KEPT_COMMITS.values())
        assert kept and not any(program.bound for program in kept)
        if call == 0:
            first = list(made)
    assert made == first  # (the second call made none)


@pytest.mark.parametrize("new", [14, 15, 21, 22])
@pytest.mark.parametrize("spare", [0, -1])
def test_a_commit_stays_inside_a_static_cache_passed_in(new, spare):
    """A static cache passed in with no room to spare: a commit's fixed shape (a power of two of slots at least the
    kept nodes) reaches past the cache's end, where it touches nothing (it once read and wrote there: an index
    error on the CPU, a device assert on a GPU)."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids = torch.randint(1, 96, (1, 10), generator=torch.Generator().manual_seed(0))
    ref = target.generate(ids, max_new_tokens=new, do_sample=False)
    cache = StaticCache(config=target.config, max_cache_len=ids.shape[1] + new + spare)
    with batch_oracle([ref[0].tolist()]):
        out = target.generate(ids, past_key_values=cache, max_new_tokens=new, do_sample=False,
                              assistant_model=drafter, draft_mode="tree", tree_depth=6, tree_top_k=2,
                              tree_total_tokens=8, num_assistant_tokens_schedule="constant")
    assert torch.equal(out, ref)


def test_a_cache_that_cannot_hold_trees_falls_back_to_chain_mode(caplog):
    class Layer(DynamicLayer):  # some other kind of cache layer
        pass

    assert cache_unsupported_reason(implementation="quantized")
    assert cache_unsupported_reason(implementation="static") is None
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ref = target.generate(REPEAT, max_new_tokens=12, do_sample=False)
    cache = DynamicCache(config=target.config)
    cache.layers = [Layer() for _ in cache.layers]
    with caplog.at_level("WARNING", logger="eagle_hf"):
        out = target.generate(REPEAT, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                              draft_mode="tree", **cache_kwarg(cache))
    assert torch.equal(out, ref)
    assert "falling back to chain" in caplog.text and "Layer layers" in caplog.text


def test_a_compiled_forward_verifies_trees_in_a_few_shapes():
    """transformers' automatic compile (a static cache; here forced on the CPU): the verify forwards run the
    compiled forward on widths padded to a few buckets, so it compiles once per bucket, not once per tree size,
    each graph specialised to its width; output equal to plain compiled decoding."""
    import torch._dynamo

    target = tiny_target("llama", layers=2)
    drafter = tiny_drafter(target)
    config = CompileConfig()
    config._compile_all_devices = True  # (transformers compiles on accelerators only unless told)
    call = dict(max_new_tokens=30, do_sample=False, compile_config=config, **STATIC)
    ref = target.generate(REPEAT, **call)
    assert torch.equal(ref, target.generate(REPEAT, max_new_tokens=30, do_sample=False))
    graphs, programs_made = torch._dynamo.utils.counters["stats"]["unique_graphs"], programs.GRAPHS
    widths = []
    forward = tree_loop.TreeLoop.verify_width
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tree_loop.TreeLoop, "verify_width", lambda self, n: (widths.append(w := forward(self, n)), w)[1])
        for _ in range(2):
            out = target.generate(REPEAT, assistant_model=drafter, tree_total_tokens=12, **call)
            assert torch.equal(out, ref)
    assert set(widths) <= set(VERIFY_BUCKETS) and len(set(widths)) >= 2
    # the compiled forward's costs are kept apart, and a round that compiled a shape taught none (a compile takes
    # seconds; a forward of this model, milliseconds)
    compiled_costs = cost_model(target, drafter, compiled=True)
    assert compiled_costs.observed and not cost_model(target, drafter).observed
    assert max(compiled_costs.as_dict()["seconds"].values()) < 0.5
    # one graph per width, specialised as a plain step's is (automatic dynamic shapes would have run every width
    # after the second through one dynamic-shape graph: 2 graphs here with eagle_hf.hf.models.STATIC_WIDTHS off), and
    # one per program the loop compiled (`eagle_hf.programs`: the drafter's catch-up per width, its levels, the
    # cache commit per width), each whole
    made = programs.GRAPHS - programs_made
    assert made > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == len(set(widths)) + made
