"""The drafter's scaling curve (issue 13): acceptance against answer tokens seen in training.

    .venv/bin/python benchmarks/scaling_curve.py \
        --run docs/results/scaling_logs/warm31.jsonl.gz:1.09e6:3.7e5 \
        --run docs/results/scaling_logs/warm_regen.jsonl.gz:2.34e6:8.08e5 \
        --measured 1.09e6:1.58 --measured <tokens>:<tau> --out docs/results/scaling.png

Each ``--run LOG:START:EPOCH_TOKENS`` is a warm-started run's ``training_log.jsonl`` (or a copy of it): its
held-out τ (the run's own estimate: teacher-forced 5-step accuracy on 2% of its answers) at every evaluation,
placed at ``START + epoch * EPOCH_TOKENS`` answer tokens (START: what its initial drafter had seen). Held-out τ of
different runs is not comparable in level (each run holds out its own split); the slope within a run is. MT-bench
τ (`scripts/evaluate_drafter.py`: chain of 5, greedy, 256 new tokens) where it was measured, extrapolated along
the least-squares line in log(tokens) to the issue's target (τ 2.5): a rough guide, not a prediction.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from eagle_hf.training.report import read_log

TARGET_TAU = 2.5


def held_out_points(log: str, start: float, epoch_tokens: float):
    """[(answer tokens seen, held-out τ, step)] at every evaluation of one run."""
    rows = read_log(log)
    if not rows:
        raise SystemExit(f"--run {log}: no training log there (pass a run's training_log.jsonl)")
    epoch_at = {r["step"]: r["epoch"] for r in rows if "epoch" in r}
    return [(start + epoch_at.get(r["step"], 0.0) * epoch_tokens, r["eval_tau"], r["step"])
            for r in rows if "eval_tau" in r]


def log_linear_fit(points):
    """Least squares τ = a + b·ln(tokens) over the measured points: (a, b)."""
    xs = [math.log(t) for t, _ in points]
    ys = [tau for _, tau in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--run", action="append", required=True,
                   help="LOG:START_TOKENS:EPOCH_TOKENS, a warm-started run's training_log.jsonl (repeatable)")
    p.add_argument("--measured", action="append", default=[], help="TOKENS:TAU, an MT-bench measurement")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    measured = sorted((float(t), float(tau)) for t, tau in (m.split(":") for m in args.measured))

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    print("| run | answer tokens seen | held-out τ | step |\n|---|---|---|---|")
    for i, spec in enumerate(args.run):
        log, start, epoch_tokens = spec.rsplit(":", 2)
        points = held_out_points(log, float(start), float(epoch_tokens))
        name = Path(log).parent.name if Path(log).name == "training_log.jsonl" else Path(log).stem
        ax.plot([x for x, _, _ in points], [y for _, y, _ in points], "o-", ms=3, color=f"C{i}",
                label=f"held-out τ, run {name} (teacher-forced, 5 steps)")
        for x, y, step in points:
            print(f"| {name} | {x / 1e6:.2f}M | {y:.3f} | {step} |")
    if measured:
        ax.plot(*zip(*measured), "s", color="C3", label="MT-bench τ (chain of 5, greedy, 256 tokens)")
    if len(measured) >= 2:
        a, b = log_linear_fit(measured)
        if b > 0:
            need = math.exp((TARGET_TAU - a) / b)
            x0 = measured[0][0]
            ax.plot([x0, need], [a + b * math.log(x0), TARGET_TAU], ":", color="C3",
                    label=f"log-linear fit, extrapolated: τ {TARGET_TAU} at {need / 1e6:,.0f}M")
            print(f"\nMT-bench τ per doubling of tokens (fit over {len(measured)} points): {b * math.log(2):.3f}; "
                  f"τ {TARGET_TAU} at about {need / 1e6:,.0f}M answer tokens on this line")
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
