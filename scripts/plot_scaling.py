"""The drafter's scaling curve (issue 13): acceptance against answer tokens seen in training.

    .venv/bin/python scripts/plot_scaling.py --log runs/warm31/training_log.jsonl \
        --start-tokens 1.09e6 --epoch-tokens 3.7e5 \
        --measured 1.09e6:1.58 --measured <tokens>:<tau> --out docs/results/scaling.png

Held-out τ (the training run's own estimate: teacher-forced 5-step accuracy on 2% of its answers) at every
evaluation of a warm-started run, placed at ``start_tokens + epoch * epoch_tokens`` answer tokens; MT-bench τ
(`scripts/evaluate_drafter.py`: chain of 5, greedy, 256 new tokens) where it was measured. The MT-bench points are
extrapolated along a line in log(tokens) to the issue's target (τ 2.5): a rough guide, not a prediction.
"""

from __future__ import annotations

import argparse
import json
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

TARGET_TAU = 2.5


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--log", required=True, help="training_log.jsonl of the warm-started run")
    p.add_argument("--start-tokens", type=float, required=True, help="answer tokens the initial drafter had seen")
    p.add_argument("--epoch-tokens", type=float, required=True, help="answer tokens in one epoch of the run's data")
    p.add_argument("--measured", action="append", default=[], help="TOKENS:TAU, an MT-bench measurement")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    with open(args.log, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    evals = [r for r in rows if "eval_tau" in r]
    epoch_at = {r["step"]: r["epoch"] for r in rows if "epoch" in r}
    held_x = [args.start_tokens + epoch_at.get(r["step"], 0.0) * args.epoch_tokens for r in evals]
    held_y = [r["eval_tau"] for r in evals]
    measured = sorted((float(t), float(tau)) for t, tau in (m.split(":") for m in args.measured))

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(held_x, held_y, "o-", ms=3, label="held-out τ (teacher-forced, 5 steps)")
    if measured:
        ax.plot(*zip(*measured), "s-", color="C3", label="MT-bench τ (chain of 5, greedy, 256 tokens)")
    print("| answer tokens seen | held-out τ | step |\n|---|---|---|")
    for x, y, r in zip(held_x, held_y, evals):
        print(f"| {x / 1e6:.2f}M | {y:.3f} | {r['step']} |")
    if len(measured) >= 2:
        (x0, y0), (x1, y1) = measured[0], measured[-1]
        slope = (y1 - y0) / (math.log(x1) - math.log(x0))  # τ per e-fold of tokens
        if slope > 0:
            need = x1 * math.exp((TARGET_TAU - y1) / slope)
            ax.plot([x1, need], [y1, TARGET_TAU], ":", color="C3", label=f"log-linear extrapolation: {need / 1e6:.0f}M")
            print(f"\nMT-bench τ per doubling of tokens: {slope * math.log(2):.3f}; τ {TARGET_TAU} at about "
                  f"{need / 1e6:.0f}M answer tokens on this line")
    ax.axhline(TARGET_TAU, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("answer tokens seen in training (log scale)")
    ax.set_ylabel("τ (tokens per target forward)")
    ax.set_title("SmolLM2-135M EAGLE-3.1 drafter: acceptance against training data")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
