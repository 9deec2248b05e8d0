#!/usr/bin/env bash
# Continue the shipped drafter (eagle_hf/assets/smollm2-135m-eagle3.1) on the new data of issue 13: a warm start
# on the shared answers (captured in runs/data/shared) and our regenerated ones (data/regenerated, captured into
# runs/data/<chunk>-<key>, only what grew is recaptured), checkpoint selection by held-out acceptance length.
#
# Resumable: rerun the same command (train_state.pt every 50 steps; the best drafter so far is in $OUT/best).
# Runs in the foreground; in the background:
#   mkdir -p runs/warm31 && nohup nice -n 19 scripts/train_warm_start.sh > runs/warm31/train.log 2>&1 &
#   echo $! > runs/warm31/train.pid      # pause: kill -STOP $(cat runs/warm31/train.pid); resume: kill -CONT
#   tail -f runs/warm31/train.log        # or: tail -f runs/warm31/training_log.jsonl (one JSON row per step)
# Environment: OUT (runs/warm31), MAX_STEPS (3000), LR (1e-4), THREADS (1: 3-5x faster than 2 on this shared
# 2-core machine, see docs/training.md), ORIGINAL=N adds ShareGPT's original answers (sharegpt-original:N).
# Extra arguments are passed to `eagle-hf train`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/warm31}
# the shared answers are still being captured by a background job: wait for it (its pid in runs/capture.pid)
if [[ -f runs/capture.pid ]] && kill -0 "$(cat runs/capture.pid)" 2>/dev/null; then
  echo "waiting for the capture of runs/data/shared (pid $(cat runs/capture.pid)) to finish..."
  while kill -0 "$(cat runs/capture.pid)" 2>/dev/null; do sleep 60; done
fi
# the shared answers: captured already on this machine (runs/data/shared), or captured now from ../shared (a new
# machine; resumable per shard under runs/data). runs/ is not committed: a new machine starts from step 0.
SHARED_ARGS=(--data-dir runs/data/shared)
if [[ ! -d runs/data/shared ]]; then SHARED_ARGS=(--responses data/smollm2_sharegpt_responses.jsonl.gz); fi
ORIGINAL_ARGS=()
if [[ -n "${ORIGINAL:-}" ]]; then ORIGINAL_ARGS=(--responses "sharegpt-original:${ORIGINAL}"); fi
exec .venv/bin/eagle-hf -v train --target default --init-from default \
  "${SHARED_ARGS[@]}" --responses 'data/regenerated/sharegpt_first_turns_*' ${ORIGINAL_ARGS[@]+"${ORIGINAL_ARGS[@]}"} \
  --data-root runs/data --out "$OUT" \
  --ttt-steps 5 --tokens-per-batch 1024 --lr "${LR:-1e-4}" --warmup-ratio 0.03 --max-steps "${MAX_STEPS:-3000}" \
  --eval-every 200 --eval-tokens 10000 --save-every 50 --threads "${THREADS:-1}" --seed 0 "$@"
