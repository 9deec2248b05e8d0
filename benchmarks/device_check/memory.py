"""The memory stage: peak device memory against plain generate() at a long context, its stability over repeated
calls, and first-call against warm latency."""

from __future__ import annotations

import statistics

import torch

from .common import CHAIN, TREE, Budget, Context, StageResult, generate, out_of_memory, prompts, timed


def stage_memory(ctx: Context, budget: Budget) -> StageResult:
    """Peak device memory against plain generate() (batch 1 and 8, long context), its stability over repeated
    calls, and first-call against warm latency."""
    res = StageResult()
    s = ctx.shapes
    target, drafter = ctx.pair("bf16")
    vocab = target.config.vocab_size
    new = 32 if not ctx.small else 16
    cases = {"plain": None, "default": {}, "tree": TREE, "chain 5": CHAIN}
    if ctx.ran:
        res.find(f"first-call latency is this model's first EAGLE call in a process that already ran {ctx.ran}")
    first = None
    peaks = []
    for rows in s.memory_batches:
        ids, mask = prompts(rows, s.long_context, vocab, seed=21, device=ctx.device)
        for name, kwargs in cases.items():
            if not budget.allows(15):
                res["status"] = "partial"
                res.find(f"budget: skipped batch {rows} {name}")
                continue
            if ctx.cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(ctx.device)
                base = torch.cuda.memory_allocated(ctx.device)
            try:
                _, t = timed(ctx, generate, target, ids, mask, new, drafter if kwargs is not None else None,
                             **(kwargs or {}))
            except Exception as err:
                if not out_of_memory(err):
                    raise
                res.find(f"batch {rows} x {s.long_context} {name}: out of memory")
                continue
            if first is None and kwargs is not None:
                first = t
            row = {"batch": rows, "context": s.long_context, "mode": name, "seconds": t}
            if ctx.cuda:
                row["peak_over_weights_gib"] = (torch.cuda.max_memory_allocated(ctx.device) - base) / 2**30
            peaks.append(row)
    for row in peaks:
        plain = next((p for p in peaks if p["batch"] == row["batch"] and p["mode"] == "plain"), None)
        if ctx.cuda and plain and plain.get("peak_over_weights_gib"):
            row["x_plain"] = row["peak_over_weights_gib"] / plain["peak_over_weights_gib"]
    res["data"]["peak memory"] = peaks
    # repeated calls: the peak and what stays allocated must not grow
    ids, mask = prompts(1, s.long_context, vocab, seed=22, device=ctx.device)
    calls = []
    for i in range(s.memory_calls):
        if not budget.allows(5):
            res["status"] = "partial"
            res.find(f"budget: {i} of {s.memory_calls} repeated calls")
            break
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        _, t = timed(ctx, generate, target, ids, mask, new, drafter)
        call = {"call": i, "seconds": t}
        if ctx.cuda:
            call.update(peak_gib=torch.cuda.max_memory_allocated(ctx.device) / 2**30,
                        allocated_after_gib=torch.cuda.memory_allocated(ctx.device) / 2**30)
        calls.append(call)
    res["data"]["repeated calls"] = calls
    if ctx.cuda and len(calls) >= 3:
        grow = calls[-1]["allocated_after_gib"] - calls[1]["allocated_after_gib"]
        peak_grow = max(c["peak_gib"] for c in calls[2:]) - calls[1]["peak_gib"]
        stable = grow < 0.05 and peak_grow < 0.05
        res.find(f"over {len(calls)} calls: allocated after a call grew {grow * 1024:.0f} MiB, peak grew "
                 f"{peak_grow * 1024:.0f} MiB: {'stable' if stable else 'GROWING'}")
        if not stable:
            res["status"] = "failed"
    if not ctx.cuda:
        res.find("no CUDA device: peak memory not measured (latency only)")
    warm = statistics.median(c["seconds"] for c in calls[1:]) if len(calls) > 1 else None
    res["data"]["latency"] = {"first EAGLE call (s)": first, "warm call, median (s)": warm}
    res["summary"] = f"first call {first:.2f} s, warm {warm:.2f} s" if first and warm else "incomplete"
    if ctx.cuda and peaks:
        worst = max((p for p in peaks if "x_plain" in p), key=lambda p: p["x_plain"], default=None)
        if worst:
            res["summary"] += (f"; worst peak over plain: {worst['mode']} batch {worst['batch']} "
                               f"{worst['x_plain']:.2f}x ({worst['peak_over_weights_gib']:.2f} GiB above weights)")
    return res
