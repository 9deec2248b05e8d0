"""Drafting launched as fixed-shape programs (`eagle_hf.speculation.drafting`, `eagle_hf.programs`: what a CUDA graph
replays, run eagerly here) or eagerly at the round's shapes: the same trees. The oracles are plain generate()
(float32 greedy), the eager launch (sampling: the same draws) and the host's level-by-level growth
(`reference_growth`, node for node)."""

from __future__ import annotations

import pytest
import torch
from conftest import test_device, tiny_drafter, tiny_target
from test_batch import MODES, left_padded
from test_copying import REPEAT

from eagle_hf import programs
from eagle_hf.hf import models
from eagle_hf.speculation import drafting as graphs
from eagle_hf.speculation.drafting import GRAPHS_ENV, DraftState, LevelGraphs

pytestmark = pytest.mark.usefixtures("one_thread")
STATIC = dict(cache_implementation="static")


@pytest.fixture
def levels_run(monkeypatch):
    """Fixed-shape programs on; a list whose length is the programs launched since (read it at the end)."""
    monkeypatch.setenv(GRAPHS_ENV, "on")

    class Launched(list):
        start = programs.LAUNCHES

        def __len__(self):
            return programs.LAUNCHES - self.start

    return Launched()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("launch", ["eager", "cuda graphs"])
def test_fixed_shape_levels_keep_greedy_output(levels_run, mode, cache, launch, request):
    """The programs launched eagerly, or as a GPU launches them: CUDA graphs (emulated on the CPU, `conftest`:
    two warm-ups, a capture that runs nothing, replays)."""
    if launch == "cuda graphs":
        request.getfixturevalue("graphs_on_the_cpu")
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
        assert len(levels_run), "no program ran"


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("call", ["greedy", "sampling", "processed"])
def test_bf16_programs_run_a_ragged_batch_as_a_gpu_does(levels_run, mode, call):
    """The launch a GPU takes (fixed-shape programs) in bf16, a GPU's dtype: a ragged batch drafts through the
    programs greedily, sampling, and with a logits processor and kept scores, every output in the call's dtype (a
    program's float32 buffers once leaked into a bf16 call's merge; the float32 oracle tests above cover equality:
    bf16's ties break either way)."""
    target = tiny_target("llama").to(torch.bfloat16)
    drafter = tiny_drafter(target).to(torch.bfloat16)
    ids, mask = left_padded()
    extra = {"greedy": dict(do_sample=False), "sampling": dict(do_sample=True, temperature=1.0),
             "processed": dict(do_sample=False, repetition_penalty=1.3, output_scores=True,
                               return_dict_in_generate=True)}[call]
    torch.manual_seed(0)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=12, assistant_model=drafter, **MODES[mode],
                          **extra)
    sequences = getattr(out, "sequences", out)
    assert sequences.shape[0] == ids.shape[0] and sequences.shape[1] > ids.shape[1]
    if call == "processed":
        assert all(s.dtype == torch.float32 and s.shape[0] == ids.shape[0] for s in out.scores)
    assert len(levels_run), "no program ran"


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
    first = dict(kept.programs)
    target.generate(REPEAT, **call)
    assert dict(kept.programs) == first  # the same storage, so the same programs (on CUDA: the same graphs)
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
    assert graphs.wanted(drafter, compiled=True)  # (auto: where the target's forward is compiled, and on CUDA)
    assert graphs.wanted(drafter, compiled=False) == (test_device().type == "cuda")
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
        ids = torch.randint(1, 96, (rows, 9), generator=torch.Generator().manual_seed(seed)).to(test_device())
        out = target(ids, output_hidden_states=True)
    aux = gather_aux(out.hidden_states, check_compatible(target, drafter))[:, :-1]  # [B, 8, A]
    return drafter, aux, ids


@pytest.mark.parametrize("launch", ["eager", "program", "holes", "program with holes"])
@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("threshold,prune", [(0.0, True), (0.3, True), (0.6, True), (0.6, False), (0.9, False)])
def test_device_trees_are_the_host_s_trees_node_for_node(launch, top_k, threshold, prune):
    """The trees grown and laid out on the device (`draft_trees`: eagerly at the round's shapes, as one program
    over the whole storage, each over a cache with holes) are the host's trees grown level by level
    (`reference_trees`, one read a level): the same nodes in the same order, the drafter's greedy chain first,
    scores equal; rows of different depths, and a row that drafts nothing keeps its root alone."""
    _device_trees_match_the_host_s(launch, top_k, threshold, prune, [5, 0, 3])


