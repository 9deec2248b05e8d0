"""Two versions of eagle_hf, one benchmark, alternating processes: the median of the pairs' ratios.

On a shared 2-core host a case's host time moves by a third from process to process, and within one process with
what ran before it. A figure that compares two versions is therefore a set of pairs: the other checkout's process
(``PYTHONPATH``), then this checkout's, back to back, N times; each pair's ratio (this / other), and their median.

    python benchmarks/alternate.py --other /path/to/checkout --pairs 3 --out runs/chain5 -- \\
        --only dynamic --modes "chain 5" --rows 1 --calls 7
    python benchmarks/alternate.py --other /path/to/checkout --pairs 3 --out runs/tree --key "host ms" \\
        --key "accept ms" -- --only static --modes "tree, depth 5" --rows 1 --calls 5 --split

Everything after ``--`` goes to `benchmarks/round_regime.py` (one case a process: see its ``--split``). Each
process's JSON and output stay in ``--out`` (``other_i.json``, ``this_i.json``); the summary is printed as markdown.
Times are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "round_regime.py"


def run(checkout: Path, args: list[str], json_path: Path, log_path: Path) -> dict:
    """One process of `round_regime.py` over `checkout`'s eagle_hf; its JSON's cases."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout), env.get("PYTHONPATH", "")) if p)
    with log_path.open("w") as log:
        subprocess.run([sys.executable, str(SCRIPT), *args, "--json", str(json_path)], env=env, stdout=log,
                       stderr=subprocess.STDOUT, check=True, cwd=HERE.parent)
    return json.loads(json_path.read_text())["cases"]


def summary(pairs: list[tuple[dict, dict]], keys: list[str]) -> list[str]:
    """Markdown rows: per case and key, the medians of both versions and of the pairs' ratios, and each ratio."""
    header = "| cache | mode | rows | figure | pairs | other (median) | this (median) | ratio (median of the pairs') |"
    lines = [header + " ratios |", "|---|---|---|---|---|---|---|---|---|"]  # (a case is "cache | mode | rows")
    for case in pairs[0][0]:
        for key in keys:
            got = [(o[case][key], t[case][key]) for o, t in pairs if o[case].get(key) and t[case].get(key)]
            if not got:
                continue
            ratios = [t / o for o, t in got]
            lines.append(f"| {case} | {key} | {len(got)} | {statistics.median(o for o, _ in got):.2f} | "
                         f"{statistics.median(t for _, t in got):.2f} | **{statistics.median(ratios):.2f}** | "
                         + ", ".join(f"{r:.2f}" for r in ratios) + " |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", type=Path, required=True, help="the other version's checkout (its eagle_hf/)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True, help="a folder for each process's JSON and output")
    parser.add_argument("--key", action="append", default=None,
                        help="a figure of the JSON to compare (repeatable; default: host ms)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then round_regime.py's arguments")
    options = parser.parse_args()
    args = options.args[1:] if options.args[:1] == ["--"] else options.args
    options.out.mkdir(parents=True, exist_ok=True)
    pairs = []
    for i in range(1, options.pairs + 1):
        other = run(options.other, args, options.out / f"other_{i}.json", options.out / f"other_{i}.txt")
        this = run(HERE.parent, args, options.out / f"this_{i}.json", options.out / f"this_{i}.txt")
        pairs.append((other, this))
        print(f"pair {i} of {options.pairs} done", file=sys.stderr, flush=True)
    print("\n".join(summary(pairs, options.key or ["host ms"])))


if __name__ == "__main__":
    main()
