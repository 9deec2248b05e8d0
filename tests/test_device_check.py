"""scripts/device_check.py, the one command of a GPU session (docs/gpu.md), runs here on the CPU with small shapes
and leaves its report; a stage that raises is recorded and the next one runs. (The suite stage is left out: it
would run this suite again.) Its stages are the package benchmarks/device_check/, imported here (its bootstrap runs
only in the script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device_check.py"


def test_small_run_on_cpu_writes_the_report_and_greedy_equality_holds(tmp_path):
    """About a minute here: versions, float32 and bf16 equality, the sync probe, a round's profile, kernels and
    caches."""
    out = tmp_path / "report"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("EAGLE_HF_TEST_DEVICE", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--only",
                           "env,equality,sync,profile,kernels", "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    markdown = (out / "report.md").read_text()
    stages = report["stages"]
    assert list(stages) == ["env", "equality", "sync", "profile", "kernels"]
    assert all(s["status"] == "ok" for s in stages.values()), {k: s["summary"] for k, s in stages.items()}
    float32 = stages["equality"]["data"]["float32"]
    assert float32 and all(r["equal"] for r in float32)  # random drafters: rejections every round, still exact
    assert {r["mode"] for r in float32} == {"chain", "tree", "default"}
    assert any(r["case"].startswith("batch") for r in float32)
    profiled = stages["profile"]["data"]["per round"]  # plain, a tree round and one unsplit, the prefill subtracted
    assert [r["mode"] for r in profiled] == ["plain", "tree", "tree, keys unsplit"]
    assert all(r["rounds"] >= 1 for r in profiled)
    # (a time per round is the difference of two calls' times: on a loaded host it can come out at or below
    # zero, so only its presence is checked; the profiler's operators per round are there whatever the load)
    assert all(isinstance(r["wall_ms_per_round"], float) and r["top"] for r in profiled)
    # today's limits are findings, not crashes: the static cache in tree mode (issue #33)
    kernels = stages["kernels"]["data"]["runs"]
    assert any(r["case"] == "chain 5" and r["cache"] == "static" and r["runs"] for r in kernels)
    assert "## equality: ok" in markdown and "## kernels: ok" in markdown


def test_the_script_imports_only_the_standard_library_before_its_bootstrap():
    """scripts/device_check.py imports benchmarks.device_check.bootstrap before the bootstrap may put .device/site
    first on the path: that module and the package's __init__ files import nothing else."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import benchmarks.device_check.bootstrap; "
            "print(sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)"
            " - {'benchmarks', '__main__'}))")
    out = subprocess.run([sys.executable, "-S", "-c", code, str(ROOT)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_stage_that_raises_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    from benchmarks.device_check import cli
    from benchmarks.device_check.common import StageResult

    def broken(ctx, budget):
        raise RuntimeError("boom")

    def fine(ctx, budget):
        result = StageResult()
        result["summary"] = "fine"
        return result

    monkeypatch.setitem(cli.STAGE_FUNCTIONS, "env", broken)
    monkeypatch.setitem(cli.STAGE_FUNCTIONS, "quant", fine)
    assert cli.main(["--device", "cpu", "--only", "env,quant", "--out", str(tmp_path)]) == 1
    stages = json.loads((tmp_path / "report.json").read_text())["stages"]
    assert stages["env"]["status"] == "error" and "RuntimeError: boom" in stages["env"]["error"]
    assert stages["quant"]["status"] == "ok"
    # a later run of another stage keeps the earlier stages in the report
    monkeypatch.setitem(cli.STAGE_FUNCTIONS, "env", fine)
    assert cli.main(["--device", "cpu", "--only", "env", "--out", str(tmp_path)]) == 0
    stages = json.loads((tmp_path / "report.json").read_text())["stages"]
    assert stages["env"]["status"] == "ok" and stages["quant"]["status"] == "ok"


def test_homogeneity_test_separates_equal_from_different_distributions():
    torch = pytest.importorskip("torch")
    from benchmarks.device_check.sampling import chi2_sf, homogeneity

    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(16, generator=g) * 2, -1)
    a, b = torch.multinomial(p, 4000, True, generator=g), torch.multinomial(p, 4000, True, generator=g)
    assert homogeneity(a, b, 16)[2] > 1e-3
    q = p.roll(1)
    c = torch.multinomial(q, 4000, True, generator=g)
    assert homogeneity(a, c, 16)[2] < 1e-6
    # the fallback approximation of the chi-square tail is close to scipy's
    assert abs(chi2_sf(30.0, 20) - 0.0699) < 0.005


def test_verify_attention_kernels_times_every_case_on_the_cpu(tmp_path):
    """benchmarks/verify_attention_kernels.py (the one-layer bench of docs/gpu.md) runs here with a short context: every
    case either times or says why its backend refused, and the JSON holds them all."""
    out = tmp_path / "va.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "verify_attention_kernels.py"), "--device", "cpu",
                    "--contexts", "48", "--batches", "1", "--out", str(out)], check=True, capture_output=True,
                   timeout=300)
    rows = json.loads(out.read_text())["rows"]
    cases = {r["case"] for r in rows}
    assert {"plain 1 token (gqa)", "stacked auto", "gqa auto", "matmul", "stacked auto, views", "write in place",
            "cat contiguous", "cat view", "prefix unmasked", "prefix + tree", "flex"} <= cases
    assert all(r["us"] is not None or r["note"] for r in rows)
    assert all(r["us"] > 0 for r in rows if r["case"] in ("stacked auto", "matmul", "cat view", "prefix + tree"))
    # every checked attention computes the same masked attention (bf16 rounding apart): the split at the committed
    # slots, merged by log-sum-exp, included
    checked = {r["case"]: r["err"] for r in rows if "err" in r}
    assert {"stacked auto", "matmul", "prefix + tree"} <= checked.keys()
    assert all(err < 0.02 for err in checked.values()), checked


