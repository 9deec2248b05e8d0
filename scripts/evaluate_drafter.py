"""Mean acceptance length of a drafter on the shipped prompt sets (greedy, chain of K drafts), per position.

    python scripts/evaluate_drafter.py --drafter eagle_hf/assets/smollm2-135m-eagle3.1 --out results/acceptance.json

A training run's latest weights, while it runs (its `train_state.pt`, written every `--save-every` steps, over
the configuration of its `best/` drafter):

    python scripts/evaluate_drafter.py --drafter runs/X/best --train-state runs/X/train_state.pt --sets mt_bench \
        --out runs/eval_X_latest.json
"""

import argparse
import json
import os
import time

import torch

import eagle_hf
from eagle_hf import EagleDrafter
from eagle_hf.tools.evaluation import PROMPT_SETS, load_prompt_set, measure_acceptance
from eagle_hf.training.trainer import load_state


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--drafter", default=eagle_hf.DEFAULT_DRAFTER)
    p.add_argument("--sets", default=",".join(PROMPT_SETS))
    p.add_argument("--limit", type=int, default=None, help="prompts per set (default: all)")
    p.add_argument("--limit-others", type=int, default=None, help="prompts per set other than mt_bench")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--num-draft-tokens", type=int, default=5)
    p.add_argument("--out", default="acceptance.json", help="the JSON file to write (a file, not a folder)")
    p.add_argument("--train-state", default=None, help="a run's train_state.pt: its weights replace the drafter's")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if os.path.isdir(args.out):  # found out after all the compute otherwise
        p.error(f"--out {args.out} is a folder: pass a file path, e.g. {os.path.join(args.out, 'acceptance.json')}")
    if args.threads:
        torch.set_num_threads(args.threads)
    # (the run replaces the file atomically: this reads one whole state; tensors and plain values only)
    try:
        state = load_state(args.train_state) if args.train_state else None
    except ValueError as err:
        p.error(str(err))
    target, tok = eagle_hf.load_default_target()
    drafter = EagleDrafter.from_pretrained(args.drafter)
    step = None
    if state is not None:
        dtype = drafter.fc.weight.dtype
        drafter.load_state_dict({k: v.to(dtype) for k, v in state["drafter"].items()})
        step = state["step"]
        print(f"weights of {args.train_state}, step {step}", flush=True)
    results = {"drafter": args.drafter, "train_state": args.train_state, "step": step,
               "max_new_tokens": args.max_new_tokens, "num_draft_tokens": args.num_draft_tokens,
               "target_dtype": str(target.dtype), "sets": {}}
    for name in args.sets.split(","):
        limit = args.limit if name == "mt_bench" or args.limit_others is None else args.limit_others
        prompts = load_prompt_set(name, limit=limit)
        start = time.perf_counter()
        stats = measure_acceptance(target, tok, drafter, prompts, args.max_new_tokens, args.num_draft_tokens)
        results["sets"][name] = {
            "prompts": len(prompts),
            "mean_acceptance_length": stats.mean_acceptance_length,
            "acceptance_per_position": stats.acceptance_per_position,
            "cycles": stats.cycles,
            "new_tokens": stats.new_tokens,
            "tokens_per_second": stats.tokens_per_second,
            "seconds": time.perf_counter() - start,
        }
        print(name, json.dumps(results["sets"][name]), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    print(markdown(results))


def markdown(results) -> str:
    lines = ["| prompt set | prompts | mean acceptance length (τ) | acceptance at draft position 1..5 |", "|---|---|---|---|"]
    for name, r in results["sets"].items():
        pos = ", ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        lines.append(f"| {name} | {r['prompts']} | {r['mean_acceptance_length']:.2f} | {pos} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
