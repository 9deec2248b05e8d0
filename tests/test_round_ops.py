"""What a round launches around the target's forward on the compiled path's code (a static cache, fixed-shape
drafting), counted on the CPU (`scripts/round_ops.py`: device operations outside the target's forward and outside
the programs' bodies, program launches, blocking reads). On a GPU each operation is about one kernel launch and each
program one CUDA graph replay; counts are deterministic, so they are pinned here as upper bounds per round."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from eagle_hf import programs

_SPEC = importlib.util.spec_from_file_location("round_ops", Path(__file__).resolve().parent.parent / "scripts"
                                               / "round_ops.py")
round_ops = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(round_ops)

#: scenario -> (the most operations, launches, reads in a round); before the round's programs a chain-5 round took
#: 195 operations, 5 launches and 2 reads, a depth-5 tree's 358 (the cache commit alone moved keys and values layer
#: by layer: 161)
MOST = {
    "chain 5": (15, 1, 1),
    "tree, depth 5": (20, 1, 1),
    "default, resting": (10, 1, 1),
}


@pytest.fixture(scope="module")
def pair():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLE_HF_DRAFTER_GRAPHS", "on")  # fixed-shape drafting, as on the compiled path
        mp.setenv("EAGLE_HF_COST_CACHE", "off")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield round_ops.pair()
        finally:
            torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def counts(pair):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLE_HF_DRAFTER_GRAPHS", "on")
        mp.setenv("EAGLE_HF_COST_CACHE", "off")
        return {name: round_ops.count(name, *pair) for name in round_ops.SCENARIOS}


@pytest.mark.parametrize("name", list(MOST))
def test_a_round_launches_few_operations_around_the_programs(counts, name):
    row = counts[name]
    ops, launches, reads = MOST[name]
    assert row["rounds"] >= 3, row
    assert row["ops"] <= ops, row["culprits"]
    assert row["launches"] <= launches and row["reads"] <= reads, row


def test_a_batch_adds_few_operations_to_a_round(counts):
    """Rows are a dimension of every fixed shape: a batch of 4 runs the same programs, a few more copies."""
    assert counts["chain 5, batch of 4"]["ops"] - counts["chain 5"]["ops"] <= 10, counts
    assert counts["chain 5, batch of 4"]["launches"] == counts["chain 5"]["launches"]


def test_the_programs_read_nothing_on_the_host(pair):
    """The programs' bodies read no device value on the host (a read would stop a CUDA graph's capture): the
    round's one read is outside them, after the verify."""
    for name in ("chain 5", "tree, depth 5"):
        row = round_ops.count(name, *pair)
        assert not [w for w, _ in row["reads_where"] if "in a program" in w], row["reads_where"]


def test_the_programs_compile_whole(monkeypatch):
    """The draft programs and the cache commit read no host value and take no data-dependent shape: torch.compile
    takes each as one graph (``fullgraph=True``; a graph break would raise, and the program would fall back to
    running eagerly with a warning), and the compiled programs give the eager programs' output."""
    import logging

    from conftest import tiny_drafter, tiny_target
    from test_copying import REPEAT

    monkeypatch.setenv("EAGLE_HF_DRAFTER_GRAPHS", "on")
    target = tiny_target("llama", layers=2)
    drafter = tiny_drafter(target)
    with torch.no_grad():
        drafter.lm_head.weight.mul_(30.0)  # peaky: trees reach their depth
    run = dict(max_new_tokens=16, do_sample=False, cache_implementation="static", assistant_model=drafter,
               draft_mode="tree", tree_depth=3, tree_top_k=2, tree_total_tokens=6, draft_sources="eagle",
               num_assistant_tokens_schedule="constant")
    eager = target.generate(REPEAT, **run)
    made = programs.CAPTURES
    monkeypatch.setattr(programs, "how_to_run", lambda device, compiled: "compile")
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("eagle_hf").addHandler(handler)
    try:
        from eagle_hf.hf import call, tree_loop

        monkeypatch.setattr(call, "how_to_run", programs.how_to_run)
        monkeypatch.setattr(tree_loop, "how_to_run", programs.how_to_run)
        compiled = target.generate(REPEAT, **run)
    finally:
        logging.getLogger("eagle_hf").removeHandler(handler)
    assert not [w for w in warnings if "could not be compiled" in w], warnings
    assert programs.CAPTURES - made >= 3  # the drafting (the prompt's catch-up and a round's), a commit
    assert torch.equal(compiled, eager)
