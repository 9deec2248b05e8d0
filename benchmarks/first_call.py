"""The first generate() call of a process against the same call repeated (SmolLM2-135M, bf16, greedy): what a
user waits for before the first token. One mode per process (what a process learns once is the point).

    EAGLE_HF_COST_CACHE=off python benchmarks/first_call.py --mode default   # nothing kept from earlier processes
    python benchmarks/first_call.py --mode copy                              # costs read from eagle_hf's cache
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import eagle_hf
from eagle_hf import EagleDrafter

MODES = {"plain": {}, "default": {"assistant": True}, "copy": {"draft_sources": "copy"},
         "eagle": {"assistant": True, "draft_sources": "eagle"}}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=list(MODES), default="default")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    target, tok = eagle_hf.load_target("default", dtype=torch.bfloat16)
    kwargs = dict(MODES[args.mode])
    if kwargs.pop("assistant", False):
        kwargs["assistant_model"] = EagleDrafter.from_pretrained(eagle_hf.DEFAULT_DRAFTER)
    inputs = tok.apply_chat_template([{"role": "user", "content": "Explain speculative decoding in two paragraphs."}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    times = []
    for _ in range(args.calls):
        start = time.perf_counter()
        target.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, **kwargs)
        times.append(time.perf_counter() - start)
    print(json.dumps({"mode": args.mode, "seconds": [round(t, 3) for t in times],
                      "first_over_repeated": round(times[0] / min(times[1:]), 2)}))


if __name__ == "__main__":
    main()
