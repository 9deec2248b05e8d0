#!/usr/bin/env bash
# Issue 16: a matched EAGLE-3 / EAGLE-3.1 pair. Both drafters are trained from scratch on the same data (the
# shared answers and our regenerated ones, as scripts/train_warm_start.sh reads them), with the same budget,
# seed, held-out split and code path; the only difference is the two EAGLE-3.1 flags (`--eagle3` turns fc_norm
# and norm_output off).
#
#   VARIANT=eagle3  scripts/train_matched_pair.sh     # -> runs/pair_eagle3 (best drafter in runs/pair_eagle3/best)
#   VARIANT=eagle31 scripts/train_matched_pair.sh     # -> runs/pair_eagle31
# Resumable: rerun the same command (train_state.pt every 50 steps). In the background:
#   setsid nohup nice -n 19 env VARIANT=eagle3 scripts/train_matched_pair.sh > runs/pair_eagle3.log 2>&1 < /dev/null &
# Environment: VARIANT (required), MAX_STEPS (1200), LR (3e-4), THREADS (1). Extra arguments go to `eagle-hf train`.
#
# Issue 13's ablations at equal compute use the same recipe (the EAGLE-3.1 run above is their baseline):
#   OUT=runs/abl_noise VARIANT=eagle31 scripts/train_matched_pair.sh --feature-noise 0.1   # feature noise
#   OUT=runs/abl_original VARIANT=eagle31 DATA=original:3000 scripts/train_matched_pair.sh  # ShareGPT's own answers
# DATA=original:N trains on ShareGPT's original answers to N other prompts (`--responses sharegpt-original:N`),
# teacher-forced, instead of the target's regenerated answers.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${VARIANT:-}" in
  eagle3) FLAGS=(--eagle3) ;;
  eagle31) FLAGS=() ;;
  *) echo "set VARIANT=eagle3 or VARIANT=eagle31" >&2; exit 2 ;;
esac
OUT=${OUT:-runs/pair_${VARIANT}}
DATA_ARGS=(--data-dir runs/data/shared)
if [[ ! -d runs/data/shared ]]; then DATA_ARGS=(--responses data/smollm2_sharegpt_responses.jsonl.gz); fi
DATA_ARGS+=(--responses 'data/regenerated/sharegpt_first_turns_*')
case "${DATA:-regenerated}" in
  regenerated) ;;
  original:*) DATA_ARGS=(--responses "sharegpt-original:${DATA#original:}") ;;
  *) echo "DATA is regenerated (the default) or original:N" >&2; exit 2 ;;
esac
exec .venv/bin/eagle-hf -v train --target default ${FLAGS[@]+"${FLAGS[@]}"} \
  "${DATA_ARGS[@]}" \
  --data-root runs/data --out "$OUT" \
  --ttt-steps 5 --tokens-per-batch 1024 --lr "${LR:-3e-4}" --warmup-ratio 0.03 --max-steps "${MAX_STEPS:-1200}" \
  --eval-every 200 --eval-tokens 10000 --save-every 50 --threads "${THREADS:-1}" --seed 0 "$@"
