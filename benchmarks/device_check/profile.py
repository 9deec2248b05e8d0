"""The profile stage: where a round's time goes. Plain decoding and a tree round under torch.profiler per
CONTEXTxBATCH cell, the prefill and the drafter's catch-up subtracted: wall and device milliseconds per round, kernel
launches and the kernels (on a CPU: the operators) that take the most."""

from __future__ import annotations

import time

from .common import (
    TREE,
    Budget,
    Context,
    StageResult,
    draft_levels,
    generate,
    last_stats,
    loop_rounds,
    parse_cells,
    prompts,
    save_trace,
    timed,
)


def stage_profile(ctx: Context, budget: Budget) -> StageResult:
    """Where a round's time goes: plain decoding and a tree round (a random drafter, so about one token a round)
    under torch.profiler at each CONTEXTxBATCH cell, the prefill and catch-up subtracted (a shorter call beside it):
    wall and device time per round and the kernels (CPU: the operators) that take it."""
    res = StageResult()
    target, drafter = ctx.pair("bf16")
    vocab = target.config.vocab_size
    spec = ctx.args.profile_cells or ("64x1" if ctx.small else "512x1")
    cells = parse_cells(spec)
    table, last_cell = [], 0.0
    for ctx_len, rows in cells:
        if not budget.allows(last_cell * 1.2 + 5):
            res.find(f"budget: skipped context {ctx_len} x batch {rows}")
            res["status"] = "partial"
            continue
        start = time.perf_counter()
        ids, mask = prompts(rows, ctx_len, vocab, seed=13, device=ctx.device)
        for mode, kwargs in (("plain", None), ("tree", TREE), ("tree, keys unsplit", dict(TREE, split_keys="off"))):
            with draft_levels(kwargs or {}) as call:
                table.append(_profile_round(ctx, target, drafter if kwargs else None, ids, mask, call,
                                            f"{ctx_len}x{rows}", mode))
        last_cell = time.perf_counter() - start
        res["data"] = {"per round": table}
        ctx.partial(res)
    res.find("per round = (a 10-token call - a 4-token call) / the difference in rounds (both calls hold the prefill "
             "and the drafter's catch-up over the prompt); wall_ms_per_round under the profiler, "
             "unprofiled_wall_ms_per_round without it (the summary's); a batch's rounds are "
             "its verify forwards (the longest row's); device time is the kernels' own (CUDA), on the CPU the "
             "operators' self time; trace_<cell>.json.gz: the tree call's chrome trace (CUDA only)")
    res["summary"] = "; ".join(f"{r['cell']} {r['mode']}: {r['unprofiled_wall_ms_per_round']:.1f} ms wall, "
                               f"{r['device_ms_per_round']:.1f} ms device a round" for r in table)
    return res


def _profile_round(ctx, target, drafter, ids, mask, kwargs, cell: str, mode: str, new: int = 6, base: int = 4) -> dict:
    """Per round: a call of `base` + `new` tokens less one of `base` tokens, over the difference in rounds. Both
    calls hold the prefill and the drafter's catch-up over the prompt (which the first drafting round runs: a
    one-token call has none), so the difference is rounds alone."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    runs = {}
    for tokens in (base, base + new):
        generate(target, ids, mask, tokens, drafter, **kwargs)  # warm-up (one-time costs are not rounds)
        ctx.sync()
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            generate(target, ids, mask, tokens, drafter, **kwargs)
            ctx.sync()
        wall = time.perf_counter() - start
        rounds = loop_rounds(last_stats()) if drafter is not None else tokens - 1
        _, unprofiled = timed(ctx, generate, target, ids, mask, tokens, drafter, **kwargs)  # (the profiler's own
        # cost per operator is large on a host-bound loop: the wall time without it too)
        if ctx.cuda and drafter is not None and tokens == base + new:
            save_trace(prof, ctx.out / f"trace_{cell}.json.gz")
        per_op = {}
        for e in prof.key_averages():
            on_device = str(getattr(e, "device_type", "")).endswith("CUDA")
            if on_device != ctx.cuda:
                continue
            us = (getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) if ctx.cuda
                  else e.self_cpu_time_total)
            per_op[e.key] = (us / 1e3, e.count)
        runs[tokens] = dict(wall=wall, unprofiled=unprofiled, rounds=rounds, ops=per_op)
    short, long = runs[base], runs[base + new]
    n = max(long["rounds"] - short["rounds"], 1)
    diff = {k: ((ms - short["ops"].get(k, (0.0, 0))[0]) / n, (c - short["ops"].get(k, (0.0, 0))[1]) / n)
            for k, (ms, c) in long["ops"].items()}
    top = sorted(diff.items(), key=lambda kv: -kv[1][0])[:8]
    return {"cell": cell, "mode": mode, "rounds": n, "wall_ms_per_round": 1e3 * (long["wall"] - short["wall"]) / n,
            "unprofiled_wall_ms_per_round": 1e3 * (long["unprofiled"] - short["unprofiled"]) / n,
            "device_ms_per_round": sum(ms for ms, _ in diff.values()),
            "launches_per_round": sum(c for _, c in diff.values()),
            "top": "; ".join(f"{k[:60]} {ms:.2f} ms x{c:.0f}" for k, (ms, c) in top)}
