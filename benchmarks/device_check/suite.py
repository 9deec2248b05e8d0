"""The suite stage: the test suite with its models on the device (EAGLE_HF_TEST_DEVICE): counts and the heads of
failures (suite.log, suite.xml), interrupted with SIGINT at the budget so the counts so far survive."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

from .bootstrap import BOOT, ROOT, SITE
from .common import Budget, Context, StageResult


def stage_suite(ctx: Context, budget: Budget) -> StageResult:
    """The test suite with its models on the device (EAGLE_HF_TEST_DEVICE); stopped by SIGINT at the budget."""
    res = StageResult()
    xml, log = ctx.out / "suite.xml", ctx.out / "suite.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", f"--junitxml={xml}",
           "--maxfail=40", "--ignore=tests/test_device_check.py"]
    if importlib.util.find_spec("pytest_timeout"):
        cmd.append("--timeout=300")
    cmd += ctx.args.suite_args or ["tests"]
    env = dict(os.environ, EAGLE_HF_TEST_DEVICE=str(ctx.device), HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in ([str(SITE)] if BOOT.get("unpacked") else []) + [
        str(ROOT), env.get("PYTHONPATH", "")] if p)
    xml.unlink(missing_ok=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=max(budget.left() - 20, 10))
        except subprocess.TimeoutExpired:
            res["status"] = "partial"
            res.find(f"the suite ran out of its {budget.seconds:.0f} s budget: interrupted (counts so far)")
            proc.send_signal(signal.SIGINT)  # pytest writes its summary and the junit file on an interrupt
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    tail = log.read_text(errors="replace").splitlines()
    counts, failures = _junit(xml)
    res["data"] = {"command": " ".join(cmd), "counts": counts, "failures": failures, "log tail": tail[-15:]}
    if failures and res["status"] == "ok":
        res["status"] = "failed"
    res["summary"] = (", ".join(f"{v} {k}" for k, v in counts.items()) if counts else "no junit report") + \
        f" (exit code {proc.returncode}; full log: suite.log)"
    return res


def _junit(xml: Path) -> tuple[dict, list[dict]]:
    if not xml.is_file():
        return {}, []
    import xml.etree.ElementTree as ET

    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failures = []
    for case in suite.iter("testcase"):
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            text = (bad.get("message") or bad.text or "").strip().splitlines()
            failures.append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": bad.tag,
                             "head": " / ".join(text[:3])[:300]})
    return counts, failures
