"""Drafters side by side on the drift diagnostic (EAGLE-3 vs EAGLE-3.1): τ per condition with paired
differences, and the per-depth curves of every drafter in one figure.

Works on `DriftReport.to_dict()` / drift.json data, so saved runs can be compared again without recomputing.
The pairing needs reports from one `diagnose_drafters` call (or runs over the same prompts and conditions):
each run (prompt, condition, system prompt) is replayed by every drafter over the same target path.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from ..files import save_figure, write_file

#: per-depth panels of the comparison figure: JSON key -> (title, y label)
PANELS = {
    "acceptance": ("P(draft accepted | depth reached)", "probability"),
    "attention_sink": ("Attention on the sink", "attention mass"),
    "attention_context": ("Attention on the verified context", "attention mass"),
    "attention_drafts": ("Attention on its own drafts", "attention mass"),
    "fed_back_norm": ("Norm of the fed-back hidden state", "mean L2 norm"),
}


def run_taus(data: dict) -> dict[tuple[str, str, str], float]:
    """Each run's τ (1 + accepted drafts per round), keyed by (condition, prompt id, variant)."""
    out = {}
    for r in data["runs"]:
        if "accepted" not in r:
            raise ValueError("These diagnostic results predate per-run acceptance counts: rerun `eagle-hf diagnose`.")
        if r["rounds"]:
            out[(r["condition"], r["prompt_id"], r["variant"])] = 1 + r["accepted"] / r["rounds"]
    return out


def compare(datas: dict[str, dict]) -> dict:
    """Per condition: each drafter's τ (pooled over rounds) and, for every drafter after the first (the
    reference), the paired difference of per-run τ against the reference: mean, standard error and the runs
    paired."""
    labels = list(datas)
    ref = labels[0]
    taus = {label: run_taus(d) for label, d in datas.items()}
    conditions = list(datas[ref]["conditions"])
    out = {"reference": ref, "conditions": {}}
    for cond in conditions:
        row = {"tau": {label: datas[label]["conditions"][cond]["tau"] for label in labels},
               "runs": {label: datas[label]["conditions"][cond]["runs"] for label in labels},
               "rounds": {label: datas[label]["conditions"][cond]["rounds"] for label in labels}, "paired": {}}
        for label in labels[1:]:
            keys = [k for k in taus[ref] if k[0] == cond and k in taus[label]]
            diffs = [taus[label][k] - taus[ref][k] for k in keys]
            row["paired"][label] = {"runs": len(diffs), "mean_difference": statistics.fmean(diffs) if diffs else None,
                                    "standard_error": _standard_error(diffs),
                                    "wins": sum(d > 0 for d in diffs), "losses": sum(d < 0 for d in diffs)}
        out["conditions"][cond] = row
    return out


def compare_markdown(datas: dict[str, dict]) -> str:
    """The comparison table: τ per condition per drafter, and each drafter's paired difference from the first."""
    result = compare(datas)
    labels, ref = list(datas), result["reference"]
    head = "| condition | runs | " + " | ".join(f"τ {label}" for label in labels)
    sep = "|---|---|" + "---|" * len(labels)
    for label in labels[1:]:
        head += f" | {label} − {ref}: mean paired Δτ ± 1.96 SE | runs better / worse"
        sep += "---|---|"
    lines = [head + " |", sep]
    for cond, row in result["conditions"].items():
        cells = [cond, str(row["runs"][ref])] + [_fmt(row["tau"][label], 3) for label in labels]
        for label in labels[1:]:
            p = row["paired"][label]
            half = None if p["standard_error"] is None else 1.96 * p["standard_error"]
            cells.append(f"{_fmt(p['mean_difference'], 3, signed=True)} ± {_fmt(half, 3)}")
            cells.append(f"{p['wins']} / {p['losses']}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_comparison(datas: dict[str, dict], path: str | Path) -> Path:
    """One figure: τ per condition (bars, ±1.96 standard errors of the per-run τ) and the per-depth panels, one
    colour per condition and one line style per drafter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(datas)
    first = datas[labels[0]]
    conditions = list(first["conditions"])
    depths = list(range(1, first["settings"]["depth"] + 1))
    colours = {c: f"C{i}" for i, c in enumerate(conditions)}
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    ax = axes[0][0]
    taus = {label: run_taus(d) for label, d in datas.items()}
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        heights, errors = [], []
        for cond in conditions:
            heights.append(datas[label]["conditions"][cond]["tau"] or float("nan"))
            values = [t for k, t in taus[label].items() if k[0] == cond]
            errors.append(1.96 * (_standard_error(values) or 0.0))
        ax.bar([i + j * width for i in range(len(conditions))], heights, width, yerr=errors, capsize=3,
               label=label, hatch=["", "//", "..", "xx"][j % 4], color=[colours[c] for c in conditions],
               edgecolor="black", alpha=0.85)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(conditions))], conditions)
    ax.set_ylabel("τ (mean acceptance length)")
    ax.set_ylim(bottom=1.0)
    ax.set_title("τ per condition (±1.96 SE over runs)", fontsize=10)
    ax.legend(fontsize=8)
    for ax, (key, (title, ylabel)) in zip([a for row in axes for a in row][1:], PANELS.items()):
        for j, label in enumerate(labels):
            for cond in conditions:
                values = datas[label]["conditions"][cond][key]
                ax.plot(depths, [float("nan") if v is None else v for v in values], styles[j % len(styles)],
                        color=colours[cond], marker="o", markersize=3, label=f"{label}: {cond}")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("draft depth")
        ax.set_ylabel(ylabel)
        ax.set_xticks(depths)
        ax.grid(alpha=0.3)
        if key == "acceptance":
            ax.set_ylim(0, 1.02)
        elif key.startswith("attention"):
            ax.set_ylim(bottom=0)
    axes[0][1].legend(fontsize=7)
    m = first["meta"]
    fig.suptitle(f"{' vs '.join(labels)} on {m['target']}: {m['prompts']} prompts, chain of {len(depths)}",
                 fontsize=11)
    fig.tight_layout()
    path = Path(path)
    try:
        save_figure(fig, path, dpi=90)
    finally:
        plt.close(fig)
    return path


def save_comparison(datas: dict[str, dict], out_dir: str | Path) -> Path:
    """compare.json, compare.md and comparison.png in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_file(out / "compare.json", json.dumps(compare(datas), indent=2, ensure_ascii=False))
    write_file(out / "compare.md", compare_markdown(datas))
    plot_comparison(datas, out / "comparison.png")
    return out


def _standard_error(values: list[float]) -> float | None:
    """Standard error of the mean (None below two values)."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None


def _fmt(x, digits: int, signed: bool = False) -> str:
    if x is None:
        return "–"
    return f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"
