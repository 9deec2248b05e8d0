"""Speedup over plain batched generate() against batch size, from `eagle-hf bench --batch-size B` results.

    .venv/bin/python scripts/plot_batch_bench.py docs/results/bench_batch_b{1,4,8,16}.json --out docs/results/bench_batch.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="results.json files of bench runs at different batch sizes")
    p.add_argument("--out", default="bench_batch.png")
    args = p.parse_args()
    runs = sorted((json.loads(Path(f).read_text()) for f in args.results), key=lambda r: r["settings"].get("batch_size", 1))
    sizes = [r["settings"].get("batch_size", 1) for r in runs]
    fig, axes = plt.subplots(1, len(runs[0]["sets"]), figsize=(5 * len(runs[0]["sets"]), 3.6), squeeze=False)
    for ax, set_name in zip(axes[0], runs[0]["sets"]):
        for mode in [m for m in runs[0]["settings"]["modes"] if m != "plain"]:
            ax.plot(sizes, [r["sets"][set_name][mode]["speedup_median"] for r in runs], marker="o", label=mode)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(0.95, color="grey", lw=0.6, ls="--", label="0.95x (the floor)")
        low, high = ax.get_ylim()
        ax.set_ylim(min(low, 0.85), max(high, 1.15))  # a scale on which a few per cent look like a few per cent
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("batch size")
        ax.set_ylabel("speedup over plain batched generate()")
        ax.set_title(set_name)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
