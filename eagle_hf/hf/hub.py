"""The Hub-hostable ``custom_generate/`` folder: EAGLE drafting for ``generate(custom_generate=<repo>)``."""

from __future__ import annotations

import shutil
from pathlib import Path


def write_custom_generate(folder) -> str:
    """Copy the Hub-hostable `custom_generate/` strategy (and its README) into `folder`; returns the folder."""
    src = Path(__file__).resolve().parents[1] / "hub_template"
    dst = Path(folder)
    shutil.copytree(src / "custom_generate", dst / "custom_generate", dirs_exist_ok=True)
    if not (dst / "README.md").exists():
        shutil.copy(src / "README.md", dst / "README.md")
    return str(dst)
