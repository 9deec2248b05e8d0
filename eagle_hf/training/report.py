"""Training curve (PNG) and model card (README.md with Hub metadata) of a trained drafter."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

from ..files import save_figure, write_file

logger = logging.getLogger(__name__)


def read_log(out: Path) -> list[dict]:
    """The rows of a run's log: ``out`` is the run folder (its ``training_log.jsonl``) or the log file itself (or
    a gzipped copy, ``.jsonl.gz``). A last line cut short (a full disk, a crash while appending) is dropped with a
    warning; a damaged line before it is an error naming the file and the line."""
    path = Path(out)
    if path.is_dir():
        path = path / "training_log.jsonl"
    if not path.exists():
        return []
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    lines = [line for line in raw.decode("utf-8", errors="replace").splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except ValueError as err:
            row, why = None, str(err)
        else:
            why = "" if isinstance(row, dict) and isinstance(row.get("step"), int) else "no step"
        if why and number == len(lines):
            logger.warning("The last line of %s is cut short (%s); it is dropped.", path, why)
            break
        if why:
            raise ValueError(f"{path}, line {number}: not a row of a training log ({why}). Delete that line, or "
                             "the file (the log restarts from the resumed step).")
        rows.append(row)
    return rows


def plot_curve(out: Path, name: str = "training_curve.png") -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed; skipping the training curve (pip install matplotlib)")
        return None
    rows = read_log(out)
    if not rows:
        return None
    train_rows = [r for r in rows if "loss" in r]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    ax1.plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows], lw=0.8)
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("TTT loss (weighted sum over steps)")
    ax1.set_yscale("log")
    ax1.set_title("training loss")
    evals = [r for r in rows if "eval_step_accuracy" in r]
    if evals:
        n_steps = len(evals[0]["eval_step_accuracy"])
        for k in range(n_steps):
            ax2.plot([r["step"] for r in evals], [r["eval_step_accuracy"][k] if k < len(r["eval_step_accuracy"]) else None
                                                 for r in evals], marker=".", label=f"step {k}")
        ax2.set_ylabel("held-out accuracy (draft argmax = target argmax)")
        ax2.legend(fontsize=7)
    ax2.set_xlabel("optimizer step")
    ax2.set_title("per-step accuracy (held out)")
    taus = [r for r in evals if "eval_tau" in r]
    if taus:
        ax3.plot([r["step"] for r in taus], [r["eval_tau"] for r in taus], marker=".")
        best = max(taus, key=lambda r: r["eval_tau"])
        ax3.scatter([best["step"]], [best["eval_tau"]], color="red", zorder=3, label=f"kept: step {best['step']}")
        ax3.legend(fontsize=7)
    ax3.set_xlabel("optimizer step")
    ax3.set_ylabel("τ = 1 + mean accepted drafts")
    ax3.set_title("held-out acceptance length (greedy chain)")
    fig.tight_layout()
    path = Path(out) / name
    try:
        save_figure(fig, path, dpi=110)
    finally:
        plt.close(fig)
    return path


def write_model_card(out: Path, target_name: str, config, result: dict, coverage: float,
                     acceptance_table: str | None = None, notes: str = "") -> Path:
    """README.md with Hub metadata: what the drafter is, how to load it, its training and acceptance."""
    version = config.version
    evals = result.get("eval_step_accuracy") or []
    acc = ", ".join(f"{a:.2f}" for a in evals)
    best = result.get("best") or {}
    tau = f"{best['eval_tau']:.3f} (step {best['step']})" if best.get("eval_tau") is not None else "not evaluated"
    card = f"""---
base_model: {target_name}
library_name: eagle-hf
tags:
- eagle3
- speculative-decoding
- {'eagle-3.1' if config.is_eagle31 else 'eagle-3'}
datasets:
- anon8231489123/ShareGPT_Vicuna_unfiltered
pipeline_tag: text-generation
---

# {version} drafter for {target_name}

A speculative-decoding draft head (one decoder layer reading three of the target's hidden states) trained with
[eagle_hf](https://github.com/) on answers the target itself wrote to ShareGPT prompts (self-distillation).
It loads in `eagle_hf`, vLLM and SGLang (EAGLE-3 layout, `LlamaForCausalLMEagle3`; EAGLE-3.1 flags
`fc_norm={config.fc_norm}`, `norm_output={config.norm_output}`).

```python
import eagle_hf
from eagle_hf import EagleDrafter
drafter = EagleDrafter.from_pretrained("<this repo or folder>")
out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=256)
```

| setting | value |
|---|---|
| draft vocabulary | {config.draft_vocab_size} tokens ({100 * coverage:.2f}% of assistant tokens in the training data) |
| training-time-test steps | {result.get('config', {}).get('ttt_steps', 'see training_log.jsonl')} |
| optimizer steps | {result.get('step')} |
| held-out per-step accuracy | {acc} |
| held-out acceptance length τ (greedy chain, TTT-style) | {tau} |

{acceptance_table or ''}

{notes}
"""
    path = Path(out) / "README.md"
    write_file(path, card)
    return path
