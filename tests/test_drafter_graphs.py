"""Draft levels at fixed shapes (`eagle_hf.drafter.graphs`): the forward a CUDA graph replays, run eagerly here.
The oracle is plain generate() (float32 greedy) and the eager levels (sampling: the same draws)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_drafter, tiny_target
from test_batch import MODES, left_padded
from test_copying import REPEAT

from eagle_hf.drafter import graphs
from eagle_hf.drafter.graphs import GRAPHS_ENV, FixedLevel, LevelGraphs
from eagle_hf.hf import models
from eagle_hf.speculation.drafting import DraftState

pytestmark = pytest.mark.usefixtures("one_thread")
STATIC = dict(cache_implementation="static")


@pytest.fixture
def levels_run(monkeypatch):
    """Fixed-shape levels on, counting their forwards."""
    monkeypatch.setenv(GRAPHS_ENV, "on")
    calls = []
    run = FixedLevel.run
    monkeypatch.setattr(FixedLevel, "run", lambda self, *a, **k: (calls.append(self.ids.shape), run(self, *a, **k))[1])
    return calls


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_fixed_shape_levels_keep_greedy_output(levels_run, mode, cache):
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids, mask = left_padded()
    extra = STATIC if cache == "static" else {}
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, **extra)
    for prompt, attention in ((ids, mask), (REPEAT, None)):
        want = ref if prompt is ids else target.generate(prompt, max_new_tokens=20, do_sample=False, **extra)
        out = target.generate(prompt, attention_mask=attention, max_new_tokens=20, do_sample=False,
                              assistant_model=drafter, **MODES[mode], **extra)
        assert torch.equal(out, want)
    if MODES[mode].get("num_assistant_tokens_schedule") == "constant":  # (adaptive ones may draft one level)
        assert levels_run, "no level ran at fixed shapes"


def test_fixed_shape_levels_sample_the_same_draws(monkeypatch):
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    call = dict(max_new_tokens=24, do_sample=True, temperature=1.0, assistant_model=drafter,
                **MODES["tree"])
    outs = {}
    for setting in ("off", "on"):
        monkeypatch.setenv(GRAPHS_ENV, setting)
        torch.manual_seed(7)
        outs[setting] = target.generate(REPEAT, **call)
    assert torch.equal(outs["on"], outs["off"])


def test_a_later_call_reuses_the_storage_and_its_levels(levels_run):
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    call = dict(max_new_tokens=16, do_sample=False, assistant_model=drafter, **MODES["chain"])
    target.generate(REPEAT, **call)
    kept = LevelGraphs.for_drafter(drafter)
    first = dict(kept.levels)
    target.generate(REPEAT, **call)
    assert dict(kept.levels) == first  # the same storage, so the same levels (on CUDA: the same graphs)
    assert len(kept.storage) == 1


def test_a_live_cache_keeps_its_storage():
    drafter = tiny_drafter(tiny_target("llama"))
    kept = LevelGraphs.for_drafter(drafter)
    like = torch.zeros(1)
    a, b = DraftState(graphs=kept), DraftState(graphs=kept)
    shape = (1, 2, 64, 8)
    first = kept.buffers(shape, like, a)
    assert kept.buffers(shape, like, b)[0].data_ptr() != first[0].data_ptr()  # a still holds it
    del a
    assert kept.buffers(shape, like, b)[0].data_ptr() == first[0].data_ptr()


def test_levels_are_fixed_shape_only_where_wanted(monkeypatch):
    drafter = tiny_drafter(tiny_target("llama"))
    monkeypatch.delenv(GRAPHS_ENV, raising=False)
    assert graphs.wanted(drafter, compiled=True)  # (auto: where the target's forward is compiled)
    assert not graphs.wanted(drafter, compiled=False)
    monkeypatch.setenv(GRAPHS_ENV, "on")
    assert graphs.wanted(drafter, compiled=False)
    monkeypatch.setenv(GRAPHS_ENV, "off")
    assert not graphs.wanted(drafter, compiled=True)


def test_a_compiled_shape_teaches_no_cost_while_it_warms_up():
    model = torch.nn.Linear(1, 1)
    assert [models.warming_up(model, (1, 8, 64)) for _ in range(5)] == [True] * 3 + [False] * 2
    assert models.warming_up(model, (1, 16, 64))  # a new width warms up again


def _drafter_over_prompts(rows: int, seed: int = 3):
    """A peaky drafter (some branches confident, others not) with its cache over `rows` prompts' target taps."""
    from eagle_hf.drafter.capture import gather_aux
    from eagle_hf.hf import check_compatible

    target = tiny_target("llama")
    drafter = tiny_drafter(target, seed=seed)
    drafter.bind_target_embedding(target.get_input_embeddings())
    with torch.no_grad():
        drafter.lm_head.weight.mul_(30.0)
        ids = torch.randint(1, 96, (rows, 9), generator=torch.Generator().manual_seed(seed))
        out = target(ids, output_hidden_states=True)
    aux = gather_aux(out.hidden_states, check_compatible(target, drafter))[:, :-1]  # [B, 8, A]
    return drafter, aux, ids


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("threshold,prune", [(0.0, True), (0.3, True), (0.6, True), (0.6, False), (0.9, False)])
def test_trees_grown_on_the_device_are_the_trees_grown_level_by_level(top_k, threshold, prune):
    """One read a tree (the device decides each level) against one read a level (the host decides), both at fixed
    shapes: the same trees, node for node, bit for bit; rows of different depths, and a row that drafts nothing."""
    from eagle_hf.speculation.drafting import draft_trees, top_k_choice

    drafter, aux, ids = _drafter_over_prompts(3)
    trees, levels = {}, {}
    for where in ("device", "host"):
        state = DraftState(positions=[0, 0, 0], graphs=LevelGraphs.for_drafter(drafter))
        with torch.no_grad():
            logits, hidden = state.extend(drafter, aux, ids[:, 1:])
            choosers = None if where == "device" else [lambda logits, paths: top_k_choice(drafter, logits, top_k)] * 2
            trees[where] = draft_trees(drafter, state, [int(ids[0, -1]), int(ids[2, -1])], logits, hidden, [5, 3],
                                       top_k, [12, 9], threshold, choosers, prune, rows=[0, 2])
        levels[where] = state.steps
    for got, want in zip(trees["device"], trees["host"]):
        assert got.tokens.tolist() == want.tokens.tolist()
        assert got.parents.tolist() == want.parents.tolist()
        assert got.scores.tolist() == want.scores.tolist()
    assert levels["device"] == 4 and levels["host"] <= 4  # (the device runs to the deepest row's depth)


