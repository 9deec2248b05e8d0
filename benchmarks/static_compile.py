"""Speculative decoding on a static cache with transformers' compiled forward, against plain compiled decoding
(issue #33, item 2). SmolLM2-135M-Instruct (the embedded default) and the shipped drafter, greedy; every mode
on every prompt, interleaved, medians; speed over plain `generate()` (dynamic cache, no compile) in the same run.

transformers compiles its forward automatically on accelerators with a static cache; on a CPU only when told
(`CompileConfig._compile_all_devices`), which this script does, so that the CPU inductor backend is what runs.
Each mode is warmed up first on a long repetitive prompt (compiles happen there: one graph per verify width
bucket), then timed.

    python benchmarks/static_compile.py --out docs/results/static_compile
"""

from __future__ import annotations

import argparse
import logging

import torch
from transformers import CompileConfig

import eagle_hf
from eagle_hf import EagleDrafter
from eagle_hf.tools.bench import Mode, _generate, results_markdown, run_benchmark, write_results
from eagle_hf.tools.evaluation import chat_inputs


def modes(drafter, compiled: CompileConfig) -> list[Mode]:
    static = dict(cache_implementation="static", compile_config=compiled)
    return [
        Mode("plain"),
        Mode("plain static compiled", dict(static)),
        Mode("eagle default", {"assistant_model": drafter}, True),
        Mode("eagle default static compiled", {"assistant_model": drafter, **static}, True),
        Mode("eagle tree static compiled", {"assistant_model": drafter, "draft_sources": "eagle", **static}, True),
        Mode("copy alone static compiled", {"draft_sources": "copy", **static}, True),
        Mode("eagle chain 5 static", {"assistant_model": drafter, "draft_mode": "chain", "num_assistant_tokens": 5,
                                      "num_assistant_tokens_schedule": "constant", **static}, True),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", default="mt_bench,code_edit")
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="docs/results/static_compile", help="folder: results.json/.md, speedup.png")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    target, tok = eagle_hf.load_target("default", dtype=getattr(torch, args.dtype))
    drafter = EagleDrafter.from_pretrained(eagle_hf.DEFAULT_DRAFTER)
    # one compiled call serves every mode here (transformers keeps one per model): allow a graph per mode's kwargs
    # and per verify width bucket (torch's default, 8 per function, suits one mode at a time)
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    compiled = CompileConfig()
    compiled._compile_all_devices = True  # (transformers compiles on accelerators only unless told)
    chosen = modes(drafter, compiled)
    warm = chat_inputs(tok, "Repeat this list twice: apples, pears, plums, figs, dates, limes, kiwis, grapes.",
                       target.device)
    for mode in chosen:  # the compiles: the decode step, and each verify width bucket the trees reach
        for _ in range(2):
            _, seconds = _generate(target, warm, mode, args.max_new_tokens, 0.0, 0)
        print(f"warm-up {mode.name}: {seconds:.2f} s", flush=True)
    results = run_benchmark(target, tok, chosen, args.prompts.split(","), max_new_tokens=args.max_new_tokens,
                            limit=args.limit, repeats=args.repeats)
    write_results(results, args.out)
    print(results_markdown(results))


if __name__ == "__main__":
    main()
