"""Held-out τ over training for the matched EAGLE-3 / EAGLE-3.1 pair (issue 16; scripts/train_matched_pair.sh).

    python benchmarks/pair_training_curve.py [--runs runs/pair_eagle3 runs/pair_eagle31] [--out docs/results/drift_ablation/pair_training.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def evals(run: Path) -> list[tuple[int, float]]:
    """(step, held-out τ) of every evaluation in a run's training_log.jsonl."""
    out = []
    for line in (run / "training_log.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "eval_tau" in row:
            out.append((row["step"], row["eval_tau"]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", default=["runs/pair_eagle3", "runs/pair_eagle31"], help="training runs")
    p.add_argument("--out", default="docs/results/drift_ablation/pair_training.png", help="the PNG")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for run in map(Path, args.runs):
        config = json.loads((run / "train_run.json").read_text())
        label = "EAGLE-3.1" if config.get("eagle31", True) else "EAGLE-3"
        points = evals(run)
        ax.plot([s for s, _ in points], [t for _, t in points], marker="o", label=f"{label} ({run.name})")
        print(label, " ".join(f"{s}:{t:.3f}" for s, t in points))
    ax.set_xlabel("optimizer step (1024 padded tokens each)")
    ax.set_ylabel("held-out τ (chain of 5, TTT-style)")
    ax.set_title("Matched pair: same data, budget, seed; flags differ", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100)
    print("written", args.out)


if __name__ == "__main__":
    main()
