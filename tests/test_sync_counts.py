"""What one speculation round would cost a GPU in host-device traffic, counted on the CPU by tensor provenance
(`eagle_hf.tools.sync_probe`): device-to-host reads, blocking host-to-device copies, device synchronisations. Counts
are deterministic on a constant schedule, so they are pinned here as upper bounds per round (times are not:
`scripts/sync_probe.py --time` reports them, no test asserts one)."""

from __future__ import annotations

import statistics

import pytest
import torch
from conftest import tiny_drafter, tiny_target

from eagle_hf.tools.sync_probe import SyncProbe, count_aten_ops, probe_generate

TREE = dict(draft_mode="tree", tree_depth=5, tree_top_k=4, tree_total_tokens=16, draft_sources="eagle")
#: scenario -> (rows, generate() keywords, the most reads per drafting round; the issue's targets)
SCENARIOS = {
    "tree": (1, TREE, 1),
    "tree batch of 4": (4, TREE, 1),
    "sampling tree": (1, dict(TREE, do_sample=True), 2),
    "chain of 5": (1, dict(draft_mode="chain", num_assistant_tokens=5), 1),  # (eagle_hf's loop: a tree of top-k 1)
    # (transformers' loop, for its exact-q acceptance of a sampled chain: it reads its own)
    "sampling chain of 5": (1, dict(draft_mode="chain", num_assistant_tokens=5, do_sample=True), 7),
    "copy alone": (1, dict(draft_sources="copy"), 1),
}


@pytest.fixture(scope="module")
def models():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    with torch.no_grad():
        drafter.lm_head.weight.mul_(30.0)  # peaky: trees reach their depth
    return target, drafter


def inputs(rows: int) -> dict:
    ids = torch.randint(1, 96, (rows, 12), generator=torch.Generator().manual_seed(0))
    ids[:, 6:] = ids[:, :6]  # a repeat for the copy source
    mask = torch.ones_like(ids)
    for b in range(1, rows):  # left padding of different lengths
        mask[b, : 2 * b], ids[b, : 2 * b] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_round_reads_the_device_once_per_draft_level_and_never_syncs(models, one_thread, name):
    target, drafter = models
    rows, kwargs, most_reads = SCENARIOS[name]
    run = dict(kwargs, max_new_tokens=20, num_assistant_tokens_schedule="constant")
    if kwargs.get("draft_sources") != "copy":
        run["assistant_model"] = drafter
    target.generate(**inputs(rows), **run)  # once before: what a process measures once (row costs) is done
    torch.manual_seed(0)
    probe = probe_generate(target, inputs(rows), **run)
    summary = probe.summary()
    assert "draft" in summary, summary
    draft = summary["draft"]
    assert draft["max_reads"] <= most_reads, probe.culprits()
    assert draft["max_syncs"] == 0, probe.culprits()
    # (transformers' loop copies its candidates to the device itself; the rest are asynchronous)
    assert draft["max_copies"] <= (2 if "sampling chain" in name else 0), probe.culprits()
    assert draft["max_mixed"] == 0, probe.culprits()  # nothing would mix host and device tensors on a GPU
    for kind in ("plain",):
        if kind in summary:
            assert summary[kind]["max_reads"] <= 2 and summary[kind]["max_syncs"] == 0, probe.culprits(kind)


def test_the_probe_counts_what_a_gpu_would_wait_for():
    """The probe itself: a read of a model-derived tensor, a blocking and an asynchronous copy, a bool mask."""
    layer = torch.nn.Linear(4, 4)
    probe = SyncProbe(layer)
    with probe.active():
        probe.start_round(2)
        y = layer(torch.ones(1, 4))  # a host input meets device parameters: an op the GPU would refuse...
        int(y.argmax())  # ... a read
        z = torch.tensor([1, 2], device="cpu")  # a blocking copy (data put on a device)
        torch.tensor([1, 2]).to("cpu", non_blocking=True)  # an asynchronous one
        y[y > 0]  # a boolean mask: a read
        (z + 1).tolist()  # a read of a device tensor
        torch.tensor([3]).tolist()  # a host tensor: free
    r = probe.rounds[-1]
    assert (r.reads, r.copies, r.async_copies, r.mixed) == (3, 1, 1, 1), r.where


