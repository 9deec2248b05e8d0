"""One verify forward of a draft tree, through transformers' sdpa function (K/V repeated for grouped-query
attention under a 4D mask) and through eagle_hf's tree attention (K/V never repeated), interleaved, median of
`--repeats`, at several context lengths. SmolLM2-135M-Instruct (9 query heads over 3 K/V heads).

    python benchmarks/verify_forward_attention.py --contexts 512,2048,4096 --width 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import DynamicCache

import eagle_hf
from eagle_hf.hf.attention import routed_kernel
from eagle_hf.hf.version import cache_kwarg


@torch.no_grad()
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--contexts", default="512,2048,4096")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    target, _ = eagle_hf.load_target("default", dtype=getattr(torch, args.dtype))
    routed = routed_kernel(target)  # the keyword that routes a forward to eagle_hf's tree attention
    g = torch.Generator().manual_seed(0)
    rows = []
    for context in map(int, args.contexts.split(",")):
        cache = DynamicCache(config=target.config)
        target(torch.randint(1, 1000, (1, context), generator=g), **cache_kwarg(cache), use_cache=True)
        n = args.width
        tree = torch.ones(1, n, n, dtype=torch.bool).tril()  # a chain: each node sees the ones before it
        mask = torch.zeros(1, 1, n, context + n, dtype=target.dtype)  # [1, 1, N, L + N]: the context all visible
        mask[..., context:].masked_fill_(~tree, torch.finfo(target.dtype).min)
        ids = torch.randint(1, 1000, (1, n), generator=g)
        positions = torch.arange(context, context + n)[None]
        times = {"transformers sdpa (K/V repeated)": [], "eagle_hf tree attention": []}
        for r in range(args.repeats + 1):
            for name in (list(times) if r % 2 else list(reversed(times))):
                kwargs = routed if name.startswith("eagle_hf") else {}
                start = time.perf_counter()
                target(ids, attention_mask=mask, position_ids=positions, **cache_kwarg(cache), use_cache=True,
                       logits_to_keep=0, **kwargs)
                seconds = time.perf_counter() - start
                cache.crop(-n)  # (back to the context)
                if r:  # (the first round warms up)
                    times[name].append(seconds)
        row = {"context": context, "width": n,
               **{name: round(1000 * statistics.median(t), 2) for name, t in times.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| context | tree width | transformers sdpa, ms | eagle_hf tree attention, ms |")
    print("|---|---|---|---|")
    for row in rows:
        values = list(row.values())
        print(f"| {values[0]} | {values[1]} | {values[2]} | {values[3]} |")


if __name__ == "__main__":
    main()