@pytest.mark.parametrize("launch", ["eager", "program", "holes", "program with holes"])
@pytest.mark.parametrize("top_k", [1, 4])
@pytest.mark.parametrize("threshold", [0.0, 0.3])
def test_trees_of_one_level_are_the_host_s_node_for_node(launch, top_k, threshold):
    """Trees of one level (the root's children: laid out as a prefix of the candidates, `prefix_layout`), the
    CPU default's usual depth: the host's trees, node for node."""
    _device_trees_match_the_host_s(launch, top_k, threshold, True, [1, 0, 1])


def _device_trees_match_the_host_s(launch, top_k, threshold, prune, depths):
    from reference_growth import device_trees, greedy_chain, reference_trees

    drafter, aux, ids = _drafter_over_prompts(3)
    roots, sizes = [int(ids[b, -1]) for b in range(3)], [12, 1, 9]
    counts = [8, 5, 8] if "holes" in launch else None  # row 1 reads fewer rows: holes in the drafter's cache
    trees = {}
    for where in ("device", "host"):
        graphs = LevelGraphs.for_drafter(drafter) if launch.startswith("program") else None
        state = DraftState.for_drafter(drafter, 3, graphs)
        with torch.no_grad():
            logits, hidden = state.extend(drafter, aux, ids[:, 1:], counts)
            if where == "device":
                trees[where] = device_trees(drafter, state, roots, logits, hidden, depths, top_k, sizes, threshold,
                                            prune)
            else:
                host = reference_trees(drafter, state, [roots[0], roots[2]], logits, hidden, depths[::2], top_k,
                                       [sizes[0], sizes[2]], threshold, None, prune, rows=[0, 2])
                trees[where] = [host[0], None, host[1]]
        assert state.ragged.holes == ("holes" in launch)
    assert trees["device"][1].size == 1
    for got, want in zip(trees["device"][::2], trees["host"][::2]):
        assert got.tokens.tolist() == want.tokens.tolist()
        assert got.parents.tolist() == want.parents.tolist()
        assert got.scores.tolist() == pytest.approx(want.scores.tolist())
        chain = [n for n in range(1, want.size) if greedy_chain([p for p in want.parents.tolist()[1:]])[n - 1]]
        assert chain == list(range(1, len(chain) + 1))  # the greedy chain leads


def test_the_greedy_chain_is_each_first_child_below_the_chain():
    from reference_growth import greedy_chain

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


def test_levels_follow_the_drafter_s_weights_and_setting_and_let_it_go():
    import gc
    import weakref

    drafter = tiny_drafter(tiny_target("llama"))
    kept = LevelGraphs.for_drafter(drafter)
    assert LevelGraphs.for_drafter(drafter) is kept
    drafter.to(torch.float64)  # (new storage for every weight: captured graphs would read the old)
    assert LevelGraphs.for_drafter(drafter) is not kept
    kept = LevelGraphs.for_drafter(drafter)
    drafter.config.norm_output = not drafter.config.norm_output  # (the setting its forward reads: compiled in)
    assert LevelGraphs.for_drafter(drafter) is not kept
    gone = weakref.ref(drafter)
    del drafter, kept
    gc.collect()
    assert gone() is None


def test_rows_leaving_keep_the_programs_storage_for_the_next_call():
    """A batch whose rows leave moves its drafter cache into the programs' storage kept by shape: the rows' real
    rows as they were, and a later call whose batch shrinks alike gets the same storage and its programs (no new
    capture on a GPU, nothing kept alive per call)."""
    import gc

    drafter, aux, ids = _drafter_over_prompts(3)
    graphs = LevelGraphs.for_drafter(drafter)
    seen = []
    for _ in range(2):
        state = DraftState.for_drafter(drafter, 3, graphs)
        with torch.no_grad():
            state.extend(drafter, aux, ids[:, 1:])
            before = state.kv.keys.clone()  # [3, kv_heads, 8, d]
            state.select([0, 2])
            assert torch.equal(state.kv.keys, before[[0, 2]])
            state.extend(drafter, aux[[0, 2], :2], ids[[0, 2], 1:3])  # (a round's catch-up in the programs)
        seen.append((state.keys.data_ptr(), state.programs(drafter)))
        del state
        gc.collect()
    assert seen[0][0] == seen[1][0] and seen[0][1] is seen[1][1]
