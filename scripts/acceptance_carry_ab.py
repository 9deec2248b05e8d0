"""A/B of the carried acceptance (issue 35), in one process, interleaved per prompt: the default whose calls start
afresh (A: each call's drafter estimates from the flat prior and its first drafts' confidences, as before
the carry was added) against the default whose calls start from the last call's estimates (B: what
`eagle_hf.hf.costs.keep_acceptance` keeps); optionally copy drafting alone beside them. In float32 every mode
writes plain `generate()`'s text (checked per prompt), so the modes differ only in how they drafted it.

    EAGLE_HF_COST_CACHE=off python scripts/acceptance_carry_ab.py translation,questions OUT.json [--with-copy]

Not run by the tests (it loads the embedded SmolLM2 and the shipped drafter); docs/benchmarks.md reads its output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import weakref

import torch

from eagle_hf.drafter.default import load_drafter, load_target
from eagle_hf.hf import costs
from eagle_hf.tools.evaluation import chat_inputs, load_prompt_set


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("sets", help="prompt sets, comma-separated")
    p.add_argument("out")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--with-copy", action="store_true", help="copy drafting alone too")
    args = p.parse_args()
    target, tok = load_target("default", dtype=getattr(torch, args.dtype))
    drafter, _ = load_drafter("default", target)
    carried = costs._ACCEPTANCE  # B's memory, kept from call to call; A gets an empty one each call
    modes = {"A": {"assistant_model": drafter}, "B": {"assistant_model": drafter}}
    if args.with_copy:
        modes["copy"] = {"draft_sources": "copy"}

    def run(mode: str, enc: dict, n: int):
        if mode != "copy":
            costs._ACCEPTANCE = carried if mode == "B" else weakref.WeakKeyDictionary()
        start = time.perf_counter()
        out = target.generate(**enc, max_new_tokens=n, do_sample=False, **modes[mode])
        return time.perf_counter() - start, out

    warm = chat_inputs(tok, "Hello!", target.device)
    for mode in modes:  # first-call allocations, the costs' first measurements
        run(mode, warm, 16)
    results = {}
    for name in args.sets.split(","):
        rows = []
        for i, (_, text) in enumerate(load_prompt_set(name, limit=args.limit)):
            enc = chat_inputs(tok, text, target.device)
            order = list(modes)[i % len(modes):] + list(modes)[: i % len(modes)]  # each mode first in turn
            seconds, outs = {}, {}
            for mode in order:
                seconds[mode], outs[mode] = run(mode, enc, args.max_new_tokens)
            same = all(torch.equal(outs[m], outs["A"]) for m in modes)
            rows.append({"prompt": i, **{m: round(s, 4) for m, s in seconds.items()}, "same_text": same})
            print(name, i, {m: round(s, 2) for m, s in seconds.items()}, "A/B", round(seconds["A"] / seconds["B"], 3),
                  "" if same else "TEXT DIFFERS", flush=True)
        total = {m: sum(r[m] for r in rows) for m in modes}
        summary = {"total_seconds": {m: round(s, 2) for m, s in total.items()},
                   "speed_B_over_A_total": round(total["A"] / total["B"], 3),
                   "speed_B_over_A_median_per_prompt": round(statistics.median(r["A"] / r["B"] for r in rows), 3)}
        if "copy" in modes:
            summary["speed_B_over_copy_total"] = round(total["copy"] / total["B"], 3)
            summary["speed_A_over_copy_total"] = round(total["copy"] / total["A"], 3)
        results[name] = {"summary": summary, "prompts": rows}
        print(name, summary, flush=True)
    with open(args.out, "w") as f:
        json.dump({"settings": vars(args), "sets": results}, f, indent=1)


if __name__ == "__main__":
    main()
