"""The speculation round's shape: the schedule asks a policy what a batch decides otherwise than a single row (no
branch on whether it is a batch)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECULATION = ROOT / "eagle_hf" / "speculation"


def test_speculation_has_no_batch_branches():
    """A batch's decisions are `policy.BatchPolicy`'s; the schedule asks its policy instead of `self.batch`."""
    found = [f"{p.name}:{n}" for p in sorted(SPECULATION.glob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bself\.batch\b", line)]
    assert not found, found
