"""The sync stage: host-device synchronisations per round (CUDA's sync debug mode) against the CPU probe's prediction
(eagle_hf.tools.sync_probe), and a profiler trace of about five tree rounds with the device-busy fraction."""

from __future__ import annotations

import importlib.util
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

from .common import CHAIN, TREE, Budget, Context, StageResult, generate, last_stats, loop_rounds, prompts, save_trace


def stage_sync(ctx: Context, budget: Budget) -> StageResult:
    """Host-device synchronisations per round (CUDA's sync debug mode) against the CPU probe's prediction
    (eagle_hf.tools.sync_probe, where present), and a short profiler trace."""
    res = StageResult()
    target, drafter = ctx.pair("bf16")
    vocab = target.config.vocab_size
    new = 16 if ctx.small else 32
    cases = {"chain 5 (transformers' loop)": (1, CHAIN), "tree": (1, TREE), "default": (1, {}),
             "batch of 4, tree": (4, TREE)}
    probe = _sync_probe()
    table = []
    for name, (rows, kwargs) in cases.items():
        if not budget.allows(10):
            res.find(f"budget: skipped {name}")
            res["status"] = "partial"
            continue
        ids, mask = prompts(rows, 64 if ctx.small else 512, vocab, seed=11, device=ctx.device, repeat=True)
        generate(target, ids, mask, new, drafter, **kwargs)  # warm-up: one-time cost measurements are not rounds
        row = {"case": name}
        if ctx.cuda:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    generate(target, ids, mask, new, drafter, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
            st = last_stats()
            rounds = loop_rounds(st) + 1  # the prefill is a round too
            where = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
            row.update(rounds=rounds, cycles=st.cycles, syncs=len(syncs), syncs_per_round=len(syncs) / rounds,
                       top_sites="; ".join(f"{k} x{v}" for k, v in where.most_common(6)))
        if probe is not None:
            row.update(_probe_counts(probe, target, ids, mask, new, drafter, kwargs))
        table.append(row)
    res["data"]["syncs per round"] = table
    if not ctx.cuda:
        res.find("no CUDA device: the sync debug mode and the profiler trace need one (skipped)")
    if probe is None:
        res.find("eagle_hf.tools.sync_probe is not importable: no CPU prediction")
    if ctx.cuda and budget.allows(20):
        res["data"]["profile"] = _profile(ctx, target, drafter, vocab)
        res.find("trace.json.gz: a chrome trace of about five tree rounds (open in ui.perfetto.dev)")
    res["summary"] = "; ".join(f"{r['case']}: " + ", ".join(f"{k} {r[k]:.1f}" for k in r if k.endswith("per_round"))
                               for r in table)
    return res


def _sync_probe():
    if importlib.util.find_spec("eagle_hf.tools.sync_probe") is None:
        return None
    import eagle_hf.tools.sync_probe as probe

    return probe


def _probe_counts(probe, target, ids, mask, new, drafter, kwargs) -> dict:
    """The CPU probe's prediction for the same call: device-to-host reads, blocking copies and syncs per round.
    Its API (eagle_hf/tools/sync_probe.py, being written alongside this script): probe_generate(target, inputs,
    **generate_kwargs) -> SyncProbe with summary() per round kind and culprits(kind)."""
    # TODO(sync_probe): keep in step with eagle_hf.tools.sync_probe's API while it settles; anything else is recorded
    if not hasattr(probe, "probe_generate"):
        return {"probe": f"unknown API: {sorted(n for n in dir(probe) if not n.startswith('_'))}"}
    try:
        p = probe.probe_generate(target, {"input_ids": ids, "attention_mask": mask}, assistant_model=drafter,
                                 max_new_tokens=new, do_sample=False, **kwargs)
        summary = p.summary()
        rounds = sum(v.get("rounds", 0) for v in summary.values())
        total = {what: sum(getattr(r, what, 0) for r in p.rounds) for what in ("reads", "copies", "syncs")}
        out = {"probe_rounds": rounds, **{f"probe_{k}_per_round": v / max(rounds, 1) for k, v in total.items()}}
        draft = summary.get("draft")
        if draft:
            out["probe_draft_round"] = ", ".join(f"{k} {v}" for k, v in draft.items() if k.startswith("max"))
        return out
    except Exception as err:  # noqa: BLE001 - the probe is optional
        return {"probe": f"failed: {type(err).__name__}: {err}"[:300]}


def _profile(ctx, target, drafter, vocab) -> dict:
    """About five tree rounds under torch.profiler; the trace is written to trace.json.gz."""
    from torch.profiler import ProfilerActivity, profile

    ids, mask = prompts(1, 512, vocab, seed=12, device=ctx.device)
    generate(target, ids, mask, 6, drafter, **TREE)
    ctx.sync()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate(target, ids, mask, 6, drafter, **TREE)  # a random drafter: about one token per round
        ctx.sync()
    wall = time.perf_counter() - start
    save_trace(prof, ctx.out / "trace.json.gz")
    events = prof.key_averages()
    on_device = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]  # kernels, memcpys
    device_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in on_device)
    kernels = sum(e.count for e in on_device)
    return {"wall_s (profiled)": wall, "device_busy_s": device_us / 1e6, "device_busy_fraction": device_us / 1e6 / wall,
            "rounds": loop_rounds(last_stats()) + 1, "kernel_launches": kernels}