def test_aten_ops_of_a_drafter_step_are_counted(models):
    target, drafter = models
    drafter.bind_target_embedding(target.get_input_embeddings())  # (generate() binds it; xdist may run this first)
    h, dev = drafter.config.hidden_size, drafter.device
    ops, by_op = count_aten_ops(drafter.step, torch.zeros(1, 4, h, device=dev),
                                torch.zeros(1, 4, dtype=torch.long, device=dev), torch.full((1, 4), 3, device=dev))
    assert 20 < ops < 400 and by_op


def test_a_batch_rows_add_few_operations_to_a_round(models):
    """Each row of a batch adds few device operations (kernel launches on a GPU) to a drafting round: its tree's
    ancestor masks are built in host lists and copied at once, a level's chosen children are read as one block.
    Identical rows (so every row drafts and accepts alike); per extra row about 28 operations (169 when the masks
    were written element by element)."""
    import eagle_hf

    target, drafter = models
    per_round = {}
    for rows in (1, 4):
        ids = torch.randint(1, 96, (1, 24), generator=torch.Generator().manual_seed(2)).expand(rows, -1)
        run = dict(attention_mask=torch.ones_like(ids), assistant_model=drafter, max_new_tokens=16, do_sample=False,
                   num_assistant_tokens_schedule="constant", **TREE)
        target.generate(ids, **run)  # once before: what a process measures once is done
        ops, _ = count_aten_ops(target.generate, ids, **run)
        st = eagle_hf.last_stats()
        per_round[rows] = ops / (max(r.steps for r in st.per_row) if st.per_row else st.steps)
    assert 0 <= (per_round[4] - per_round[1]) / 3 < 60, per_round


