"""The equality stage: greedy equality with plain generate() for chain, tree, default and a left-padded batch, in
float32 with TF32 off (exact up to near-ties: the top-2 margin at a first difference), and in bf16 at the real shape
the count of differing outputs beside transformers' prompt lookup."""

from __future__ import annotations

import sys
from collections import Counter

import torch

from .bootstrap import ROOT
from .common import MODES, Budget, Context, StageResult, eagle_logs, generate, last_stats, mode_ran, prompts, sequences

sys.path.insert(0, str(ROOT / "tests"))  # tests/numerics.py: the numerics rule shared with the test suite
import numerics


def stage_equality(ctx: Context, budget: Budget) -> StageResult:
    """Greedy equality with plain generate(): float32 (TF32 off) must be exact up to near-ties; bf16 counts."""
    res = StageResult()
    s = ctx.shapes
    rows, bf16_rows = [], []
    target, drafter = ctx.pair("f32")
    vocab = target.config.vocab_size
    lengths = [int(x) for x in torch.linspace(16 if ctx.small else 64, 64 if ctx.small else 512, s.equality_prompts)]
    with numerics.exact_matmuls():
        for i, n in enumerate(lengths):
            if not budget.allows(10):
                res.find(f"budget: float32 equality stopped after {i} of {len(lengths)} prompts")
                res["status"] = "partial"
                break
            ids, mask = prompts(1, n, vocab, seed=100 + i, device=ctx.device, repeat=i % 2 == 1)
            rows += _compare(target, drafter, ids, mask, s.equality_new, f"prompt {i} ({n} tokens)", MODES, judge=True)
        if budget.allows(10):  # a left-padded batch of 3 rows of different lengths
            ids, mask = prompts(3, [lengths[0], lengths[-1], (lengths[0] + lengths[-1]) // 2], vocab, seed=7,
                                device=ctx.device, repeat=True)
            rows += _compare(target, drafter, ids, mask, s.equality_new, "batch of 3, left-padded", MODES, judge=True)
    ctx.drop("f32")
    res["data"]["float32"] = rows
    ctx.partial(res)
    bugs = [r for r in rows if r["verdict"] == "bug"]
    near = [r for r in rows if r["verdict"] == "numerics"]
    # bf16 at the real shape: a count of differing outputs, beside transformers' own prompt lookup
    target, drafter = ctx.pair("bf16")
    vocab = target.config.vocab_size
    bf16_modes = dict(MODES, **{"prompt lookup (transformers)": dict(prompt_lookup_num_tokens=5)})
    for i, n in enumerate(lengths):
        if not budget.allows(15):
            res.find(f"budget: bf16 comparison stopped after {i} of {len(lengths)} prompts")
            res["status"] = "partial"
            break
        ids, mask = prompts(1, n, vocab, seed=200 + i, device=ctx.device, repeat=i % 2 == 1)
        bf16_rows += _compare(target, drafter, ids, mask, s.equality_new, f"prompt {i} ({n} tokens)", bf16_modes,
                              judge=False)
    per_mode = Counter(r["mode"] for r in bf16_rows if not r["equal"])
    totals = Counter(r["mode"] for r in bf16_rows)
    res["data"] = {"float32": rows, "bf16 differing outputs": {m: f"{per_mode[m]} of {totals[m]}" for m in totals},
                   "bf16": bf16_rows}
    for r in bugs:
        res.find(f"BUG: float32 {r['case']} {r['mode']} row {r['row']} differs at new token {r['step']} with top-2 "
                 f"margin {r['margin']:.3g} (>= {numerics.NUMERICS_MARGIN})")
    for r in near:
        res.find(f"float32 near-tie (numerics): {r['case']} {r['mode']} at new token {r['step']}, margin {r['margin']:.2e}")
    if bugs:
        res["status"] = "failed"
    res["summary"] = (f"float32: {sum(r['equal'] for r in rows)} of {len(rows)} outputs equal, {len(bugs)} bugs, "
                      f"{len(near)} near-ties; bf16 differing: " + ", ".join(f"{m} {per_mode[m]}/{totals[m]}"
                                                                          for m in totals))
    return res


def _compare(target, drafter, ids, mask, new: int, case: str, modes: dict, judge: bool) -> list[dict]:
    """One prompt (or batch): plain generate() with its logits, then each mode; a row per mode and batch row."""
    ref = generate(target, ids, mask, new, output_logits=True, return_dict_in_generate=True)
    out = []
    for mode, kwargs in modes.items():
        uses_drafter = "prompt_lookup_num_tokens" not in kwargs
        with eagle_logs() as records:
            got = generate(target, ids, mask, new, drafter if uses_drafter else None, **kwargs)
        mism = {m.row: m for m in numerics.compare_greedy(sequences(ref), sequences(got), ids.shape[1], ref.logits,
                                                          judge=judge)}
        stats = last_stats() if uses_drafter else None
        for row in range(ids.shape[0]):
            m = mism.get(row)
            out.append({"case": case, "mode": mode, "ran": mode_ran(records) if uses_drafter else "transformers",
                        "row": row, "equal": m is None, "step": m.step if m else None,
                        "margin": m.margin if m else None, "verdict": m.verdict if m else "equal",
                        "accepted": stats.accepted if stats else None, "cycles": stats.cycles if stats else None})
    return out
