#!/usr/bin/env bash
# Download the wheels that let scripts/device_check.py run on a GPU machine without network whose transformers is
# older than eagle_hf's floor. Run it where a package registry is reachable and copy `.device/wheels` to the GPU
# machine with the checkout. device_check.py unpacks there only the wheels whose
# requirement the installed packages do not meet (docs/gpu.md).
#
#   bash scripts/device_wheels.sh            # -> .device/wheels/*.whl (ignored by git), prints the total size
#
# What is downloaded: transformers at the version installed in .venv and, at their .venv versions, its runtime
# requirements (and theirs) for CPython 3.12 on x86-64 Linux, except those the machine's own transformers 5.17
# already requires with the same range (tokenizers, safetensors, regex, numpy, typer and what typer pulls in) and
# torch. Pure-Python wheels where they exist; hf-xet and pyyaml are binary (abi3 / cp312 manylinux) wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=.device/wheels
mkdir -p "$OUT"
rm -f "$OUT"/*.whl

# name==version of every package to carry, from .venv's installed metadata
mapfile -t PINS < <("$PY" - <<'EOF'
import importlib.metadata as md
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# the GPU machine: CPython 3.12 on x86-64 Linux
TARGET = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
          "platform_machine": "x86_64", "platform_system": "Linux", "os_name": "posix", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "platform_release": "", "platform_version": "", "extra": ""}
# there already, with a version transformers 5.17 accepts and ours accepts too (same ranges in both METADATA files)
SKIP = {"torch", "numpy", "tokenizers", "safetensors", "regex", "typer", "rich", "pygments", "markdown-it-py", "mdurl",
        "shellingham", "pydantic", "pydantic-core", "annotated-types", "annotated-doc", "typing-inspection"}
pins, queue = {}, ["transformers"]
while queue:
    name = canonicalize_name(queue.pop())
    if name in pins or name in SKIP:
        continue
    dist = md.distribution(name)
    pins[name] = dist.version
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(TARGET):
            queue.append(req.name)
for name, version in sorted(pins.items()):
    print(f"{name}=={version}")
EOF
)
echo "carrying: ${PINS[*]}"

"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$OUT" "${PINS[@]}"

ls -la "$OUT"
total=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
echo "total: $((total / 1024 / 1024)) MiB in $(ls "$OUT"/*.whl | wc -l) wheels"
if [ "$total" -gt $((40 * 1024 * 1024)) ]; then
    echo "too large to travel beside the working tree (64 MiB in all)" >&2
    exit 1
fi
