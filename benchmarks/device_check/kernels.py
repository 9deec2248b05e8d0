"""The kernels stage: each attention implementation and the static cache (with and without a compiled forward): does
EAGLE run, which mode ran, is the output plain generate()'s, how fast against plain; which attention kernels a tree
round launches."""

from __future__ import annotations

import importlib.util
import re
from collections import Counter

from .common import CHAIN, TREE, Budget, Context, StageResult, _kernel_cases, generate, prompts


def stage_kernels(ctx: Context, budget: Budget) -> StageResult:
    """Each attention implementation and the static cache (with and without a compiled forward): does EAGLE
    run, what mode ran, is the output plain generate()'s, how fast against plain. Refusals are findings."""
    res = StageResult()
    target, drafter = ctx.pair("bf16")
    vocab = target.config.vocab_size
    new = 16 if ctx.small else 48
    ids, mask = prompts(1, 64 if ctx.small else 1024, vocab, seed=31, device=ctx.device, repeat=True)
    impls = ["sdpa", "eager"]
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        res.find("torch has no flex_attention: not checked")
    elif ctx.small and not ctx.cuda:
        res.find("flex_attention not checked with --small on a CPU (it compiles its kernel: minutes here)")
    else:
        impls.append("flex_attention")
    if importlib.util.find_spec("flash_attn") is not None:
        impls.append("flash_attention_2")
    else:
        res.find("flash_attn is not importable: flash_attention_2 not checked")
    wanted = [x for x in ctx.args.kernels.split(",") if x]
    if wanted:
        impls = [i for i in impls if i in wanted]
        res.find(f"only {', '.join(wanted)} (--kernels)")
    table = []
    cases = {"default": {}, "tree": dict(draft_mode="tree"), "chain 5": CHAIN}
    for impl in impls:
        if not budget.allows(20):
            res["status"] = "partial"
            res.find(f"budget: skipped {impl}")
            continue
        try:
            target.set_attn_implementation(impl)
        except Exception as err:  # noqa: BLE001 - a refusal is a finding
            table.append({"attention": impl, "case": "set_attn_implementation", "runs": False,
                          "note": f"{type(err).__name__}: {err}"[:200]})
            continue
        table += _kernel_cases(ctx, target, drafter, ids, mask, new, cases, {"attention": impl, "cache": "dynamic"})
        res["data"]["runs"] = table
        ctx.partial(res)
    target.set_attn_implementation("sdpa")
    compiles = [False, True] if ctx.cuda else [False]
    if wanted:
        compiles = [c for c in compiles if ("static+compile" if c else "static") in wanted]
    if not ctx.cuda:
        res.find("no CUDA device: the static cache's automatic compile (CUDA only) not checked")
    for compiled in compiles:
        if not budget.allows(60 if compiled else 20):
            res["status"] = "partial"
            res.find(f"budget: skipped static cache {'compiled' if compiled else 'eager'}")
            continue
        extra = dict(cache_implementation="static", disable_compile=not compiled)
        table += _kernel_cases(ctx, target, drafter, ids, mask, new, cases,
                               {"attention": "sdpa", "cache": "static" + (" + compile" if compiled else "")}, extra)
        res["data"]["runs"] = table
        ctx.partial(res)
    if ctx.cuda and budget.allows(15):
        res["data"]["attention kernels in one tree generate"] = _attention_kernels(ctx, target, drafter, ids, mask)
    res["data"]["runs"] = table
    for r in table:
        if not r.get("runs", True):
            res.find(f"{r.get('attention')} {r.get('cache', 'dynamic')} {r['case']}: does not run: {r.get('note')}")
        elif r.get("equal") is False:
            res.find(f"{r.get('attention')} {r.get('cache', 'dynamic')} {r['case']}: output differs from plain")
        if "fallback" in str(r.get("ran", "")):
            res.find(f"{r.get('attention')} {r['case']}: tree mode fell back to chain")
    ok = sum(1 for r in table if r.get("runs", True) and r["case"] != "plain")
    res["summary"] = f"{ok} of {sum(1 for r in table if r['case'] != 'plain')} EAGLE runs ran; see findings"
    return res


def _attention_kernels(ctx, target, drafter, ids, mask) -> dict:
    """Which attention kernels one tree-mode generate() launches (the SDPA backend chosen for tree masks and
    for the drafter's mask shows in the kernel names)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate(target, ids, mask, 8, drafter, **TREE)
        ctx.sync()
    names = Counter()
    for e in prof.key_averages():
        if re.search(r"flash|fmha|attention|efficient|cudnn|softmax|sdp", e.key, re.IGNORECASE):
            names[e.key[:120]] += e.count
    return dict(names.most_common(15))
