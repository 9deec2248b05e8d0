"""The bootstrap of scripts/device_check.py, run before transformers is imported: where the installed transformers
is older than eagle_hf's floor and ``.device/wheels`` holds wheels (``scripts/device_wheels.sh``), it unpacks those
the installed packages cannot replace into ``.device/site`` and runs the script again with them first on the path.

Standard library only (as are the package's ``__init__`` files): the script imports this module before the bootstrap
has run. The env stage records what it did (`BOOT`).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".device" / "wheels"
SITE = ROOT / ".device" / "site"
#: the oldest transformers eagle_hf is tested with (eagle_hf/hf/__init__.py); older: use the carried wheels
FLOOR = (5, 23)
_REEXEC = "EAGLE_HF_DEVICE_SITE"  # set in the re-executed process: what the bootstrap did, as JSON
#: what `bootstrap` did, filled in by scripts/device_check.py when it runs as a script (empty otherwise)
BOOT: dict = {}


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _carried() -> dict[str, Path]:
    """canonical name -> wheel in .device/wheels."""
    return {_canonical(p.name.split("-")[0]): p for p in sorted(WHEELS.glob("*.whl"))}


def _wheel_requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode("utf-8")
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def _runtime_checked(wheel: Path) -> list[str]:
    """What transformers checks at import besides its Requires-Dist: accelerate's and tokenizers' ranges when they
    are installed (transformers/dependency_versions_check.py)."""
    with zipfile.ZipFile(wheel) as z:
        table = z.read("transformers/dependency_versions_table.py").decode("utf-8")
    out = []
    for name in ("accelerate", "tokenizers"):
        m = re.search(rf'"{name}": "([^"]+)"', table)
        if m and _installed(name):
            out.append(m.group(1))
    return out


def plan_wheels() -> tuple[list[str], list[str]]:
    """Carried wheels to unpack: transformers and, recursively, every requirement the installed packages do not
    meet but a carried wheel does. Returns (wheel names, unmet requirements)."""
    from packaging.requirements import Requirement  # (packaging comes with pytest and transformers)

    carried = _carried()
    version = {n: p.name.split("-")[1] for n, p in carried.items()}
    chosen, unmet, queue = ["transformers"], [], ["transformers"]
    while queue:
        wheel = carried[queue.pop()]
        lines = _wheel_requires(wheel) + (_runtime_checked(wheel) if wheel.name.startswith("transformers-") else [])
        for line in lines:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            name = _canonical(req.name)
            if name in chosen:
                have = version[name]
            else:
                have = _installed(name)
                if have is not None and req.specifier.contains(have, prereleases=True):
                    continue
                if name in carried and req.specifier.contains(version[name], prereleases=True):
                    chosen.append(name)
                    queue.append(name)
                    continue
            if have is None or not req.specifier.contains(have, prereleases=True):
                unmet.append(f"{req} (installed {_installed(name)}, carried {version.get(name)})")
    return [carried[n].name for n in chosen], unmet


def bootstrap() -> dict:
    """Before transformers is imported: use the carried wheels where the installed transformers is too old.
    Returns what was done (recorded by the env stage); re-executes this script when it unpacked wheels."""
    if os.environ.get(_REEXEC):
        return json.loads(os.environ[_REEXEC])
    have = _installed("transformers")
    info = {"installed_transformers": have, "floor": ".".join(map(str, FLOOR)), "carried": sorted(p.name for p in
            WHEELS.glob("*.whl")), "unpacked": [], "unmet": [], "action": "none"}
    if have is not None and _release(have) >= FLOOR:
        info["action"] = "the installed transformers is in range; carried wheels unused"
        return info
    if "transformers" not in _carried():
        info["action"] = "transformers is below the floor and no wheels are carried (scripts/device_wheels.sh)"
        return info
    try:
        wheels, info["unmet"] = plan_wheels()
    except ImportError:  # no packaging: unpack everything carried
        wheels = [p.name for p in _carried().values()]
    shutil.rmtree(SITE, ignore_errors=True)
    SITE.mkdir(parents=True)
    for name in wheels:
        with zipfile.ZipFile(WHEELS / name) as z:
            z.extractall(SITE)
    info["unpacked"], info["action"] = wheels, f"unpacked {len(wheels)} carried wheels into .device/site"
    env = dict(os.environ, **{_REEXEC: json.dumps(info)})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), str(ROOT), env.get("PYTHONPATH", "")) if p)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)
