"""How a batch's ragged rows are best held in the target's KV cache, measured on the real model.

Batched EAGLE generate() on the default target and drafter, greedy, under three policies for the holes that
rows accepting different lengths leave in the cache (docs/concepts.md, "Batches"):

* every round: compact after every round (each row's valid slots gathered to the end: copies the whole cache)
* lazy (eagle_hf's default): compact once every row has 32 holes and they are a quarter of the cache
* never: keep the holes masked until the end

Runs are interleaved (every policy on a batch before the next batch, order alternating), after a warm-up;
medians of the seconds per batch, and the mean share of holes in the cache per round. The outputs of the
policies are compared: equal in float32 (tests/test_batch.py); in bf16 another slot order can flip a near-tie.

    .venv/bin/python benchmarks/ragged_cache.py --batch-size 4 --batches 3 --max-new-tokens 128 --prompts code_edit
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle_hf import load_drafter, load_target
from eagle_hf.hf.cache import TreeCache
from eagle_hf.speculation import ragged
from eagle_hf.tools.evaluation import batch_chat_inputs, load_prompt_set

POLICIES = {"every round": (0, 0.0), "lazy (default)": (ragged.MIN_HOLES_TO_COMPACT, ragged.HOLE_FRACTION),
            "never": (10**9, 1.0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", default="mt_bench")
    args = p.parse_args()
    target, tok = load_target("default")
    drafter, _ = load_drafter("default", target)
    prompts = load_prompt_set(args.prompts, limit=args.batch_size * args.batches)
    batches = [[t for _, t in prompts[i : i + args.batch_size]] for i in range(0, len(prompts), args.batch_size)]
    holes: dict[str, list[float]] = {name: [] for name in POLICIES}
    seconds: dict[str, list[float]] = {name: [] for name in POLICIES}
    original = TreeCache.compact
    current = [""]
    differing = 0

    def spying(self):
        valid = self.ragged.valid
        holes[current[0]].append(0.0 if valid is None else 1.0 - float(valid.float().mean()))
        return original(self)

    TreeCache.compact = spying
    for i, texts in enumerate([batches[0][:2]] + batches):  # the first: warm-up
        enc = batch_chat_inputs(tok, texts, target.device)
        names = list(POLICIES) if i % 2 == 0 else list(reversed(POLICIES))
        outputs = {}
        for name in names:
            ragged.MIN_HOLES_TO_COMPACT, ragged.HOLE_FRACTION = POLICIES[name]
            current[0] = name
            start = time.perf_counter()
            outputs[name] = target.generate(**enc, assistant_model=drafter, max_new_tokens=args.max_new_tokens,
                                            do_sample=False)
            if i > 0:
                seconds[name].append(time.perf_counter() - start)
        first = next(iter(outputs.values()))
        differing += not all(torch.equal(o, first) for o in outputs.values())
    print(f"batch {args.batch_size}, {args.batches} batches of {args.prompts}, {args.max_new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads, {target.dtype}")
    print("| policy | seconds per batch (median) | holes in the cache per round (mean) |")
    print("|---|---|---|")
    for name in POLICIES:
        share = statistics.mean(holes[name]) if holes[name] else 0.0
        print(f"| {name} | {statistics.median(seconds[name]):.2f} | {share:.0%} |")
    print(f"batches whose outputs differ between policies: {differing} of {len(batches) + 1} ({target.dtype})")


if __name__ == "__main__":
    main()
