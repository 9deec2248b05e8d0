"""The compiled stage: EAGLE against plain generate() on the static cache with transformers' automatic compile, on
the `cycle_target` with `oracle_drafter`: chain 3/5/8, the tree and the default at full acceptance, then the
acceptance curve; speedups over compiled plain in the same cell, graphs compiled after the warm-up, and the
drafter's level alone, eager and at fixed shapes."""

from __future__ import annotations

import contextlib
import statistics
import time
import traceback

import torch

from .common import (
    TREE,
    Budget,
    Context,
    StageResult,
    build_drafter,
    cycle_target,
    draft_ids,
    draft_levels,
    draft_vocabulary,
    generate,
    last_stats,
    loop_rounds,
    oracle_drafter,
    parse_cells,
    prompts,
    timed,
)


def stage_compiled(ctx: Context, budget: Budget) -> StageResult:
    """EAGLE against what a speed-minded user runs: plain generate() with a static cache and transformers'
    automatic compile. On a `cycle_target` (identical calls give identical output) with `oracle_drafter`: chain
    3/5/8, the tree and the default at full acceptance, then the acceptance curve (drafts withheld at set rates)
    for chain 5 and the default, per CONTEXTxBATCH cell (`--compiled-cells`), interleaved timed runs after a
    warm-up, medians; speedups over compiled plain in the same cell, and the eager plain step beside it. Graphs
    compiled after the warm-up are counted (0: nothing recompiles in the timed runs)."""
    res = StageResult()
    s = ctx.shapes
    for kind in ("bf16", "f32"):
        ctx.drop(kind)  # (room for the oracle target: the earlier stages' pairs are not needed again)
    within = draft_ids(s.target["vocab_size"], s.draft_vocab, seed=22)  # (the cycle the drafter can propose)
    target, succ = cycle_target(s.target, torch.bfloat16, ctx.device, seed=21, within=within)
    drafter = build_drafter(target, s.draft_vocab, seed=22)
    drafter.bind_target_embedding(target.get_input_embeddings())  # (generate() does it; the level benchmark first)
    compiled = ctx.cuda or ctx.args.compile_cpu
    if not compiled:
        res.find("compiled rows ran the static cache uncompiled: transformers compiles automatically on CUDA only "
                 "(--compile-cpu compiles through inductor here: minutes)")
    else:
        torch._dynamo.config.recompile_limit = 64  # one graph per verify width bucket and mode (docs/gpu.md)
        torch._dynamo.config.accumulated_recompile_limit = 1024
    static = dict(cache_implementation="static", disable_compile=not compiled)
    if compiled and not ctx.cuda:
        import transformers as tf

        static["compile_config"] = tf.CompileConfig()
        static["compile_config"]._compile_all_devices = True  # (transformers compiles on accelerators only unless told)
    full = {f"chain {k}": dict(draft_mode="chain", num_assistant_tokens=k) for k in (3, 5, 8)}
    full.update({"tree": TREE, "default": {}})
    full.update({f"{m}, eager levels": dict(full[m], levels="eager") for m in ("chain 5", "default")})
    full.update({f"{m}, dynamic widths": dict(full[m], widths="dynamic") for m in ("chain 5", "chain 8", "default")})
    full.update({f"{m}, dynamic cache": dict(full[m], cache="dynamic") for m in ("chain 5", "tree", "default")})
    if ctx.args.compiled_modes:
        full = {m.strip(): full[m.strip()] for m in ctx.args.compiled_modes.split(";")}
    else:  # (the comparisons of the compiled path's widths, and the dynamic cache: asked for by name)
        full = {m: kwargs for m, kwargs in full.items() if "widths" not in kwargs and "cache" not in kwargs}
    rates = [float(r) for r in (ctx.args.compiled_rates or "0.15,0.25,0.35,0.5,1.0").split(",") if r]
    curve = [(m, r) for r in rates for m in ("chain 5", "tree", "default", "chain 5, dynamic cache",
                                             "tree, dynamic cache", "default, dynamic cache") if m in full]
    cells = parse_cells(ctx.args.compiled_cells or ("64x1,64x2" if ctx.small else "1024x1,1024x4"))
    if budget.allows(10):  # (first: cheap, and the cells may use up the budget)
        context = cells[0][0] if cells else 1024
        res["data"]["drafter level alone"] = [
            {"context": context, "k": k, "levels": "eager", "ms": drafter_level_ms(ctx, drafter, context, k)}
            for k in (1, 4)]
        ctx.partial(res)
    table = []
    for ctx_len, rows in cells:
        cases = [(m, 0.0) for m in full] + (curve if rows == 1 else [])  # (the curve: batch 1)
        if not budget.allows(30):
            res["status"] = "partial"
            res.find(f"budget: skipped context {ctx_len} x batch {rows}")
            continue

        def publish(cell_rows, earlier=tuple(table)):  # (the cell's rows so far, after each repeat: a kill keeps them)
            res["data"]["speed"] = [*earlier, *cell_rows]
            ctx.partial(res)

        table += _compiled_cell(ctx, res, target, drafter, succ, ctx_len, rows, cases, full, static, budget, publish)
        res["data"]["speed"] = table
        ctx.partial(res)
    done = [r for r in table if r["mode"] != "plain" and r.get("runs")]
    alone = {x["k"]: x["ms"] for x in res["data"].get("drafter level alone", [])}
    for r in done:  # (the eager level alone, k nodes a row as the mode drafts: the programs' is inside theirs)
        r["drafter_ms_per_level"] = alone.get(1 if r["mode"].startswith("chain") else 4)
    bad = [r for r in done if r.get("follows_cycle") is False]
    if bad:
        res["status"] = "failed"
        res.find(f"{len(bad)} runs left the target's cycle (a lossy round): " +
                 ", ".join(f"{r['mode']} r={r['withheld_rate']}" for r in bad[:6]))
    recompiled = [r for r in done if r.get("graphs_after_warmup")]
    if recompiled:
        res.find(f"{len(recompiled)} modes compiled graphs in their timed runs: " +
                 ", ".join(f"{r['mode']} ({r['graphs_after_warmup']})" for r in recompiled[:6]))
    res.find("steady_ms_per_round: the slope of the call's time over its rounds between two new-token counts (the "
             "full count and half of it), per_call_ms the rest (prefill, catch-up of the prompt, set-up); "
             "launches_per_round: kernel and CUDA graph launches a round, from the profiler (one call, CUDA)")
    res.find("speedup = compiled plain's median / the mode's median, same cell; eager_plain_ms_per_token: plain "
             "generate() with the default cache, same prompt; drafter_ms_per_round: the drafter's clock (catch-up, "
             "levels, choices), of which catch_up_ms_per_round its catch-up; drafting_rounds: the rounds that "
             "verified drafts (copy branches' too), drafter_rounds: those the drafter drafted in; timed_rounds: the rounds whose times reached the schedule (those two clocks cover "
             "them; a round that compiled or captured is not timed), timed_drafter_rounds: of which the drafter "
             "drafted in; schedule_at_end: what the adaptive schedule believed after the call (its best depth k and gain, "
             "E(1) the tokens a depth-1 round yields, its verify of 2 tokens, a drafter step, and its catch-up (r), "
             "cycle (c) and loop (l) overheads, in one-token forwards; the forward's ms); verify_ms_per_round: the target's forwards after the prefill (both from the loop's "
             "device clock); drafter_ms_per_level: the level alone, "
             "k nodes as the mode drafts, eager or at fixed shapes as it runs; withheld_rate: the share of "
             "continuation tokens the oracle withholds; warmup_recompiles: torch.compile's reasons to recompile in "
             "the mode's warm-up call (its first guard failure each)")
    top = {r["mode"]: r for r in done if r["withheld_rate"] == 0 and r["batch"] == 1}
    res["summary"] = "; ".join(f"{m} {r['speedup']:.2f}x (tau {r['tau']:.2f})" for m, r in top.items())
    return res


