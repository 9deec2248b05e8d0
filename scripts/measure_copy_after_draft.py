"""Copy branches below the drafter's first drafts (`eagle_hf.speculation.copying.ANCHORS` of them) against none (0).

Default: tokens per target forward on the shared prompt sets with the drafter drafting every round (tree,
constant schedule) in float32, so the counts depend neither on timings nor on near-ties, and the comparison is
exact. `--timed`: the default mode (adaptive), speed relative to plain `generate()` per prompt, each prompt run
plain and with each ANCHORS value in turn (medians; pause other jobs first).

    .venv/bin/python scripts/measure_copy_after_draft.py --sets sum,gsm8k,qa --limit 8
    .venv/bin/python scripts/measure_copy_after_draft.py --sets sum,gsm8k,qa --limit 8 --timed --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import eagle_hf
from eagle_hf import copying
from eagle_hf.tools.evaluation import chat_inputs, load_prompt_set


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="sum,gsm8k,qa")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--anchors", default="0,1,2", help="values of eagle_hf.speculation.copying.ANCHORS to compare")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="float32: every setting emits the target's own greedy text, so only the drafting differs "
                         "(in bf16 a wider tree flips near-ties, and the texts differ)")
    ap.add_argument("--timed", action="store_true", help="the default mode, timed against plain generate()")
    args = ap.parse_args()
    target, tok = eagle_hf.load_target("default", dtype=getattr(torch, args.dtype))
    drafter, label = eagle_hf.load_drafter("default", target)
    forwards = 0
    forward = type(target).forward

    def counted(self, *a, **k):
        nonlocal forwards
        forwards += 1
        return forward(self, *a, **k)

    type(target).forward = counted
    settings = {"draft_mode": "tree", "num_assistant_tokens_schedule": "constant", "draft_sources": "eagle+copy"}
    what = "speedup over plain generate() (median per prompt), tokens per forward" if args.timed else \
        "tokens per target forward (prefill excluded)"
    print(f"{label}; {what}, {args.limit} prompts per set, {args.max_new_tokens} new tokens, greedy, {args.dtype}\n")
    print("| prompt set | " + " | ".join(f"ANCHORS = {a}" for a in args.anchors.split(",")) + " |")
    print("|---" * (1 + len(args.anchors.split(","))) + "|")

    def run(enc, **kwargs) -> tuple[int, int, float]:
        nonlocal forwards
        forwards = 0
        start = time.perf_counter()
        with torch.no_grad():
            out = target.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False, **kwargs)
        return out.shape[1] - enc["input_ids"].shape[1], forwards - 1, time.perf_counter() - start

    values = [int(a) for a in args.anchors.split(",")]
    if args.timed:
        chat = chat_inputs(tok, "Hello!", target.device)
        run(chat), run(chat, assistant_model=drafter)  # warm-up (and the cost measurement)
        for name in args.sets.split(","):
            ratios = {a: [] for a in values}
            counts = {a: [0, 0] for a in values}
            for _, text in load_prompt_set(name, limit=args.limit):
                enc = chat_inputs(tok, text, target.device)
                n, _, plain = run(enc)
                for a in values:
                    copying.ANCHORS = a
                    m, rounds, seconds = run(enc, assistant_model=drafter)
                    ratios[a].append((m / seconds) / (n / plain))
                    counts[a][0] += m
                    counts[a][1] += rounds
            print(f"| {name} | " + " | ".join(f"{statistics.median(ratios[a]):.2f}x, {counts[a][0] / counts[a][1]:.2f}"
                                              for a in values) + " |", flush=True)
        return
    for name in args.sets.split(","):
        cells = []
        for a in values:
            copying.ANCHORS = a
            tokens = rounds = 0
            for _, text in load_prompt_set(name, limit=args.limit):
                m, r, _ = run(chat_inputs(tok, text, target.device), assistant_model=drafter, **settings)
                tokens, rounds = tokens + m, rounds + r
            cells.append(f"{tokens / rounds:.3f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
