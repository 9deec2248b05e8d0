"""Docs and notebooks cannot rot: every code block in README.md and docs/ runs on the embedded default (or says
on its first line why it is not run here), and every notebook in examples/ runs top to bottom with its outputs
stripped in git (on the short settings it takes from EAGLE_HF_QUICK_NOTEBOOKS: the same cells, fewer tokens)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "demo" / "README.md"]
NOTEBOOKS = sorted((ROOT / "examples").glob("*.ipynb"))
SKIP_MARK = "not run by the tests:"  # first line of a block that cannot run here, followed by the reason
BLOCK = re.compile(r"^```(python|bash)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def code_blocks(path: Path) -> list[tuple[str, str]]:
    return [(lang, body) for lang, body in BLOCK.findall(path.read_text(encoding="utf-8"))]


def runnable(path: Path, lang: str) -> list[str]:
    return [body for kind, body in code_blocks(path) if kind == lang and SKIP_MARK not in body.splitlines()[0]]


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", MPLBACKEND="Agg")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_every_block_runs_or_says_why_not():
    for path in DOCS:
        for lang, body in code_blocks(path):
            first = body.splitlines()[0] if body.strip() else ""
            if SKIP_MARK in first:
                reason = first.split(SKIP_MARK, 1)[1].strip()
                assert reason, f"{path.name}: a skipped block must say why: {first!r}"
    # the docs promise runnable examples: make sure the runner sees them
    assert runnable(ROOT / "docs" / "usage.md", "python") and runnable(ROOT / "docs" / "quickstart.md", "python")


def test_the_benchmarks_page_stays_a_reference():
    """docs/benchmarks.md keeps within 400 lines: detail tables go to docs/results/, linked from the page."""
    lines = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 400, f"docs/benchmarks.md has {lines} lines; move a detail table to docs/results/ and link it"


DOCS_WITH_PYTHON = [p for p in DOCS if runnable(p, "python")]
DOCS_WITH_BASH = [p for p in DOCS if runnable(p, "bash")]


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS_WITH_PYTHON, ids=lambda p: p.name)
def test_python_blocks_run(doc, tmp_path):
    """The runnable python blocks of one page, in order, as one script (later blocks use earlier names)."""
    script = "\n\n".join(runnable(doc, "python"))
    (tmp_path / "blocks.py").write_text(script)
    proc = subprocess.run([sys.executable, "blocks.py"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=900, check=False)
    assert proc.returncode == 0, f"{doc.name} code blocks failed:\n{proc.stderr[-4000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS_WITH_BASH, ids=lambda p: p.name)
def test_bash_blocks_run(doc, tmp_path):
    for body in runnable(doc, "bash"):
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=tmp_path, env=_env(), capture_output=True,
                              text=True, timeout=900, check=False)
        assert proc.returncode == 0, f"{doc.name} block failed:\n{body}\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_outputs_are_stripped_and_it_starts_with_the_install_cell(nb):
    data = json.loads(nb.read_text(encoding="utf-8"))
    code = [c for c in data["cells"] if c["cell_type"] == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), f"{nb.name} has outputs"
    assert "pip" in "".join(code[0]["source"]), f"{nb.name}: the first code cell must install eagle_hf"


@pytest.mark.slow
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(nb, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(nb, as_version=4)
    old = dict(os.environ)
    os.environ.update(_env(), EAGLE_HF_QUICK_NOTEBOOKS="1")  # the same cells on short settings (fewer tokens, steps)
    try:
        nbclient.NotebookClient(notebook, timeout=1800,  # (a cell: the training notebook's run)
                                kernel_name="python3",
                                resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    nbformat.write(notebook, tmp_path / nb.name)  # the executed copy, to look at with --basetemp
    errors = [o for c in notebook.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
