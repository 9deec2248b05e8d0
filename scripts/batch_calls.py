"""One batch, several calls: how much does the default's speed on the same batch move from call to call, and why?

Runs plain `generate()` and the default on one batch of 4 prompts, alternately, `--calls` times (after one plain
call to warm up) and prints, per call: tokens (each row up to its end of sequence), seconds, the rate against the
plain call just before, the default's plain steps and drafting rounds, and whether its text equals plain's.

    python scripts/batch_calls.py [--dtype bfloat16] [--prompts mt_bench] [--first 16] [--calls 3]

Not run by the tests (it loads the embedded SmolLM2 and the shipped drafter); docs/benchmarks.md reads its output.
"""

from __future__ import annotations

import argparse
import time

import torch

from eagle_hf import last_stats
from eagle_hf.drafter.default import load_drafter, load_target
from eagle_hf.hf.stopping import eos_ids
from eagle_hf.tools.bench import generated_tokens
from eagle_hf.tools.evaluation import batch_chat_inputs, load_prompt_set


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", default="mt_bench")
    p.add_argument("--first", type=int, default=16, help="the batch's first prompt (the bench's batch i: 4 * i)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args()
    target, tok = load_target("default", dtype=getattr(torch, args.dtype))
    drafter, _ = load_drafter("default", target)
    prompts = load_prompt_set(args.prompts, limit=args.first + args.batch_size)[args.first:]
    enc = batch_chat_inputs(tok, [text for _, text in prompts], target.device)
    eos = eos_ids(target.generation_config)

    def call(**kwargs):
        start = time.perf_counter()
        out = target.generate(**enc, max_new_tokens=128, do_sample=False, **kwargs)
        new = out[:, enc["input_ids"].shape[1]:]
        return new, generated_tokens(new, eos), time.perf_counter() - start

    call()  # warm-up
    for _ in range(args.calls):
        plain, plain_tokens, plain_s = call()
        new, tokens, seconds = call(assistant_model=drafter)
        stats = last_stats()
        print(f"plain {plain_tokens} tokens in {plain_s:.2f} s | default {tokens} tokens in {seconds:.2f} s: "
              f"{(tokens / seconds) / (plain_tokens / plain_s):.2f}x; {stats.fallback_steps + stats.final_steps} "
              f"plain steps, {stats.cycles} drafting rounds, text equal to plain's: {torch.equal(new, plain)}",
              flush=True)


if __name__ == "__main__":
    main()