@pytest.mark.parametrize("name", ["tree", "tree batch of 4"])
def test_bytes_written_per_round_do_not_grow_with_the_context(models, name):
    """eagle_hf's own writes per drafting round outside the models' forwards (masks, cache commits, drafter
    cache writes, gathers) do not grow with the context (32 vs 480 tokens): the verify mask and the drafter's
    level masks are kept between rounds (only new slots' columns and tree blocks are written), cache commits move
    only the accepted nodes. One row's rounds write exactly the same; a batch's depend on what each row accepted
    (a mask rebuilt every round would add ~70% here)."""
    target, drafter = models
    rows, kwargs, _ = SCENARIOS[name]
    medians = []
    for context in (32, 480):
        ids = torch.randint(1, 96, (rows, context), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[1:, :3] = 0  # some left padding: holes in every cache
        torch.manual_seed(0)
        p = probe_generate(target, {"input_ids": ids, "attention_mask": mask}, count_bytes=True,
                           assistant_model=drafter, max_new_tokens=16, do_sample=False,
                           num_assistant_tokens_schedule="constant", **kwargs)
        medians.append(statistics.median(r.bytes for r in p.rounds[2:-1] if r.kind == "draft"))
    if rows == 1:
        assert medians[0] == medians[1]
    else:
        assert medians[1] < 1.2 * medians[0], medians


def _left_in_cycles(target, rows: int, run: dict) -> list[str]:
    """eagle_hf / transformers objects and tensors that one generate() call leaves to the garbage collector."""
    import gc

    target.generate(**inputs(rows), **run)  # once before: what a process keeps (row costs) exists already
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        target.generate(**inputs(rows), **run)
        gc.collect()
        return sorted({type(o).__module__ + "." + type(o).__qualname__ for o in gc.garbage
                       if isinstance(o, torch.Tensor) or type(o).__module__.startswith(("eagle_hf", "transformers"))})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was:
            gc.enable()


def _run(name: str, drafter) -> tuple[int, dict]:
    rows, kwargs, _ = SCENARIOS.get(name, (2, {}, 0))
    run = dict(kwargs, max_new_tokens=12)
    if kwargs.get("draft_sources") != "copy":
        run["assistant_model"] = drafter
    return rows, run


@pytest.mark.parametrize("name", ["tree", "tree batch of 4", "sampling tree", "chain of 5", "copy alone", "default"])
def test_generate_leaves_no_reference_cycles(models, name):
    """What a call allocated (the drafter's cache, captured hidden states, the target's cache) is freed when the
    call returns, by reference counting, not at some later garbage collection: on the GPU a cycle kept about a GiB
    per 8k-token call alive until the collector ran (device check, 2026-11-26, H200: allocated memory after a call
    moved 16.9 -> 17.9 -> 19.0 -> 16.9 GiB). Found: the copy source held a speculator's bound method."""
    target, drafter = models
    rows, run = _run(name, drafter)
    assert not _left_in_cycles(target, rows, run)


@pytest.mark.parametrize("name", ["tree", "chain of 5", "default"])
def test_an_asynchronous_device_clock_leaves_no_reference_cycles(models, monkeypatch, name):
    """On CUDA a round's timing waits in the timer until a later read-back; the last round's never gets one. The
    waiting measurement's callback holds the decoding loop (and its cache): the call closes its timers when it
    returns (finished measurements handed over, the rest dropped). Found on the H200 (2026-11-26): the target's
    8k-token cache, 1.07 GiB, stayed allocated after each call until the garbage collector ran."""
    from eagle_hf.hf import call as call_module
    from eagle_hf.speculation.rounds import Timer

    class Event:  # a device queue that has always finished: elapsed times of zero
        def record(self):
            pass

        def elapsed_time(self, other):
            return 0.0

        def query(self):
            return True

    timers = []

    def async_timer(device):
        timers.append(Timer(device, event_fn=Event))
        return timers[-1]

    monkeypatch.setattr(call_module, "Timer", async_timer)
    target, drafter = models
    rows, run = _run(name, drafter)
    assert not _left_in_cycles(target, rows, run)
    assert timers and not any(t.pending for t in timers)




@pytest.mark.parametrize("name,rows,reads", [("tree", 1, 1), ("tree batch of 4", 4, 1)])
def test_levels_at_fixed_shapes_read_the_device_once_a_tree(models, one_thread, monkeypatch, name, rows, reads):
    """With draft levels at fixed shapes (CUDA graphs on a GPU), the device takes each level's decisions and lays
    the trees out for the verify: a greedy drafting round reads the device once, the trees with the target's
    choices; a batch whose drafter cache has holes (left padding) too, in the same one program a round (the
    programs' validity buffer hides the holes: 552 operations a round when such a batch's levels ran eagerly)."""
    monkeypatch.setenv("EAGLE_HF_DRAFTER_GRAPHS", "on")
    target, drafter = models
    run = dict(TREE, max_new_tokens=20, num_assistant_tokens_schedule="constant", assistant_model=drafter)
    target.generate(**inputs(rows), **run)
    torch.manual_seed(0)
    probe = probe_generate(target, inputs(rows), count_ops=True, **run)
    draft = probe.summary()["draft"]
    assert draft["max_reads"] == reads, probe.culprits()  # (level by level it was 6, a depth-5 tree)
    assert draft["max_syncs"] == 0 and draft["max_copies"] == 0 and draft["max_mixed"] == 0, probe.culprits()
    assert draft["max_launches"] == 1 and draft["median_ops"] <= 30, probe.culprits()


#: where copies are found (the prompts repeat), every greedy round in eagle_hf's loop reads the device once (the
#: trees laid out on the device and the target's choices, after the verify), batch 1 and a ragged batch alike;
#: a sampling round twice (the trees, then the acceptance). scenario -> (rows, generate() keywords, most reads)
ONE_READ = {
    "tree with copies": (1, dict(TREE, draft_sources="eagle+copy"), 1),
    "tree with copies, batch of 4": (4, dict(TREE, draft_sources="eagle+copy"), 1),
    "chain 5": (1, dict(draft_mode="chain", num_assistant_tokens=5, draft_sources="eagle"), 1),
    "chain 5 with copies": (1, dict(draft_mode="chain", num_assistant_tokens=5, draft_sources="eagle+copy"), 1),
    "chain 5 with copies, batch of 4": (4, dict(draft_mode="chain", num_assistant_tokens=5,
                                                draft_sources="eagle+copy"), 1),
    "default, batch of 4": (4, {}, 1),
    "sampling tree with copies": (1, dict(TREE, draft_sources="eagle+copy", do_sample=True), 2),
}


@pytest.mark.parametrize("name", list(ONE_READ))
def test_every_round_reads_once_where_copies_are_found(models, one_thread, name):
    target, drafter = models
    rows, kwargs, most_reads = ONE_READ[name]
    run = dict(kwargs, max_new_tokens=24, num_assistant_tokens_schedule=kwargs.get("num_assistant_tokens_schedule",
                                                                                   "constant" if kwargs else None),
               assistant_model=drafter)
    run = {k: v for k, v in run.items() if v is not None}
    target.generate(**inputs(rows), **run)
    torch.manual_seed(0)
    probe = probe_generate(target, inputs(rows), **run)
    rounds = probe.rounds[2:-1]  # (before the first round, the prefill; the last holds the loop's wrap-up)
    assert rounds and max(r.reads for r in rounds) <= most_reads, probe.culprits()
    assert any(r.width > 1 for r in rounds)  # (drafts were verified)
