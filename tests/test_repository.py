"""What the repository holds: data a user has (inside the package or the checkout), no chunk still being written."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return out.splitlines()


def test_no_chunk_being_written_is_tracked():
    assert not [f for f in tracked() if f.endswith(".partial")]


def test_library_code_reads_nothing_outside_the_package():
    """A path a user passes, or a file of the package: never a folder beside the checkout."""
    outside = re.compile(r"\.\./shared|[\"']shared[\"']|parents\[[2-9]\]")
    found = [f"{p.relative_to(ROOT)}:{n}" for p in (ROOT / "eagle_hf").rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if outside.search(line)]
    assert not found, found


def test_the_answered_idx_the_package_ships_are_those_of_the_answers_file():
    with gzip.open(ROOT / "data" / "smollm2_sharegpt_responses.jsonl.gz", "rt") as f:
        idx = sorted(int(json.loads(line)["idx"]) for line in f if line.strip())
    shipped = json.loads((ROOT / "eagle_hf" / "data" / "sharegpt_answered_idx.json").read_text())["idx"]
    assert shipped == idx and len(idx) == 1872