def cache_of(mode: dict, static: dict) -> dict:
    """A mode's cache keywords: the static cache (compiled where it is), or the default dynamic cache for a mode
    asked for with ``cache="dynamic"`` (the README's GPU example's own path)."""
    return {} if mode.get("cache") == "dynamic" else static


def drafter_level_ms(ctx, drafter, context: int, k: int, calls: int = 50) -> float:
    """Milliseconds of one eager draft level alone: the drafter's forward over k frontier nodes after `context`
    real rows and the top-k choice of their children, `calls` times back to back (the device synchronised around
    the loop: launches and kernels, no host bookkeeping)."""
    from eagle_hf.speculation.drafting import DraftState, top_k_choice

    device, dtype = ctx.device, drafter.fc.weight.dtype
    g = torch.Generator(device="cpu").manual_seed(k)
    state = DraftState.for_drafter(drafter)
    aux = torch.randn(1, context, drafter.fc.in_features, generator=g).to(device, dtype)  # [1, n, A*H_t]
    tokens = torch.randint(1, drafter.config.vocab_size, (1, context), generator=g).to(device)
    with torch.no_grad():
        _, hidden = state.extend(drafter, aux, tokens)  # hidden: [1, 1, H]
        state.reserve(k)
        feed, ids = hidden.expand(1, k, hidden.shape[-1]).contiguous(), tokens[:, :k]  # [1, k, H], [1, k]
        positions = torch.full((1, k), context, device=device)
        mask = None if k == 1 else state.level_mask(torch.eye(k, dtype=torch.bool, device=device)[None], k, 0)

        def level():
            out = state.level_forward(drafter, feed, ids, positions, state.length, mask)
            return top_k_choice(drafter, out.logits, k)

        for _ in range(3):
            level()
        _, seconds = timed(ctx, lambda: [level() for _ in range(calls)])
    return 1e3 * seconds / calls


