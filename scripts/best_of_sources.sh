#!/usr/bin/env bash
# Issue 35's benchmark: every set in its own `eagle-hf bench` process call, greedy bf16, 20 prompts, 128 new tokens;
# process 1 with two repeats, process 2 with one (a separate process: fresh costs, EAGLE_HF_COST_CACHE=off), then
# the comparison (scripts/best_of_sources.py). Usage: bash scripts/best_of_sources.sh OUT "SETS" "SETS_TWICE" "LATER"
# (LATER: sets run in process 1 only, after process 2; about 11 minutes a set and process on a 2-core CPU)
set -euo pipefail
out=${1:-/tmp/best_of_sources}; sets=${2:-"translation questions math_word rag extraction"}
twice=${3:-$sets}; later=${4:-"sum code_edit multi_turn"}
modes="prompt-lookup,copy alone,eagle alone,eagle default"
export EAGLE_HF_COST_CACHE=off HF_HUB_OFFLINE=1
for s in $sets; do
  .venv/bin/eagle-hf bench --dtype bfloat16 --prompts "$s" --limit 20 --max-new-tokens 128 --repeats 2 \
    --modes "$modes" --out "$out/p1/$s"
done
for s in $twice; do
  .venv/bin/eagle-hf bench --dtype bfloat16 --prompts "$s" --limit 20 --max-new-tokens 128 --repeats 1 \
    --modes "$modes" --out "$out/p2/$s"
done
for s in $later; do
  .venv/bin/eagle-hf bench --dtype bfloat16 --prompts "$s" --limit 20 --max-new-tokens 128 --repeats 2 \
    --modes "$modes" --out "$out/p1/$s"
done
echo done