@pytest.mark.parametrize("top_k", [1, 3])
@pytest.mark.parametrize("threshold,prune", [(0.0, True), (0.3, True), (0.6, False)])
def test_trees_laid_out_on_the_device_are_the_host_s_trees(top_k, threshold, prune):
    """The trees a greedy round lays out for the verify on the device (`tree_layout`, read with the verify's
    result) are the host's trees (`_select`): the same nodes in the same order, the drafter's greedy chain first;
    a row that drafts nothing keeps its root alone."""
    from eagle_hf.speculation.drafting import draft_trees, greedy_chain, settle_trees

    drafter, aux, ids = _drafter_over_prompts(3)
    roots, sizes = [int(ids[b, -1]) for b in range(3)], [12, 1, 9]
    trees = {}
    for where in ("device", "host"):
        state = DraftState(positions=[0, 0, 0], graphs=LevelGraphs.for_drafter(drafter))
        with torch.no_grad():
            logits, hidden = state.extend(drafter, aux, ids[:, 1:])
            layout = (16, roots, [8, 8, 8], sizes) if where == "device" else None
            trees[where] = draft_trees(drafter, state, [roots[0], roots[2]], logits, hidden, [5, 3], top_k,
                                       [sizes[0], sizes[2]], threshold, None, prune, rows=[0, 2], layout=layout)
    laid_out, positions = trees["device"]
    settled = settle_trees(laid_out, laid_out.host.flatten().tolist(), roots)
    assert settled[1].size == 1 and positions[1].tolist() == [8] * 16
    for got, want in zip([settled[0], settled[2]], trees["host"]):
        assert got.tokens.tolist() == want.tokens.tolist()
        assert got.parents.tolist() == want.parents.tolist()
        assert got.scores.tolist() == pytest.approx(want.scores.tolist())
        chain = [n for n in range(1, want.size) if greedy_chain([p for p in want.parents.tolist()[1:]])[n - 1]]
        assert chain == list(range(1, len(chain) + 1))  # the greedy chain leads


def test_the_greedy_chain_is_each_first_child_below_the_chain():
    from eagle_hf.speculation.drafting import greedy_chain

    # candidates' parents as node ids (0: the root; candidate c is node c + 1), drafted best child first
    assert greedy_chain([0, 0, 1, 1, 2, 3, 3]) == [True, False, True, False, False, True, False]
    assert greedy_chain([0, 1, 2]) == [True, True, True]  # a chain


def test_a_call_in_inference_mode_leaves_storage_a_later_call_can_write(levels_run):
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    call = dict(max_new_tokens=16, do_sample=False, assistant_model=drafter, **MODES["tree"])
    with torch.inference_mode():
        first = target.generate(REPEAT, **call)
    assert torch.equal(target.generate(REPEAT, **call), first)


def test_levels_follow_the_drafter_s_weights_and_let_it_go():
    import gc
    import weakref

    drafter = tiny_drafter(tiny_target("llama"))
    kept = LevelGraphs.for_drafter(drafter)
    assert LevelGraphs.for_drafter(drafter) is kept
    drafter.to(torch.float64)  # (new storage for every weight: captured graphs would read the old)
    assert LevelGraphs.for_drafter(drafter) is not kept
    gone = weakref.ref(drafter)
    del drafter, kept
    gc.collect()
    assert gone() is None
