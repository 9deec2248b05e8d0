#!/usr/bin/env bash
# The default against each single draft source (docs/benchmarks.md): every set in its own `eagle-hf bench` process
# call, greedy bf16, 20 prompts, 128 new tokens; process 1 with two repeats, process 2 with one (a separate process:
# fresh costs, EAGLE_HF_COST_CACHE=off), then the comparison (benchmarks/best_of_sources.py). REPEATS=1: one repeat
# in each process (the A/A band and the choice of the best single source then come from the two processes).
#   bash benchmarks/best_of_sources.sh OUT "SETS" "SETS_TWICE" "LATER"
# (LATER: sets run in process 1 only, after process 2; 10-25 minutes a set and process on a 2-core CPU). Sets already
# measured under OUT are kept; a file OUT/pause holds the next set back (to run something else on a quiet machine).
set -euo pipefail
out=${1:-/tmp/best_of_sources}; sets=${2:-"translation questions math_word rag extraction"}
twice=${3:-$sets}; later=${4-"sum code_edit multi_turn"}
modes="prompt-lookup,copy alone,eagle alone,eagle default"; repeats=${REPEATS:-2}  # process 1's repeats
export EAGLE_HF_COST_CACHE=off HF_HUB_OFFLINE=1
run() {  # process, set, repeats: a set already measured is kept; while $out/pause exists, wait between sets
  while [ -e "$out/pause" ]; do sleep 5; done
  [ -e "$out/$1/$2/results.json" ] && return 0
  .venv/bin/eagle-hf bench --dtype bfloat16 --prompts "$2" --limit 20 --max-new-tokens 128 --repeats "$3" \
    --modes "$modes" --out "$out/$1/$2"
}
for s in $sets; do run p1 "$s" "$repeats"; done
for s in $twice; do run p2 "$s" 1; done
for s in $later; do run p1 "$s" "$repeats"; done
echo done