def _compiled_cell(ctx, res, target, drafter, succ, ctx_len, rows, cases, modes, static, budget, publish) -> list[dict]:
    from eagle_hf import programs
    from eagle_hf.hf.models import compiled_graphs

    s = ctx.shapes
    ids, mask = prompts(rows, ctx_len, target.config.vocab_size, seed=ctx_len + 3 * rows, device=ctx.device)
    ids[:, -1] = draft_vocabulary(drafter)[1 : rows + 1].to(ids.device)  # (continuations the drafter can propose)
    generate(target, ids, mask, s.new_tokens)  # warm-ups: eager, then compiled (compiles the one-token graph)
    ref = generate(target, ids, mask, s.new_tokens, **static)
    expected = ids.new_tensor(_cycle(succ, ids[:, -1].tolist(), s.new_tokens))  # [B, new]
    follows = bool(torch.equal(ref[:, -s.new_tokens:], expected))
    if not follows:
        res.find(f"context {ctx_len} x batch {rows}: compiled plain output leaves the cycle (the oracle needs it)")
    plain = {"eager": [], "compiled": [], "compiled, short": []}
    short = max(s.new_tokens // 2, 1)  # a second new-token count: the slope between the two is the steady state
    times, info, carried = {c: [] for c in cases}, {}, {}
    short_times, short_rounds = {c: [] for c in cases}, {}
    failed = {}  # case -> the error that took it out (the other modes go on)

    def fails(case, error):
        failed[case] = f"{type(error).__name__}: {error}"
        info.pop(case, None)
        res["status"] = "failed"
        res.find(f"context {ctx_len} x batch {rows}, {case[0]} r={case[1]}: {failed[case]}\n\n```\n"
                 + "".join(traceback.format_exception(error)[-8:]) + "```")

    def table() -> list[dict]:
        """The cell's rows from what was timed so far."""
        med = {k: statistics.median(v) if v else float("nan") for k, v in plain.items()}
        steady_plain = 1e3 * (med["compiled"] - med["compiled, short"]) / max(s.new_tokens - short, 1)
        base = dict(context=ctx_len, batch=rows, compiled=bool(static.get("disable_compile") is False))
        out = [dict(base, mode="plain", withheld_rate=0.0, runs=len(plain["compiled"]), median_s=med["compiled"],
                    speedup=1.0, tau=1.0, ms_per_round=1e3 * med["compiled"] / s.new_tokens,
                    steady_ms_per_round=steady_plain,
                    eager_plain_ms_per_token=1e3 * med["eager"] / s.new_tokens,
                    compiled_over_eager=med["eager"] / med["compiled"], follows_cycle=follows)]
        for case in cases:
            mode, rate = case
            i, t = info.get(case, {}), times[case]
            if not t:
                out.append(dict(base, mode=mode, withheld_rate=rate, runs=0, error=failed.get(case)))
                continue
            m = statistics.median(t)
            extra = i["rounds"] - short_rounds.get(case, i["rounds"])  # the rounds the longer calls ran more
            steady = 1e3 * (m - statistics.median(short_times[case])) / extra if extra > 0 else None
            out.append(dict(base, mode=mode, withheld_rate=rate, runs=len(t), median_s=m, speedup=med["compiled"] / m,
                            tau=i["tau"], rounds=i["rounds"], drafting_rounds=i["drafting"],
                            drafter_rounds=i["drafter_rounds"], timed_rounds=i["timed"],
                            timed_drafter_rounds=i["timed_drafter"], schedule_at_end=i.get("belief"),
                            ms_per_round=1e3 * m / i["rounds"],
                            steady_ms_per_round=steady,
                            per_call_ms=None if steady is None else 1e3 * m - steady * i["rounds"],
                            launches_per_round=i.get("launches"),
                            drafter_ms_per_round=1e3 * i["drafter"] / i["rounds"],
                            catch_up_ms_per_round=1e3 * i["catch_up"] / i["rounds"],
                            verify_ms_per_round=1e3 * i["verify"] / i["rounds"],
                            plain_ms_per_step=1e3 * med["compiled"] / s.new_tokens, follows_cycle=i["follows"],
                            warmup_graphs=i["warmup_graphs"], warmup_s=i["warmup_s"], graphs_after_warmup=i["after"],
                            drafter_captures_after_warmup=i.get("captures", 0),
                            warmup_recompiles=" | ".join(i["recompiles"][:3]) or None))
        return out

    for case in cases:  # warm-up: every graph a mode needs, compiled now
        mode, rate = case
        start = time.perf_counter()
        try:
            with oracle_drafter(drafter, succ, rate, seed=rows, rows=rows), own_acceptance(drafter, carried, case), \
                    draft_levels(modes[mode]) as kwargs:
                graphs = compiled_graphs()
                with dynamo_recompiles() as reasons:
                    generate(target, ids, mask, s.new_tokens, drafter, **kwargs, **cache_of(modes[mode], static))
                info[case] = dict(warmup_graphs=compiled_graphs() - graphs, after=0,
                                  warmup_s=round(time.perf_counter() - start, 1), recompiles=reasons)
        except Exception as error:  # noqa: BLE001 (recorded with its traceback)
            fails(case, error)
        res["data"].setdefault("warm-up", []).append(
            dict(context=ctx_len, batch=rows, mode=mode, withheld_rate=rate, s=round(time.perf_counter() - start, 1)))
        ctx.partial(res)
        if not budget.allows(20):
            res["status"] = "partial"
            res.find(f"budget: warm-up stopped after {mode} r={rate} (the later modes not run)")
            break
    for _ in range(s.repeats):
        if not budget.allows(10):
            res["status"] = "partial"
            break
        for which, kwargs in (("eager", {}), ("compiled", static)):
            plain[which].append(timed(ctx, generate, target, ids, mask, s.new_tokens, **kwargs)[1])
        plain["compiled, short"].append(timed(ctx, generate, target, ids, mask, short, **static)[1])
        for case in [c for c in cases if c in info]:
            mode, rate = case
            graphs, captures = compiled_graphs(), programs.CAPTURES
            try:
                with oracle_drafter(drafter, succ, rate, seed=rows, rows=rows), \
                        own_acceptance(drafter, carried, case), draft_levels(modes[mode]) as kwargs, \
                        schedules() as made:
                    out, t = timed(ctx, generate, target, ids, mask, s.new_tokens, drafter, **kwargs,
                                   **cache_of(modes[mode], static))
                st = last_stats()
                info[case]["belief"] = belief(made[-1]) if made else None
                with oracle_drafter(drafter, succ, rate, seed=rows, rows=rows), \
                        own_acceptance(drafter, carried, case), draft_levels(modes[mode]) as kwargs:
                    short_t = timed(ctx, generate, target, ids, mask, short, drafter, **kwargs,
                                    **cache_of(modes[mode], static))[1]
            except Exception as error:  # noqa: BLE001 (recorded; its earlier runs are dropped with it)
                fails(case, error)
                times[case], short_times[case] = [], []
                continue
            times[case].append(t)
            short_times[case].append(short_t)
            short_rounds[case] = loop_rounds(last_stats()) + 1
            info[case].update(tau=st.mean_acceptance_length, rounds=loop_rounds(st) + 1, drafting=st.cycles,
                              drafter=st.drafter_time, timed=st.timed_rounds, timed_drafter=st.timed_drafter_rounds,
                              drafter_rounds=(st.drafted_per_position_by_source.get("eagle") or [0])[0],
                              catch_up=st.catch_up_time, verify=st.verify_time,
                              follows=bool(torch.equal(out, ref)), after=info[case]["after"] + compiled_graphs() - graphs,
                              captures=info[case].get("captures", 0) + programs.CAPTURES - captures)
        publish(table())
    for case in [c for c in cases if times[c]]:  # launches a round, from the profiler (CUDA)
        mode, rate = case
        if not budget.allows(10):
            res["status"] = "partial"
            res.find(f"budget: launches not counted from {mode} r={rate} on")
            break
        with oracle_drafter(drafter, succ, rate, seed=rows, rows=rows), own_acceptance(drafter, carried, case), \
                draft_levels(modes[mode]) as kwargs:
            launches = device_launches(ctx, generate, target, ids, mask, s.new_tokens, drafter, **kwargs,
                                       **cache_of(modes[mode], static))
        info[case]["launches"] = None if launches is None else launches / info[case]["rounds"]
    return table()


def device_launches(ctx, fn, *args, **kwargs) -> int | None:
    """Kernel and CUDA graph launches of one call of fn(*args, **kwargs), counted by the profiler (None off
    CUDA)."""
    if not ctx.cuda:
        return None
    from torch.profiler import ProfilerActivity, profile

    ctx.sync()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(*args, **kwargs)
        ctx.sync()
    names = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
             "cuGraphLaunch")
    return sum(e.count for e in prof.key_averages() if e.key in names)


