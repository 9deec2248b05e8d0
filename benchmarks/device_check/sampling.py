"""The sampling stage: lossless sampling. The distribution of the first generated tokens, EAGLE (tree, chain)
against plain sampling over many identical rows, with a random drafter and with the oracle on a spread
`cycle_target`: a chi-square test of homogeneity (p < 1e-3 fails) and the total variation distance."""

from __future__ import annotations

import contextlib

import torch

from .common import (
    TREE,
    Budget,
    Context,
    StageResult,
    build_drafter,
    build_target,
    cycle_target,
    draft_ids,
    generate,
    last_stats,
    oracle_drafter,
)


def stage_sampling(ctx: Context, budget: Budget) -> StageResult:
    """Lossless sampling: with do_sample=True, temperature 1, the joint distribution of the first two generated
    tokens (the second is the first that can be drafted) and the third's marginal, EAGLE against plain
    generate(), over many identical rows; a chi-square test of homogeneity and the total variation distance.

    Two setups, both with a 32-token vocabulary. "random drafter": both lm_heads scaled up (peaked,
    context-dependent distributions), so that drafts are accepted often and rejected often. "oracle": a
    `cycle_target` with a spread head and `oracle_drafter` (the drafter puts nearly all its mass on the target's
    most likely token):
    most drafts accepted, so the accept path of the recursive rejection carries most of the draws."""
    res = StageResult()
    shape = dict(hidden_size=64 if ctx.small else 256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128 if ctx.small else 512, vocab_size=32,
                 max_position_embeddings=512)
    target = build_target(shape, torch.float32, ctx.device, seed=5)
    drafter = build_drafter(target, 24, seed=6)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0 if ctx.small else 4.0)
        drafter.lm_head.weight.mul_(8.0 if ctx.small else 4.0)
    ids = torch.randint(1, 32, (1, 12), generator=torch.Generator().manual_seed(5)).to(ctx.device)
    within = draft_ids(32, 24, seed=8)  # (the cycle the drafter can propose)
    oracle, succ = cycle_target(shape, torch.float32, ctx.device, seed=7, gain=0.55 if ctx.small else 0.27,
                                within=within)  # P(succ) ~ 0.7
    follower = build_drafter(oracle, 24, seed=8)
    oracle_ids = ids.clone()
    oracle_ids[:, -1] = within[-1]  # (the last: not the padding id 0)
    chain3 = dict(draft_mode="chain", num_assistant_tokens=3)
    setups = {"random drafter": (target, drafter, None, ids), "oracle": (oracle, follower, succ, oracle_ids)}
    modes = {"tree (constant)": TREE, "chain 3 (constant)": chain3}
    table = []
    for setup, (model, draft_model, table_succ, prompt) in setups.items():
        if not budget.allows(10):
            res["status"] = "partial"
            res.find(f"budget: skipped the {setup} setup")
            continue
        table += _sampling_tests(ctx, res, setup, model, draft_model, table_succ, prompt, modes, budget)
        res["data"]["tests"] = table
        ctx.partial(res)
    failed = [r for r in table if r["p"] < 1e-3]
    if failed:
        res["status"] = "failed"
        for r in failed:
            res.find(f"{r['setup']} {r['mode']} {r['tokens']}: p = {r['p']:.2e} (TV {r['total_variation']:.3f}): "
                     "not plain sampling")
    res.find("threshold: p < 1e-3 fails (chi-square homogeneity, cells with fewer than 5 expected draws pooled)")
    res["summary"] = "; ".join(f"{r['setup']} {r['mode']} {r['tokens']}: p {r['p']:.3f}, TV {r['total_variation']:.3f}, "
                               f"acceptance {r['acceptance']:.2f}" for r in table)
    return res


def _sampling_tests(ctx, res, setup, target, drafter, succ, ids, modes, budget) -> list[dict]:
    """Draws of plain sampling and of each EAGLE mode (`oracle_drafter` when `succ` is given), and the tests."""
    s = ctx.shapes
    draws = {m: [] for m in ["plain", *modes]}
    accept = {}
    calls = -(-s.samples // s.sample_rows)
    for call in range(calls):
        if not budget.allows(5):
            res["status"] = "partial"
            res.find(f"budget: {setup}: {call} of {calls} calls per mode")
            break
        rows = ids.expand(s.sample_rows, -1).contiguous()
        mask = torch.ones_like(rows)
        for mode, kwargs in [("plain", None), *modes.items()]:
            torch.manual_seed(1000 * call + len(draws[mode]))
            with oracle_drafter(drafter, succ) if succ is not None and kwargs is not None else contextlib.nullcontext():
                out = generate(target, rows, mask, 3, drafter if kwargs is not None else None, do_sample=True,
                               temperature=1.0, **(kwargs or {}))
            draws[mode].append(out[:, -3:].cpu())
            if kwargs is not None:
                st = last_stats()
                a = accept.setdefault(mode, [0, 0])
                a[0], a[1] = a[0] + st.accepted, a[1] + st.drafted
    samples = {m: torch.cat(v) for m, v in draws.items() if v}
    table = []
    if "plain" not in samples:
        return table
    ref = samples["plain"]
    for mode in modes:
        if mode not in samples:
            continue
        got = samples[mode]
        for what, f in (("tokens 1-2 (joint)", lambda x: x[:, 0] * 32 + x[:, 1]), ("token 3", lambda x: x[:, 2])):
            stat, dof, p, tv = homogeneity(f(ref), f(got), 32 * 32)
            table.append({"setup": setup, "mode": mode, "tokens": what, "n": len(got), "chi2": stat, "dof": dof,
                          "p": p, "total_variation": tv, "acceptance": accept[mode][0] / max(accept[mode][1], 1)})
    return table


def homogeneity(a: torch.Tensor, b: torch.Tensor, cells: int) -> tuple[float, int, float, float]:
    """Chi-square test that two samples of category ids come from one distribution: (statistic, degrees of
    freedom, p-value, total variation distance of the empirical distributions). Cells where either sample expects
    fewer than 5 draws are pooled into one."""
    ca = torch.bincount(a, minlength=cells).double()
    cb = torch.bincount(b, minlength=cells).double()
    na, nb = ca.sum(), cb.sum()
    total = ca + cb
    ea, eb = total * na / (na + nb), total * nb / (na + nb)
    keep = (ea >= 5) & (eb >= 5)
    oa = torch.cat([ca[keep], ca[~keep].sum()[None]])
    ob = torch.cat([cb[keep], cb[~keep].sum()[None]])
    ea = torch.cat([ea[keep], ea[~keep].sum()[None]])
    eb = torch.cat([eb[keep], eb[~keep].sum()[None]])
    used = ea > 0
    stat = float((((oa - ea) ** 2 / ea)[used]).sum() + (((ob - eb) ** 2 / eb)[used]).sum())
    dof = int(used.sum()) - 1
    tv = float(0.5 * (ca / na - cb / nb).abs().sum())
    return stat, dof, chi2_sf(stat, dof), tv


def chi2_sf(x: float, k: int) -> float:
    """P(chi2_k > x): scipy's where it imports, else the Wilson-Hilferty approximation."""
    if k <= 0:
        return 1.0
    try:
        from scipy.stats import chi2

        return float(chi2.sf(x, k))
    except ImportError:
        import math

        z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
        return 0.5 * math.erfc(z / math.sqrt(2))