def test_the_compiled_stage_measures_chains_trees_and_the_curve_on_the_cycle_target(tmp_path):
    """The compiled stage's rehearsal (here: a static cache, uncompiled): every mode's output follows the cycle
    target's continuation, the oracle drafter's drafts are all accepted at rate 0 (tau pinned), fewer at a withheld
    rate, and the drafter's level is timed eagerly."""
    from benchmarks.device_check import cli, common

    assert cli.main(["--device", "cpu", "--small", "--only", "compiled", "--compiled-cells", "32x1",
                    "--compiled-modes", "chain 5; tree; default; tree, dynamic cache", "--compiled-rates", "0.5",
                    "--budget-s", "compiled=120", "--out", str(tmp_path)]) == 0
    stage = json.loads((tmp_path / "report.json").read_text())["stages"]["compiled"]
    rows = {(r["mode"], r["withheld_rate"]): r for r in stage["data"]["speed"]}
    assert set(rows) == {("plain", 0.0), ("chain 5", 0.0), ("tree", 0.0), ("default", 0.0), ("chain 5", 0.5),
                         ("tree", 0.5), ("default", 0.5), ("tree, dynamic cache", 0.0), ("tree, dynamic cache", 0.5)}
    assert all(r["follows_cycle"] for r in rows.values())
    new = common.SMALL.new_tokens
    assert rows[("chain 5", 0.0)]["tau"] == pytest.approx((new - 1) / 4)  # the prefill's token, then 4 rounds
    assert rows[("chain 5", 0.5)]["tau"] < rows[("chain 5", 0.0)]["tau"]
    # the steady state: the slope over two new-token counts (launches: the profiler's, on CUDA only)
    assert rows[("chain 5", 0.0)]["steady_ms_per_round"] > 0 and rows[("plain", 0.0)]["steady_ms_per_round"] > 0
    assert rows[("chain 5", 0.0)]["launches_per_round"] is None
    assert {(r["k"], r["levels"]) for r in stage["data"]["drafter level alone"]} == {(1, "eager"), (4, "eager")}