@contextlib.contextmanager
def dynamo_recompiles():
    """The reasons torch.compile recompiled a function while active (each recompilation's first guard failure;
    a hit recompile limit as its warning), collected from torch's `recompiles` log."""
    import logging

    reasons: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines = record.getMessage().splitlines()
            if "Recompiling" in lines[0]:
                failed = next((ln.strip() for ln in lines if ln.strip().startswith("- ")), lines[0])
                reasons.append(failed[:160])
            elif "recompile_limit" in lines[0] or "cache_size_limit" in lines[0]:
                reasons.append(lines[0][:160])

    logger, handler = logging.getLogger("torch._dynamo"), Collect()
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(handler)
    try:
        yield reasons
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()


@contextlib.contextmanager
def schedules():
    """The adaptive schedules (`DraftLengthController`) made while the block runs, in order."""
    from eagle_hf.speculation.schedule import DraftLengthController

    made, init = [], DraftLengthController.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    DraftLengthController.__init__ = keep
    try:
        yield made
    finally:
        DraftLengthController.__init__ = init


def belief(controller) -> str:
    """What a schedule believes (`schedule_at_end`), in one-token forwards of the target."""
    c = controller.costs
    k, gain = controller.best()
    return (f"k {k} gain {gain:.3f}; E(1) {controller.acceptance.expected_tokens(1):.2f}; verify(2) "
            f"{c.verify_cost(2):.3f}, step {c.draft_step:.3f}, r {c.round_overhead:.3f}, c {c.cycle_overhead:.3f}, "
            f"l {c.loop_overhead:.3f}; forward {1e3 * c.cost.base_seconds:.2f} ms")


@contextlib.contextmanager
def own_acceptance(drafter, kept: dict, case):
    """A call that starts from the acceptance its own case's last call ended with (eagle_hf carries a drafter's
    acceptance from one call to the next, `eagle_hf.hf.costs.keep_acceptance`): cases of different acceptance on
    one drafter object do not start from each other's, as a user whose drafter has that acceptance would not."""
    from eagle_hf.hf import costs

    costs._ACCEPTANCE.pop(drafter, None)
    if case in kept:
        costs._ACCEPTANCE[drafter] = dict(kept[case])
    try:
        yield
    finally:
        kept[case] = dict(costs._ACCEPTANCE.get(drafter, {}))


def _cycle(succ: torch.Tensor, last: list[int], new: int) -> list[list[int]]:
    """Each row's `new` tokens after its last prompt token under a `cycle_target`."""
    table, out = succ.tolist(), []
    for t in last:
        row = []
        for _ in range(new):
            t = table[t]
            row.append(t)
        out.append(row)
    return out
