#!/usr/bin/env python
"""Check eagle_hf on one device in one command and leave a report: versions, the test suite, greedy equality with
plain generate(), the loop's ceiling with a replay drafter, host-device syncs, where a round's time goes (profile),
memory, attention kernels and caches, quantized targets, and the sampling distribution. Nothing is downloaded: every model is random, built from a config.

    python scripts/device_check.py                                     # every stage, on cuda when there is one
    python scripts/device_check.py --only env,equality,sampling         # some stages; the report keeps earlier ones
    python scripts/device_check.py --device cpu --small --skip suite    # small shapes, on this CPU (a few minutes)

Writes ``<out>/report.md`` and ``<out>/report.json`` (plus ``trace.json.gz``, ``trace_<cell>.json.gz``,
``suite.log``, ``suite.xml``); the
report is rewritten after every stage, so a later failure or a kill leaves the earlier stages' findings. Each stage
has a time budget (``--budget-s``) and the whole run one more (``--total-s``): a stage that runs out records what
it skipped. An exception in a stage is recorded with its traceback; the next stage runs.

Where the installed transformers is older than eagle_hf's floor and ``.device/wheels`` holds wheels
(``scripts/device_wheels.sh``), the script unpacks those the installed packages cannot replace into
``.device/site`` and runs itself again with them first on the path. How to run it on a GPU machine:
docs/gpu.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ============================================================================ bootstrap (standard library only)
# Nothing outside the standard library is imported before the bootstrap has run: the package's __init__ files and
# its bootstrap module are standard library only. The stages: benchmarks/device_check/, one module each.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # benchmarks/ (and eagle_hf from the checkout)
from benchmarks.device_check.bootstrap import BOOT, bootstrap

if __name__ == "__main__":
    BOOT.update(bootstrap())  # re-executes this script when it unpacked carried wheels
    from benchmarks.device_check.cli import main  # after the bootstrap: torch, transformers, eagle_hf

    sys.exit(main())
