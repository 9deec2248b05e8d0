"""Checks of command-line arguments that several commands share (`eagle_hf.cli`, `eagle_hf.training.cli`), run
before any model loads."""

from __future__ import annotations

import math
from pathlib import Path


def check_target_name(name: str) -> None:
    """A target that names a local folder must be a model folder (a Hub id is looked up when it loads)."""
    from .drafter.default import GEMMA3_270M

    if name in ("default", GEMMA3_270M):
        return
    path = Path(name).expanduser()
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        if not path.is_dir():
            raise FileNotFoundError(f"--target {name}: no such folder (pass a model folder, a Hub id or 'default').")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"--target {name}: not a model folder (no config.json).")


def check_temperature(args) -> None:
    """--temperature: 0 (greedy) or a positive number."""
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature {args.temperature}: must be 0 (greedy) or a positive number (sampling).")