def test_a_failing_mode_costs_the_compiled_stage_that_mode_only(tmp_path, monkeypatch):
    """A mode that raises (in its warm-up or in a timed run) is recorded with its error and traceback; the other
    modes are measured and written, and the warm-ups are listed (a stage killed at its time limit keeps them)."""
    from benchmarks.device_check import cli, compiled

    original, dynamic_calls = compiled.cache_of, []

    def cache_of(mode, static):  # the second and later calls on the dynamic cache fail
        if mode.get("cache") == "dynamic":
            dynamic_calls.append(1)
            if len(dynamic_calls) >= 2:
                raise RuntimeError("boom")
        return original(mode, static)

    monkeypatch.setattr(compiled, "cache_of", cache_of)
    cli.main(["--device", "cpu", "--small", "--only", "compiled", "--compiled-cells", "32x1", "--compiled-modes",
              "chain 5; tree, dynamic cache", "--compiled-rates", "0.5", "--budget-s", "compiled=120",
              "--out", str(tmp_path)])
    stage = json.loads((tmp_path / "report.json").read_text())["stages"]["compiled"]
    rows = {(r["mode"], r["withheld_rate"]): r for r in stage["data"]["speed"]}
    assert stage["status"] == "failed"
    assert rows[("chain 5", 0.0)]["runs"] > 0 and rows[("chain 5", 0.5)]["runs"] > 0
    for case in (("tree, dynamic cache", 0.0), ("tree, dynamic cache", 0.5)):  # a timed run's, a warm-up's failure
        assert rows[case]["runs"] == 0 and rows[case]["error"] == "RuntimeError: boom"
    assert sum("RuntimeError: boom" in f for f in stage["findings"]) == 2
    assert len(stage["data"]["warm-up"]) == 4


def test_the_cycle_target_continues_its_cycle_by_a_wide_margin():
    import torch

    from benchmarks.device_check import common

    target, succ = common.cycle_target(common.SMALL.target, torch.bfloat16, torch.device("cpu"), seed=3)
    ids = torch.tensor([[5, 9, 200]])
    with torch.no_grad():
        logits = target(ids).logits[0, -1].float()
    top = logits.topk(2).values
    assert logits.argmax().item() == succ[200].item() and top[0] - top[1] > 5


def test_the_oracle_drafter_follows_the_cycle_on_every_path(monkeypatch):
    """The oracle is in the drafter's own logits: host choices, choices on the device (fixed-shape levels) and the
    catch-up all draft the continuation, and every draft is accepted."""
    import torch

    import eagle_hf
    from benchmarks.device_check import common

    s = common.SMALL
    within = common.draft_ids(s.target["vocab_size"], s.draft_vocab, seed=22)
    target, succ = common.cycle_target(s.target, torch.float32, torch.device("cpu"), seed=21, within=within)
    drafter = common.build_drafter(target, s.draft_vocab, seed=22)
    ids = torch.tensor([[5, 9, int(within[3])]])
    for levels in ("off", "on"):
        monkeypatch.setenv("EAGLE_HF_DRAFTER_GRAPHS", levels)
        for mode in (common.TREE, dict(draft_mode="chain", num_assistant_tokens=5)):
            with common.oracle_drafter(drafter, succ):
                target.generate(ids, max_new_tokens=13, do_sample=False, assistant_model=drafter, **mode)
            st = eagle_hf.last_stats()
            assert st.accepted == st.drafted == 10, (levels, mode)


def test_the_training_stage_times_a_drafter_step(tmp_path):
    """The training stage's rehearsal: one training step of the drafter alone on random features, timed at two
    sequence lengths (small shapes on the CPU; on a GPU the Llama-3.1-8B shape, with its peak memory)."""
    from benchmarks.device_check import cli

    assert cli.main(["--device", "cpu", "--small", "--only", "training", "--out", str(tmp_path)]) == 0
    stage = json.loads((tmp_path / "report.json").read_text())["stages"]["training"]
    rows = stage["data"]["training step"]
    assert [r["length"] for r in rows] == [256, 1024] and all(r["tokens_per_s"] > 0 for r in rows)
