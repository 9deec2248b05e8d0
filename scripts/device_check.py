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

import argparse
import contextlib
import dataclasses
import gzip
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import zipfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".device" / "wheels"
SITE = ROOT / ".device" / "site"
#: the oldest transformers eagle_hf is tested with (eagle_hf/hf/__init__.py); older: use the carried wheels
FLOOR = (5, 23)
_REEXEC = "EAGLE_HF_DEVICE_SITE"  # set in the re-executed process: what the bootstrap did, as JSON

STAGES = ("env", "suite", "equality", "replay", "compiled", "sync", "profile", "memory", "kernels", "quant", "sampling")
#: seconds per stage: (full shapes on a GPU, --small)
#: (full shapes: a few stages at a time fit ten minutes, docs/gpu.md)
BUDGETS = {"env": (30, 30), "suite": (540, 900), "equality": (200, 120), "replay": (300, 120), "compiled": (300, 240), "sync": (120, 90), "profile": (120, 60),
           "memory": (130, 60), "kernels": (210, 120), "quant": (120, 90), "sampling": (120, 120)}


# ============================================================================ bootstrap (standard library only)
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


BOOT = bootstrap() if __name__ == "__main__" else {}
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tests/numerics.py: the numerics rule shared with the test suite
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numerics
import torch


# ============================================================================ shapes
@dataclasses.dataclass(frozen=True)
class Shapes:
    target: dict  # the real-shape target (bf16): speed, syncs, memory, kernels, bf16 equality
    draft_vocab: int
    f32: dict  # the float32 target of the equality checks
    f32_draft_vocab: int
    contexts: tuple[int, ...]  # replay: context lengths
    batches: tuple[int, ...]  # replay: rows
    new_tokens: int  # replay / memory: tokens generated per call
    repeats: int  # replay: timed runs per mode (medians)
    equality_prompts: int
    equality_new: int
    long_context: int  # memory
    memory_batches: tuple[int, ...]
    memory_calls: int
    samples: int  # sampling: draws per mode
    sample_rows: int  # sampling: rows per call
    quant: dict  # the bitsandbytes target


LLAMA31_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=16384)
FULL = Shapes(
    target=LLAMA31_8B, draft_vocab=32000,  # the published EAGLE-3 drafter for Llama-3.1-8B: 32k drafts with d2t
    f32=dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
             intermediate_size=3584, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=16384),
    f32_draft_vocab=32000, contexts=(1024, 8192), batches=(1, 4, 16), new_tokens=96, repeats=3,
    equality_prompts=6, equality_new=48, long_context=8192, memory_batches=(1, 8), memory_calls=20,
    samples=20000, sample_rows=2000,
    quant=dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
               intermediate_size=5632, vocab_size=128256, max_position_embeddings=4096),
)
SMALL = Shapes(
    target=dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
                intermediate_size=512, vocab_size=4096, max_position_embeddings=4096),
    draft_vocab=1024,
    f32=dict(hidden_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=256, vocab_size=4096, max_position_embeddings=4096),
    f32_draft_vocab=1024, contexts=(64, 256), batches=(1, 4), new_tokens=24, repeats=2,
    equality_prompts=3, equality_new=20, long_context=512, memory_batches=(1, 2), memory_calls=5,
    samples=1200, sample_rows=400,
    quant=dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
               intermediate_size=512, vocab_size=4096, max_position_embeddings=4096),
)

#: how eagle_hf is asked for each mode (docs/usage.md); constant schedules draft every round
CHAIN = dict(draft_mode="chain", num_assistant_tokens=5)
TREE = dict(draft_mode="tree", num_assistant_tokens_schedule="constant")
MODES = {"chain": CHAIN, "tree": TREE, "default": {}}


# ============================================================================ the report
class Report:
    """report.json (everything) and report.md (for people), rewritten after every stage; stages of an earlier run
    in the same folder are kept unless run again."""

    def __init__(self, out: Path, mirrors: list[Path], meta: dict):
        self.out, self.mirrors = out, mirrors
        out.mkdir(parents=True, exist_ok=True)
        old = out / "report.json"
        self.stages: dict = json.loads(old.read_text())["stages"] if old.is_file() else {}
        self.meta = meta

    def record(self, name: str, result: dict) -> None:
        self.stages[name] = result
        self.write()

    def write(self) -> None:
        data = {"meta": self.meta, "stages": {k: self.stages[k] for k in STAGES if k in self.stages}}
        (self.out / "report.json").write_text(json.dumps(data, indent=1, default=str))
        (self.out / "report.md").write_text(self.markdown(data))
        for mirror in self.mirrors:
            mirror.mkdir(parents=True, exist_ok=True)
            for f in self.out.iterdir():
                if f.is_file():
                    shutil.copy2(f, mirror / f.name)

    @staticmethod
    def markdown(data: dict) -> str:
        meta = data["meta"]
        head = (f"{meta.get('device_name')} ({meta.get('device')}); torch {meta.get('torch')}, transformers "
                f"{meta.get('transformers')}; {'small' if meta.get('small') else 'full'} shapes; run "
                f"{meta.get('started')}. Command: `{meta.get('command')}`")
        lines = ["# eagle_hf device check", "", head, ""]
        lines += ["| stage | status | seconds | summary |", "|---|---|---|---|"]
        for name, r in data["stages"].items():
            lines.append(f"| {name} | {r.get('status')} | {r.get('seconds', 0):.0f} | {_cell(r.get('summary', ''))} |")
        for name, r in data["stages"].items():
            lines += ["", f"## {name}: {r.get('status')}", "", r.get("summary", "")]
            if r.get("findings"):
                lines += [""] + [f"- {f}" for f in r["findings"]]
            for key, value in (r.get("data") or {}).items():
                lines += ["", f"**{key}**", "", *_render(value)]
            if r.get("error"):
                lines += ["", "```", r["error"].rstrip(), "```"]
        return "\n".join(lines) + "\n"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _render(value) -> list[str]:
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        keys = list(dict.fromkeys(k for v in value for k in v))
        return ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)] + [
            "| " + " | ".join(_cell(v.get(k, "")) for k in keys) + " |" for v in value]
    if isinstance(value, dict) and all(not isinstance(v, (dict, list)) for v in value.values()):
        return ["| key | value |", "|---|---|"] + [f"| {k} | {_cell(v)} |" for k, v in value.items()]
    text = json.dumps(value, indent=1, default=str)
    return ["```json", text[:4000] + ("\n..." if len(text) > 4000 else ""), "```"]


class Budget:
    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.perf_counter()

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)

    def allows(self, estimate: float = 0.0) -> bool:
        return self.left() > estimate


class StageResult(dict):
    """status ("ok", "failed": a check failed, "skipped", "partial": the budget ran out, "error"), summary,
    findings (sentences), data (tables and numbers)."""

    def __init__(self):
        super().__init__(status="ok", summary="", findings=[], data={})

    def find(self, text: str) -> None:
        self["findings"].append(text)


# ============================================================================ models and calls
class Context:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.small = args.small
        self.shapes = SMALL if args.small else FULL
        self.out = Path(args.out)
        self.cuda = self.device.type == "cuda"
        self._models: dict = {}
        self.ran: list[str] = []  # stages run before the current one, in this process
        self.report: Report | None = None
        self.stage = ""

    def partial(self, res: StageResult) -> None:
        """Write what the running stage has so far (a kill of a long stage keeps it)."""
        if self.report is not None:
            self.report.record(self.stage, dict(res, status="running", summary="(running) " + res.get("summary", "")))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def pair(self, kind: str):
        """(target, drafter), built once per process: "bf16" (the real shape) or "f32" (the equality shape)."""
        if kind not in self._models:
            s = self.shapes
            shape, dtype, vocab = (s.target, torch.bfloat16, s.draft_vocab) if kind == "bf16" else (
                s.f32, torch.float32, s.f32_draft_vocab)
            target = build_target(shape, dtype, self.device, seed=0)
            self._models[kind] = (target, build_drafter(target, vocab, seed=1))
        return self._models[kind]

    def drop(self, kind: str) -> None:
        self._models.pop(kind, None)
        if self.cuda:
            torch.cuda.empty_cache()


def build_target(shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0, attn: str = "sdpa"):
    """A random Llama of `shape`, initialised on `device` in `dtype` (no host copy, no download)."""
    import transformers as tf

    config = tf.LlamaConfig(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    with torch.device(device):
        model = tf.LlamaForCausalLM._from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model.eval()


def build_drafter(target, draft_vocab: int, seed: int = 1, eagle31: bool = False):
    """A random drafter of the published EAGLE-3 shape for `target`: the target's width and heads, one layer, a
    `draft_vocab`-row lm_head with a valid random `d2t` (every target id it maps to is distinct)."""
    from eagle_hf import EagleDrafter

    device = target.get_input_embeddings().weight.device
    torch.manual_seed(seed)
    with torch.device(device):
        drafter = EagleDrafter.for_target(target, draft_vocab_size=draft_vocab, eagle31=eagle31)
    if drafter.d2t is not None:
        used = draft_ids(drafter.config.vocab_size, draft_vocab, seed)
        drafter.d2t.copy_((used - torch.arange(draft_vocab)).to(device))
        drafter.t2d.zero_()
        drafter.t2d[used.to(device)] = True
    return drafter.to(device).eval()


def draft_ids(vocab: int, draft_vocab: int, seed: int) -> torch.Tensor:
    """The target ids `build_drafter` gives a drafter of `draft_vocab` drafts (sorted; all ids when equal)."""
    if draft_vocab >= vocab:
        return torch.arange(vocab)
    return torch.sort(torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:draft_vocab]).values


def prompts(rows: int, lengths: list[int] | int, vocab: int, seed: int, device, repeat: bool = False):
    """Left-padded random prompts (ids, mask). `repeat`: each prompt ends with a copy of its first quarter, so copy
    drafting has something to copy."""
    g = torch.Generator().manual_seed(seed)
    lengths = [lengths] * rows if isinstance(lengths, int) else lengths
    width = max(lengths)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for r, n in enumerate(lengths):
        p = torch.randint(1, vocab, (n,), generator=g)
        if repeat and n >= 8:
            q = n // 4
            p[n - q:] = p[:q]
        ids[r, width - n:], mask[r, width - n:] = p, 1
    return ids.to(device), mask.to(device)


def generate(target, ids, mask, new: int, drafter=None, **kwargs):
    """generate() with a drafter (EAGLE) or without (plain); greedy unless kwargs say otherwise."""
    kwargs.setdefault("do_sample", False)
    if drafter is not None:
        kwargs["assistant_model"] = drafter
    with torch.no_grad():
        return target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, **kwargs)


def sequences(out):
    return getattr(out, "sequences", out)


def parse_cells(spec: str) -> list[tuple[int, int]]:
    """"8192x1,1024x4" -> [(8192, 1), (1024, 4)]: (context, batch) cells, in the order given."""
    return [tuple(int(x) for x in cell.split("x")) for cell in spec.split(",") if cell]


def save_trace(prof, path: Path) -> None:
    """The profiler's chrome trace, gzipped at `path` (``*.json.gz``)."""
    raw = path.with_suffix("")  # *.json
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as f, gzip.open(path, "wb") as g:
        shutil.copyfileobj(f, g)
    raw.unlink()


def loop_rounds(st) -> int:
    """The call's rounds after the prefill: a batch's merged stats add its rows' rounds, the loop ran the
    longest row's (one verify forward a round for all rows)."""
    return max(r.steps for r in st.per_row) if st.per_row else st.steps


def timed(ctx: Context, fn, *args, **kwargs):
    """fn(*args, **kwargs) and its wall time, the device synchronised before and after."""
    ctx.sync()
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    ctx.sync()
    return out, time.perf_counter() - start


def last_stats():
    import eagle_hf

    return eagle_hf.last_stats()


@contextlib.contextmanager
def eagle_logs():
    """Log records of the "eagle_hf" logger inside the block (what mode ran, fallbacks)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger("eagle_hf")
    handler, level = Keep(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def mode_ran(records) -> str:
    """The mode an EAGLE call ran, from its log ("EAGLE generate (tree): ..."), and whether it fell back."""
    messages = [r.getMessage() for r in records]
    ran = next((m.split("(", 1)[1].split(")", 1)[0] for m in messages if m.startswith("EAGLE generate (")), "?")
    fallback = any("falling back to chain" in m for m in messages)
    return f"{ran} (fallback from tree)" if fallback else ran


def out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


# ============================================================================ stages
def stage_env(ctx: Context, budget: Budget) -> StageResult:
    """Versions first: torch, the device, transformers (and whether carried wheels replaced it)."""
    import transformers

    import eagle_hf
    from eagle_hf.hf.version import SUPPORTED_TRANSFORMERS, check_transformers_version

    res = StageResult()
    d = {
        "python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "device": str(ctx.device),
        "transformers": transformers.__version__, "transformers_file": transformers.__file__,
        "eagle_hf_file": eagle_hf.__file__, "cpu_count": os.cpu_count(),
        "supported_transformers": f">={SUPPORTED_TRANSFORMERS[0]},<{SUPPORTED_TRANSFORMERS[1]}",
    }
    for name in ("accelerate", "safetensors", "huggingface_hub", "tokenizers", "packaging", "pytest", "pytest-timeout",
                 "scipy", "numpy", "triton", "bitsandbytes", "flash_attn", "flash-attn", "kernels"):
        d[f"pkg {name}"] = _installed(name)
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        d.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                 memory_gib=round(props.total_memory / 2**30, 1), sdp_flash=torch.backends.cuda.flash_sdp_enabled(),
                 sdp_mem_efficient=torch.backends.cuda.mem_efficient_sdp_enabled(),
                 sdp_cudnn=getattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: None)(),
                 allow_tf32_matmul=torch.backends.cuda.matmul.allow_tf32, allow_tf32_cudnn=torch.backends.cudnn.allow_tf32)
    res["data"] = {"versions": d, "carried wheels": BOOT or {"action": "not run as a script"}}
    if BOOT.get("unpacked"):
        res.find(f"transformers {BOOT['installed_transformers']} is below {BOOT['floor']}: using the carried "
                 f"{transformers.__version__} ({len(BOOT['unpacked'])} wheels unpacked: {', '.join(BOOT['unpacked'])})")
    for unmet in BOOT.get("unmet", []):
        res.find(f"a requirement of the carried wheels is not met: {unmet}")
    if _release(torch.__version__) < (2, 6):
        res["status"] = "failed"
        res.find(f"torch {torch.__version__}: transformers 5.24 disables PyTorch below 2.6 (no model can be built)")
    try:
        check_transformers_version()
    except Exception as err:  # noqa: BLE001 - recorded
        res["status"] = "failed"
        res.find(f"eagle_hf refuses this transformers: {err}")
    res["summary"] = (f"torch {torch.__version__} (CUDA {torch.version.cuda}), {d.get('device_name', ctx.device)}, "
                      f"transformers {transformers.__version__}")
    return res


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


def stage_equality(ctx: Context, budget: Budget) -> StageResult:
    """Greedy equality with plain generate(): float32 (TF32 off) must be exact up to near-ties; bf16 counts."""
    res = StageResult()
    s = ctx.shapes
    rows, bf16_rows = [], []
    target, drafter = ctx.pair("f32")
    vocab = target.config.vocab_size
    lengths = [int(x) for x in torch.linspace(16 if ctx.small else 64, 64 if ctx.small else 512, s.equality_prompts)]
    with numerics.exact_matmuls():
        for i, n in enumerate(lengths):
            if not budget.allows(10):
                res.find(f"budget: float32 equality stopped after {i} of {len(lengths)} prompts")
                res["status"] = "partial"
                break
            ids, mask = prompts(1, n, vocab, seed=100 + i, device=ctx.device, repeat=i % 2 == 1)
            rows += _compare(target, drafter, ids, mask, s.equality_new, f"prompt {i} ({n} tokens)", MODES, judge=True)
        if budget.allows(10):  # a left-padded batch of 3 rows of different lengths
            ids, mask = prompts(3, [lengths[0], lengths[-1], (lengths[0] + lengths[-1]) // 2], vocab, seed=7,
                                device=ctx.device, repeat=True)
            rows += _compare(target, drafter, ids, mask, s.equality_new, "batch of 3, left-padded", MODES, judge=True)
    ctx.drop("f32")
    res["data"]["float32"] = rows
    ctx.partial(res)
    bugs = [r for r in rows if r["verdict"] == "bug"]
    near = [r for r in rows if r["verdict"] == "numerics"]
    # bf16 at the real shape: a count of differing outputs, beside transformers' own prompt lookup
    target, drafter = ctx.pair("bf16")
    vocab = target.config.vocab_size
    bf16_modes = dict(MODES, **{"prompt lookup (transformers)": dict(prompt_lookup_num_tokens=5)})
    for i, n in enumerate(lengths):
        if not budget.allows(15):
            res.find(f"budget: bf16 comparison stopped after {i} of {len(lengths)} prompts")
            res["status"] = "partial"
            break
        ids, mask = prompts(1, n, vocab, seed=200 + i, device=ctx.device, repeat=i % 2 == 1)
        bf16_rows += _compare(target, drafter, ids, mask, s.equality_new, f"prompt {i} ({n} tokens)", bf16_modes,
                              judge=False)
    per_mode = Counter(r["mode"] for r in bf16_rows if not r["equal"])
    totals = Counter(r["mode"] for r in bf16_rows)
    res["data"] = {"float32": rows, "bf16 differing outputs": {m: f"{per_mode[m]} of {totals[m]}" for m in totals},
                   "bf16": bf16_rows}
    for r in bugs:
        res.find(f"BUG: float32 {r['case']} {r['mode']} row {r['row']} differs at new token {r['step']} with top-2 "
                 f"margin {r['margin']:.3g} (>= {numerics.NUMERICS_MARGIN})")
    for r in near:
        res.find(f"float32 near-tie (numerics): {r['case']} {r['mode']} at new token {r['step']}, margin {r['margin']:.2e}")
    if bugs:
        res["status"] = "failed"
    res["summary"] = (f"float32: {sum(r['equal'] for r in rows)} of {len(rows)} outputs equal, {len(bugs)} bugs, "
                      f"{len(near)} near-ties; bf16 differing: " + ", ".join(f"{m} {per_mode[m]}/{totals[m]}"
                                                                          for m in totals))
    return res


def _compare(target, drafter, ids, mask, new: int, case: str, modes: dict, judge: bool) -> list[dict]:
    """One prompt (or batch): plain generate() with its logits, then each mode; a row per mode and batch row."""
    ref = generate(target, ids, mask, new, output_logits=True, return_dict_in_generate=True)
    out = []
    for mode, kwargs in modes.items():
        uses_drafter = "prompt_lookup_num_tokens" not in kwargs
        with eagle_logs() as records:
            got = generate(target, ids, mask, new, drafter if uses_drafter else None, **kwargs)
        mism = {m.row: m for m in numerics.compare_greedy(sequences(ref), sequences(got), ids.shape[1], ref.logits,
                                                          judge=judge)}
        stats = last_stats() if uses_drafter else None
        for row in range(ids.shape[0]):
            m = mism.get(row)
            out.append({"case": case, "mode": mode, "ran": mode_ran(records) if uses_drafter else "transformers",
                        "row": row, "equal": m is None, "step": m.step if m else None,
                        "margin": m.margin if m else None, "verdict": m.verdict if m else "equal",
                        "accepted": stats.accepted if stats else None, "cycles": stats.cycles if stats else None})
    return out


@contextlib.contextmanager
def choosers_of(make):
    """Every drafted row's chooser made by ``make(drafter, top_k, row, position, root)`` (`position`: the row's
    next real position in the drafter's cache, `root`: its tree's root token), in place of the call's own. Patches
    eagle_hf.speculation.speculator.draft_trees, the seam the tests patch too (tests/conftest.py, patch_drafts)."""
    import inspect

    from eagle_hf.speculation import speculator as speculation

    original = speculation.draft_trees
    signature = inspect.signature(original)

    def draft_trees(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        slots = list(range(a["state"].rows)) if a["rows"] is None else a["rows"]
        a["choosers"] = [make(a["drafter"], a["top_k"], b, a["state"].positions[b], root)
                         for b, root in zip(slots, a["roots"])]
        return original(*bound.args, **bound.kwargs)

    speculation.draft_trees = draft_trees
    try:
        yield
    finally:
        speculation.draft_trees = original


@contextlib.contextmanager
def replay_drafts(truth: list[list[int]]):
    """The replay drafter: the real drafter runs (its cost is real) but each row's chooser puts the target's own
    greedy continuation (`truth`, per row, in the row's positions) first, with probability 1, beside the drafter's
    own top-k: a chain is the continuation, a tree holds it as its deepest branch and the drafter's other
    proposals around it. Every draft on the continuation is accepted: the loop's ceiling (`choosers_of`; greedy
    calls only). Yields counts of drafted trees ("replayed", "unmatched": the row has left the recorded continuation)."""
    from eagle_hf.speculation.drafting import Choice

    counts = Counter()

    def _replay_chooser(drafter, top_k, row, position, root):
        seq = truth[row] if row < len(truth) and position < len(truth[row]) and truth[row][position] == root else None
        seq = seq or next((t for t in truth if position < len(t) and t[position] == root), None)
        counts["replayed" if seq is not None else "unmatched"] += 1

        def choose(logits, paths):
            top = torch.topk(torch.log_softmax(logits.float(), dim=-1), top_k, dim=-1)
            tokens, logp = drafter.draft_to_target(top.indices), top.values  # [k, top_k]
            for i, path in enumerate(paths):
                j = position + 1 + len(path)
                if seq is None or j >= len(seq) or seq[position + 1: j] != list(path):
                    continue
                others = [t for t in tokens[i].tolist() if t != seq[j]]
                tokens[i] = torch.tensor([seq[j], *others][:top_k], device=tokens.device)
                logp[i, 0] = 0.0  # probability 1: the branch is kept and grown to the full depth
            return Choice(tokens, logp)

        return choose

    with choosers_of(_replay_chooser):  # (in place of any chooser: transformers' loop passes one for its chain)
        yield counts


def cycle_target(shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0, gain: float = 1.0,
                 within: torch.Tensor | None = None):
    """A random Llama whose next token is a fixed function of the current one, ``succ[token]``, by a wide margin:
    returns (target, succ on the host). `succ` is one cycle through `within` (target ids, e.g. a drafter's draft
    vocabulary: a continuation that starts there stays there) and one through the other ids. Every layer still
    runs at its full cost, but its output projections are scaled down (o_proj, down_proj x 0.01) and the token
    embeddings up (x 50), so the residual stream is the current token's embedding plus a little; the output head's
    row ``succ[t]`` is token t's unit embedding times `gain`. The successor's logit is then about
    ``gain * sqrt(hidden)`` against others of spread `gain`: at the 8B shape (gain 1) a margin of ~60 that bf16
    never flips, so identical calls give identical output and every draft tree that holds the continuation
    matches it (the tree's ceiling). A small `gain` spreads the distribution (the sampling checks)."""
    target = build_target(shape, dtype, device, seed=seed)
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(seed + 7)
    inside = torch.zeros(vocab, dtype=torch.bool)
    if within is not None:
        inside[within.cpu()] = True
    succ = torch.empty(vocab, dtype=torch.long)
    for group in (torch.nonzero(inside)[:, 0], torch.nonzero(~inside)[:, 0]):
        if len(group):
            ring = group[torch.randperm(len(group), generator=g)]
            succ[ring] = ring.roll(-1)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.01)
            layer.mlp.down_proj.weight.mul_(0.01)
        emb = target.model.embed_tokens.weight
        emb.mul_(50.0)
        unit = emb.float() / emb.float().norm(dim=-1, keepdim=True).clamp_min(1e-6)  # [V, H] (pad's: 0)
        head = torch.empty_like(unit)
        head[succ.to(unit.device)] = unit * gain  # row succ[t]: token t's direction
        target.lm_head.weight.copy_(head.to(target.lm_head.weight.dtype))
    return target, succ


def draft_vocabulary(drafter) -> torch.Tensor:
    """The target ids a drafter can propose (``draft + d2t[draft]``), on the host."""
    ids = torch.arange(drafter.config.draft_vocab_size)
    return ids if drafter.d2t is None else ids + drafter.d2t.cpu()


#: per oracle case: its tensors and the drafter's graphs captured with it (`oracle_drafter`)
_ORACLES: dict[tuple, list] = {}


@contextlib.contextmanager
def oracle_drafter(drafter, succ: torch.Tensor, corrupt: float = 0.0, seed: int = 0, rows: int = 1,
                   length: int = 16384):
    """The drafter's own logits follow a `cycle_target`'s continuation: each pass adds 1e4 to the draft logit of
    ``succ[token]`` for the token each row reads (it predicts the next position's), so the drafter's top choice
    is the continuation with probability ~1 and its other top-k are its own. Every path of eagle_hf runs as with a
    real drafter: choices on the device or the host, chains and trees, CUDA graphs (captured with the oracle in
    them), sampling (q is the drafter's distribution). With `corrupt` = r the continuation's token at a
    (row, position) is withheld with probability r (a fixed hash of the two: every run and mode loses the same
    positions), so a chain's acceptance falls as (1 - r) a level: the acceptance curve."""
    import random

    from eagle_hf.drafter import graphs
    from eagle_hf.speculation.drafting import DraftState
    from eagle_hf.speculation.transfer import to_device

    device = drafter.fc.weight.device
    case = (id(drafter), id(succ), corrupt, seed, rows, length)
    if case not in _ORACLES:  # (kept: the drafter's graphs captured with this oracle read these tensors)
        draft_of = torch.full((succ.numel(),), -1, dtype=torch.long)
        draft_of[draft_vocabulary(drafter)] = torch.arange(drafter.config.draft_vocab_size)
        nxt = draft_of[succ].to(device)  # [V] the draft id of each token's successor (-1: not in the draft vocabulary)
        held = torch.tensor([[random.Random(f"{seed}:{r}:{p}").random() < corrupt for p in range(length)]
                             for r in range(rows)], device=device) if corrupt > 0 else None  # [rows, length]
        _ORACLES[case] = [nxt, held, None]
    nxt, held, kept_graphs = _ORACLES[case]
    def bonus(logits: torch.Tensor, tokens: torch.Tensor, child_positions: torch.Tensor) -> torch.Tensor:
        """logits [..., Vd] for rows that read `tokens` [...], their children at `child_positions` [...]."""
        target = nxt[tokens]
        ok = target >= 0
        if held is not None:
            at = child_positions.clamp(max=length - 1).reshape(tokens.shape[0], -1)
            ok = ok & ~held[: tokens.shape[0]].gather(1, at).reshape(target.shape)
        ok = ok[..., None]
        return logits + torch.zeros_like(logits).scatter_(-1, target.clamp(min=0)[..., None], 1e4) * ok

    before = drafter.__dict__.get("step")
    step = drafter.step

    def oracle_step(hidden, input_ids, position_ids, past=None, mask=None, compute_logits=True):
        # row t reads token input_ids[t] at position position_ids[t] + 1: its child sits one further
        out = step(hidden, input_ids, position_ids, past=past, mask=mask, compute_logits=compute_logits)
        if out.logits is None:
            return out
        return dataclasses.replace(out, logits=bonus(out.logits, input_ids, position_ids + 2))

    extend = DraftState.extend

    def oracle_extend(state, draft_model, aux, next_tokens, counts=None):  # the catch-up's logits: the first level
        positions = list(state.positions)
        logits, hidden = extend(state, draft_model, aux, next_tokens, counts)
        if draft_model is not drafter:
            return logits, hidden
        n = next_tokens.shape[1]
        counts = counts or [n] * len(positions)
        last = to_device(torch.tensor([[max(c, 1) - 1] for c in counts]), next_tokens.device)  # [B, 1]
        child = to_device(torch.tensor([p + c + 1 for p, c in zip(positions, counts)]), next_tokens.device)
        return bonus(logits, next_tokens.gather(1, last)[:, 0], child), hidden

    # the graphs captured with this oracle (a timed run replays its warm-up's), not those of another case
    graphs._PER_DRAFTER.pop(drafter, None)
    if kept_graphs is not None:
        graphs._PER_DRAFTER[drafter] = kept_graphs
    drafter.step, DraftState.extend = oracle_step, oracle_extend
    try:
        yield
    finally:
        DraftState.extend = extend
        _ORACLES[case][2] = graphs._PER_DRAFTER.pop(drafter, None)
        if before is None:
            del drafter.step
        else:
            drafter.step = before


def stage_replay(ctx: Context, budget: Budget) -> StageResult:
    """The loop's ceiling: chain 3/5/8 and a tree with a replay drafter against plain generate() (interleaved
    runs after a warm-up, medians), per context length and batch size, with the round's time split."""
    res = StageResult()
    s = ctx.shapes
    target, drafter = ctx.pair("bf16")
    vocab = target.config.vocab_size
    modes = {f"chain {k}": dict(draft_mode="chain", num_assistant_tokens=k, draft_sources="eagle") for k in (3, 5, 8)}
    modes["tree (depth 5, top-k 4, 16 tokens)"] = dict(TREE, draft_sources="eagle")
    cells = [(c, b) for b in s.batches for c in s.contexts]
    cells.sort(key=lambda cb: (cb[1] > 1, cb[0] > s.contexts[0], cb[1]))  # batch 1 first, then the short context
    if ctx.args.replay_cells:  # CONTEXTxBATCH,... in the order given
        cells = parse_cells(ctx.args.replay_cells)
    table, last_cell = [], 0.0
    for ctx_len, rows in cells:
        if not budget.allows(last_cell * 1.2 + 5):
            res.find(f"budget: skipped context {ctx_len} x batch {rows}")
            res["status"] = "partial"
            continue
        start = time.perf_counter()
        try:
            table += _replay_cell(ctx, target, drafter, vocab, ctx_len, rows, modes, budget)
        except Exception as err:
            if not out_of_memory(err):
                raise
            res.find(f"context {ctx_len} x batch {rows}: out of memory ({str(err).splitlines()[0][:160]})")
            torch.cuda.empty_cache() if ctx.cuda else None
        last_cell = time.perf_counter() - start
        res["data"] = {"speed": table}
        ctx.partial(res)
    res.find("times per round (from the last timed run): ms_per_round = median time / rounds (a batch's: its "
             "longest row's, one verify forward each); drafter = eagle_hf's "
             "own drafter clock (stats.drafter_time), rest = the target's "
             "verify forward plus bookkeeping; host clocks, on a GPU only approximate (no device sync per call)")
    off = [r for r in table if r.get("timed_runs_off_table")]
    if off:
        res.find(f"{len(off)} modes' timed runs left the output their warm-up reached (identical calls, different "
                 "bf16 output: timed_runs_off_table, first_off_column); their tau is not a ceiling")
    unequal = [r for r in table if r.get("equal") is False]
    if unequal:
        res.find(f"{len(unequal)} replay runs differ from plain greedy output (bf16 near-ties, see equality): each "
                 "mode replays its own output, found in up to three warm-up runs (fixed_point: found)")
    untimed = [r for r in table if r["mode"] != "plain" and not r.get("runs")]
    if untimed:
        res.find(f"{len(untimed)} modes warmed up but never timed (the budget): warmup_s says where it went")
    best = max((r for r in table if r["mode"] != "plain" and r.get("runs")), key=lambda r: r["speedup"], default=None)
    res["summary"] = (f"{len(table)} rows; best {best['mode']} at context {best['context']} x batch {best['batch']}: "
                      f"{best['speedup']:.2f}x plain (tau {best['tau']:.2f})" if best else "no measurements")
    return res


def _replay_cell(ctx, target, drafter, vocab, ctx_len, rows, modes, budget) -> list[dict]:
    s = ctx.shapes
    ids, mask = prompts(rows, ctx_len, vocab, seed=ctx_len + rows, device=ctx.device)
    plain_out, _ = timed(ctx, generate, target, ids, mask, s.new_tokens)  # also the plain warm-up
    times = {m: [] for m in ["plain", *modes]}
    info, truths = {}, {}
    truth: list[list[int]] = []  # what the replay drafter proposes; per mode, its own output (below)
    with replay_drafts(truth) as counts:
        for mode, kwargs in modes.items():  # warm-up: each mode's replay table, to its fixed point
            truth[:] = [t.tolist() for t in plain_out]  # no padding: a row's positions are its columns
            start = time.perf_counter()
            for tries in range(1, 4):
                # bf16: a verify forward over many tokens rounds differently from a one-token step, so a random
                # model's near-ties flip and the mode leaves plain's continuation; replaying the mode's own
                # output instead reproduces it (every draft on it accepted), usually after one more run
                out, _ = timed(ctx, generate, target, ids, mask, s.new_tokens, drafter, **kwargs)
                if out.tolist() == truth:
                    break
                truth[:] = [t.tolist() for t in out]
                if not budget.allows(4 * (time.perf_counter() - start) / tries):  # no room for another try and the
                    break  # timed runs: time what was found (a batch of 16 at the 8B shape spent 180 s here)
            truths[mode] = [list(t) for t in truth]
            info[mode] = dict(equal=bool(torch.equal(out, plain_out)), fixed_point=out.tolist() == truth,
                              warmup_s=round(time.perf_counter() - start, 1))
        for _ in range(s.repeats):
            if not budget.allows(5):
                break
            for mode, t_list in times.items():
                kwargs = modes.get(mode)
                if kwargs is not None:
                    truth[:] = truths[mode]
                    counts.clear()
                got, t = timed(ctx, generate, target, ids, mask, s.new_tokens,
                               drafter if kwargs is not None else None, **(kwargs or {}))
                t_list.append(t)
                if kwargs is not None and got.tolist() != truths[mode]:  # left the table it found in the warm-up
                    info[mode]["off_table"] = info[mode].get("off_table", 0) + 1
                    flat = [t for row in truths[mode] for t in row]
                    first = next(i for i, (x, y) in enumerate(zip(got.flatten().tolist(), flat)) if x != y)
                    info[mode]["first_off"] = min(info[mode].get("first_off", 1 << 30), first % got.shape[1])
                if kwargs is not None:  # the round's split, from a timed (warm) run
                    st = last_stats()
                    info[mode].update(tau=st.mean_acceptance_length, rounds=loop_rounds(st) + 1, drafter=st.drafter_time,
                                      total=st.total_time, replayed=counts["replayed"], unmatched=counts["unmatched"])
    plain = statistics.median(times["plain"]) if times["plain"] else float("nan")
    out = [{"context": ctx_len, "batch": rows, "mode": "plain", "median_s": plain, "runs": len(times["plain"]),
            "tok_per_s": rows * s.new_tokens / plain, "speedup": 1.0, "tau": 1.0}]
    for mode in modes:
        med = statistics.median(times[mode]) if times[mode] else float("nan")
        i = info[mode]
        if "rounds" not in i:  # warmed up, never timed: where the budget went
            out.append({"context": ctx_len, "batch": rows, "mode": mode, "runs": 0, "warmup_s": i["warmup_s"]})
            continue
        out.append({"context": ctx_len, "batch": rows, "mode": mode, "median_s": med, "runs": len(times[mode]),
                    "tok_per_s": rows * s.new_tokens / med, "speedup": plain / med, "tau": i["tau"],
                    "rounds": i["rounds"], "ms_per_round": 1e3 * med / i["rounds"],
                    "drafter_ms_per_round": 1e3 * i["drafter"] / i["rounds"],
                    "rest_ms_per_round": 1e3 * (i["total"] - i["drafter"]) / i["rounds"],
                    "plain_ms_per_token": 1e3 * plain / s.new_tokens, "equal": i["equal"],
                    "fixed_point": i["fixed_point"], "replayed_trees": i["replayed"],
                    "unmatched_trees": i["unmatched"], "timed_runs_off_table": i.get("off_table", 0),
                    "first_off_column": i.get("first_off"), "warmup_s": i["warmup_s"]})
    return out


def stage_compiled(ctx: Context, budget: Budget) -> StageResult:
    """EAGLE against what a speed-minded user runs: plain generate() with a static cache and transformers'
    automatic compile. On a `cycle_target` (identical calls give identical output) with `oracle_drafter`: chain
    3/5/8, the tree and the default at full acceptance, then the acceptance curve (drafts withheld at set rates)
    for chain 5 and the default, per CONTEXTxBATCH cell (`--compiled-cells`), interleaved timed runs after a
    warm-up, medians; speedups over compiled plain in the same cell, and the eager plain step beside it. Graphs
    compiled after the warm-up are counted (0: nothing recompiles in the timed runs)."""
    res = StageResult()
    s = ctx.shapes
    for kind in ("bf16", "f32"):
        ctx.drop(kind)  # (room for the oracle target: the earlier stages' pairs are not needed again)
    within = draft_ids(s.target["vocab_size"], s.draft_vocab, seed=22)  # (the cycle the drafter can propose)
    target, succ = cycle_target(s.target, torch.bfloat16, ctx.device, seed=21, within=within)
    drafter = build_drafter(target, s.draft_vocab, seed=22)
    drafter.bind_target_embedding(target.get_input_embeddings())  # (generate() does it; the level benchmark first)
    compiled = ctx.cuda or ctx.args.compile_cpu
    if not compiled:
        res.find("compiled rows ran the static cache uncompiled: transformers compiles automatically on CUDA only "
                 "(--compile-cpu compiles through inductor here: minutes)")
    else:
        torch._dynamo.config.recompile_limit = 64  # one graph per verify width bucket and mode (docs/gpu.md)
        torch._dynamo.config.accumulated_recompile_limit = 1024
    static = dict(cache_implementation="static", disable_compile=not compiled)
    if compiled and not ctx.cuda:
        import transformers as tf

        static["compile_config"] = tf.CompileConfig()
        static["compile_config"]._compile_all_devices = True  # (transformers compiles on accelerators only unless told)
    full = {f"chain {k}": dict(draft_mode="chain", num_assistant_tokens=k) for k in (3, 5, 8)}
    full.update({"tree": TREE, "default": {}})
    full.update({f"{m}, eager levels": dict(full[m], levels="eager") for m in ("chain 5", "default")})
    if ctx.args.compiled_modes:
        full = {m.strip(): full[m.strip()] for m in ctx.args.compiled_modes.split(";")}
    rates = [float(r) for r in (ctx.args.compiled_rates or "0.15,0.25,0.35,0.5,1.0").split(",") if r]
    curve = [(m, r) for r in rates for m in ("chain 5", "default") if m in full]
    cells = parse_cells(ctx.args.compiled_cells or ("64x1,64x2" if ctx.small else "1024x1,1024x4"))
    if budget.allows(10):  # (first: cheap, and the cells may use up the budget)
        context = cells[0][0] if cells else 1024
        res["data"]["drafter level alone"] = [
            {"context": context, "k": k, "levels": "fixed shapes" if fixed else "eager",
             "ms": drafter_level_ms(ctx, drafter, context, k, fixed=fixed)} for k in (1, 4) for fixed in (False, True)]
        ctx.partial(res)
    table = []
    for ctx_len, rows in cells:
        cases = [(m, 0.0) for m in full] + (curve if rows == 1 else [])  # (the curve: batch 1)
        if not budget.allows(30):
            res["status"] = "partial"
            res.find(f"budget: skipped context {ctx_len} x batch {rows}")
            continue
        table += _compiled_cell(ctx, res, target, drafter, succ, ctx_len, rows, cases, full, static, budget)
        res["data"]["speed"] = table
        ctx.partial(res)
    done = [r for r in table if r["mode"] != "plain" and r.get("runs")]
    from eagle_hf.drafter.graphs import wanted

    alone = {(x["k"], x["levels"]): x["ms"] for x in res["data"].get("drafter level alone", [])}
    for r in done:  # (the level alone, as the mode runs it: k nodes a row, eager or at fixed shapes)
        fixed = wanted(drafter, static.get("disable_compile") is False) and "eager levels" not in r["mode"]
        r["drafter_ms_per_level"] = alone.get((1 if r["mode"].startswith("chain") else 4,
                                               "fixed shapes" if fixed else "eager"))
    bad = [r for r in done if r.get("follows_cycle") is False]
    if bad:
        res["status"] = "failed"
        res.find(f"{len(bad)} runs left the target's cycle (a lossy round): " +
                 ", ".join(f"{r['mode']} r={r['withheld_rate']}" for r in bad[:6]))
    recompiled = [r for r in done if r.get("graphs_after_warmup")]
    if recompiled:
        res.find(f"{len(recompiled)} modes compiled graphs in their timed runs: " +
                 ", ".join(f"{r['mode']} ({r['graphs_after_warmup']})" for r in recompiled[:6]))
    res.find("speedup = compiled plain's median / the mode's median, same cell; eager_plain_ms_per_token: plain "
             "generate() with the default cache, same prompt; drafter_ms_per_round: the drafter's clock (catch-up, "
             "levels, choices), of which catch_up_ms_per_round its catch-up; verify_ms_per_round: the target's "
             "forwards after the prefill (both from the loop's device clock); drafter_ms_per_level: the level alone, "
             "k nodes as the mode drafts, eager or at fixed shapes as it runs; withheld_rate: the share of "
             "continuation tokens the oracle withholds; warmup_recompiles: torch.compile's reasons to recompile in "
             "the mode's warm-up call (its first guard failure each)")
    top = {r["mode"]: r for r in done if r["withheld_rate"] == 0 and r["batch"] == 1}
    res["summary"] = "; ".join(f"{m} {r['speedup']:.2f}x (tau {r['tau']:.2f})" for m, r in top.items())
    return res


def drafter_level_ms(ctx, drafter, context: int, k: int, calls: int = 50, fixed: bool = False) -> float:
    """Milliseconds of one draft level alone: the drafter's forward over k frontier nodes after `context` real rows
    and the top-k choice of their children, `calls` times back to back (the device synchronised around the loop:
    launches and kernels, no host bookkeeping). `fixed`: at fixed shapes (`eagle_hf.drafter.graphs`: a CUDA
    graph's replay on CUDA)."""
    from eagle_hf.drafter.graphs import LevelGraphs
    from eagle_hf.speculation.drafting import DraftState, top_k_choice

    device, dtype = ctx.device, drafter.fc.weight.dtype
    g = torch.Generator(device="cpu").manual_seed(k)
    state = DraftState(graphs=LevelGraphs.for_drafter(drafter) if fixed else None)
    aux = torch.randn(1, context, drafter.fc.in_features, generator=g).to(device, dtype)  # [1, n, A*H_t]
    tokens = torch.randint(1, drafter.config.vocab_size, (1, context), generator=g).to(device)
    with torch.no_grad():
        _, hidden = state.extend(drafter, aux, tokens)  # hidden: [1, 1, H]
        state.reserve(drafter, k, hidden)
        feed, ids = hidden.expand(1, k, hidden.shape[-1]).contiguous(), tokens[:, :k]  # [1, k, H], [1, k]
        positions = torch.full((1, k), context, device=device)
        mask = None if k == 1 else state.level_mask(torch.eye(k, dtype=torch.bool, device=device)[None], k, 0)

        def level():
            out = state.level_forward(drafter, feed, ids, positions, state.length, mask)
            return top_k_choice(drafter, out.logits, k)

        for _ in range(3):
            level()
        _, seconds = timed(ctx, lambda: [level() for _ in range(calls)])
    return 1e3 * seconds / calls


@contextlib.contextmanager
def draft_levels(kwargs: dict):
    """generate() keyword arguments, with ``levels="eager"`` (draft levels eager, not at fixed shapes) and
    ``split_keys="off"`` (tree attention in one masked call) turned into eagle_hf's settings for the call."""
    from eagle_hf.drafter.graphs import GRAPHS_ENV
    from eagle_hf.hf.attention import SPLIT_KEY_ENV

    kwargs = dict(kwargs)
    settings = {GRAPHS_ENV: "off" if kwargs.pop("levels", None) == "eager" else None,
                SPLIT_KEY_ENV: kwargs.pop("split_keys", None)}
    before = {name: os.environ.get(name) for name in settings}
    for name, value in settings.items():
        if value is not None:
            os.environ[name] = value
    try:
        yield kwargs
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _compiled_cell(ctx, res, target, drafter, succ, ctx_len, rows, cases, modes, static, budget) -> list[dict]:
    from eagle_hf.drafter import graphs as drafter_graphs
    from eagle_hf.hf.models import compiled_graphs

    s = ctx.shapes
    ids, mask = prompts(rows, ctx_len, target.config.vocab_size, seed=ctx_len + 3 * rows, device=ctx.device)
    ids[:, -1] = draft_vocabulary(drafter)[1 : rows + 1].to(ids.device)  # (continuations the drafter can propose)
    generate(target, ids, mask, s.new_tokens)  # warm-ups: eager, then compiled (compiles the one-token graph)
    ref = generate(target, ids, mask, s.new_tokens, **static)
    expected = ids.new_tensor(_cycle(succ, ids[:, -1].tolist(), s.new_tokens))  # [B, new]
    follows = bool(torch.equal(ref[:, -s.new_tokens:], expected))
    if not follows:
        res.find(f"context {ctx_len} x batch {rows}: compiled plain output leaves the cycle (the oracle needs it)")
    plain = {"eager": [], "compiled": []}
    times, info, carried = {c: [] for c in cases}, {}, {}
    for case in cases:  # warm-up: every graph a mode needs, compiled now
        mode, rate = case
        start = time.perf_counter()
        with oracle_drafter(drafter, succ, rate, seed=rows, rows=rows), own_acceptance(drafter, carried, case), \
                draft_levels(modes[mode]) as kwargs:
            graphs = compiled_graphs()
            with dynamo_recompiles() as reasons:
                generate(target, ids, mask, s.new_tokens, drafter, **kwargs, **static)
            info[case] = dict(warmup_graphs=compiled_graphs() - graphs, after=0,
                              warmup_s=round(time.perf_counter() - start, 1), recompiles=reasons)
        if not budget.allows(20):
            break
    for _ in range(s.repeats):
        if not budget.allows(10):
            res["status"] = "partial"
            break
        for which, kwargs in (("eager", {}), ("compiled", static)):
            plain[which].append(timed(ctx, generate, target, ids, mask, s.new_tokens, **kwargs)[1])
        for case in [c for c in cases if c in info]:
            mode, rate = case
            graphs, captures = compiled_graphs(), drafter_graphs.CAPTURES
            with oracle_drafter(drafter, succ, rate, seed=rows, rows=rows), own_acceptance(drafter, carried, case), \
                    draft_levels(modes[mode]) as kwargs:
                out, t = timed(ctx, generate, target, ids, mask, s.new_tokens, drafter, **kwargs, **static)
            times[case].append(t)
            st = last_stats()
            info[case].update(tau=st.mean_acceptance_length, rounds=loop_rounds(st) + 1, drafter=st.drafter_time,
                              catch_up=st.catch_up_time, verify=st.verify_time,
                              follows=bool(torch.equal(out, ref)), after=info[case]["after"] + compiled_graphs() - graphs,
                              captures=info[case].get("captures", 0) + drafter_graphs.CAPTURES - captures)
    med = {k: statistics.median(v) if v else float("nan") for k, v in plain.items()}
    base = dict(context=ctx_len, batch=rows, compiled=bool(static.get("disable_compile") is False))
    out = [dict(base, mode="plain", withheld_rate=0.0, runs=len(plain["compiled"]), median_s=med["compiled"],
                speedup=1.0, tau=1.0, ms_per_round=1e3 * med["compiled"] / s.new_tokens,
                eager_plain_ms_per_token=1e3 * med["eager"] / s.new_tokens,
                compiled_over_eager=med["eager"] / med["compiled"], follows_cycle=follows)]
    for case in cases:
        mode, rate = case
        i, t = info.get(case, {}), times[case]
        if not t:
            out.append(dict(base, mode=mode, withheld_rate=rate, runs=0))
            continue
        m = statistics.median(t)
        out.append(dict(base, mode=mode, withheld_rate=rate, runs=len(t), median_s=m, speedup=med["compiled"] / m,
                        tau=i["tau"], rounds=i["rounds"], ms_per_round=1e3 * m / i["rounds"],
                        drafter_ms_per_round=1e3 * i["drafter"] / i["rounds"],
                        catch_up_ms_per_round=1e3 * i["catch_up"] / i["rounds"],
                        verify_ms_per_round=1e3 * i["verify"] / i["rounds"],
                        plain_ms_per_step=1e3 * med["compiled"] / s.new_tokens, follows_cycle=i["follows"],
                        warmup_graphs=i["warmup_graphs"], warmup_s=i["warmup_s"], graphs_after_warmup=i["after"],
                        drafter_captures_after_warmup=i.get("captures", 0),
                        warmup_recompiles=" | ".join(i["recompiles"][:3]) or None))
    return out


@contextlib.contextmanager
def dynamo_recompiles():
    """The reasons torch.compile recompiled a function while active (each recompilation's first guard failure;
    a hit recompile limit as its warning), collected from torch's `recompiles` log."""
    import logging

    reasons: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines = record.getMessage().splitlines()
            if "Recompiling" in lines[0]:
                failed = next((ln.strip() for ln in lines if ln.strip().startswith("- ")), lines[0])
                reasons.append(failed[:160])
            elif "recompile_limit" in lines[0] or "cache_size_limit" in lines[0]:
                reasons.append(lines[0][:160])

    logger, handler = logging.getLogger("torch._dynamo"), Collect()
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(handler)
    try:
        yield reasons
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()


@contextlib.contextmanager
def own_acceptance(drafter, kept: dict, case):
    """A call that starts from the acceptance its own case's last call ended with (eagle_hf carries a drafter's
    acceptance from one call to the next, `eagle_hf.hf.costs.keep_acceptance`): cases of different acceptance on
    one drafter object do not start from each other's, as a user whose drafter has that acceptance would not."""
    from eagle_hf.hf import costs

    costs._ACCEPTANCE.pop(drafter, None)
    if case in kept:
        costs._ACCEPTANCE[drafter] = dict(kept[case])
    try:
        yield
    finally:
        kept[case] = dict(costs._ACCEPTANCE.get(drafter, {}))


def _cycle(succ: torch.Tensor, last: list[int], new: int) -> list[list[int]]:
    """Each row's `new` tokens after its last prompt token under a `cycle_target`."""
    table, out = succ.tolist(), []
    for t in last:
        row = []
        for _ in range(new):
            t = table[t]
            row.append(t)
        out.append(row)
    return out


def stage_sync(ctx: Context, budget: Budget) -> StageResult:
    """Host-device synchronisations per round (CUDA's sync debug mode) against the CPU probe's prediction
    (eagle_hf.tools.sync_probe, where present), and a short profiler trace."""
    res = StageResult()
    target, drafter = ctx.pair("bf16")
    vocab = target.config.vocab_size
    new = 16 if ctx.small else 32
    cases = {"chain 5 (transformers' loop)": (1, CHAIN), "tree": (1, TREE), "default": (1, {}),
             "batch of 4, tree": (4, TREE)}
    probe = _sync_probe()
    table = []
    for name, (rows, kwargs) in cases.items():
        if not budget.allows(10):
            res.find(f"budget: skipped {name}")
            res["status"] = "partial"
            continue
        ids, mask = prompts(rows, 64 if ctx.small else 512, vocab, seed=11, device=ctx.device, repeat=True)
        generate(target, ids, mask, new, drafter, **kwargs)  # warm-up: one-time cost measurements are not rounds
        row = {"case": name}
        if ctx.cuda:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    generate(target, ids, mask, new, drafter, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
            st = last_stats()
            rounds = loop_rounds(st) + 1  # the prefill is a round too
            where = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
            row.update(rounds=rounds, cycles=st.cycles, syncs=len(syncs), syncs_per_round=len(syncs) / rounds,
                       top_sites="; ".join(f"{k} x{v}" for k, v in where.most_common(6)))
        if probe is not None:
            row.update(_probe_counts(probe, target, ids, mask, new, drafter, kwargs))
        table.append(row)
    res["data"]["syncs per round"] = table
    if not ctx.cuda:
        res.find("no CUDA device: the sync debug mode and the profiler trace need one (skipped)")
    if probe is None:
        res.find("eagle_hf.tools.sync_probe is not importable: no CPU prediction")
    if ctx.cuda and budget.allows(20):
        res["data"]["profile"] = _profile(ctx, target, drafter, vocab)
        res.find("trace.json.gz: a chrome trace of about five tree rounds (open in ui.perfetto.dev)")
    res["summary"] = "; ".join(f"{r['case']}: " + ", ".join(f"{k} {r[k]:.1f}" for k in r if k.endswith("per_round"))
                               for r in table)
    return res


def _sync_probe():
    if importlib.util.find_spec("eagle_hf.tools.sync_probe") is None:
        return None
    import eagle_hf.tools.sync_probe as probe

    return probe


def _probe_counts(probe, target, ids, mask, new, drafter, kwargs) -> dict:
    """The CPU probe's prediction for the same call: device-to-host reads, blocking copies and syncs per round.
    Its API (eagle_hf/tools/sync_probe.py, being written alongside this script): probe_generate(target, inputs,
    **generate_kwargs) -> SyncProbe with summary() per round kind and culprits(kind)."""
    # TODO(sync_probe): keep in step with eagle_hf.tools.sync_probe's API while it settles; anything else is recorded
    if not hasattr(probe, "probe_generate"):
        return {"probe": f"unknown API: {sorted(n for n in dir(probe) if not n.startswith('_'))}"}
    try:
        p = probe.probe_generate(target, {"input_ids": ids, "attention_mask": mask}, assistant_model=drafter,
                                 max_new_tokens=new, do_sample=False, **kwargs)
        summary = p.summary()
        rounds = sum(v.get("rounds", 0) for v in summary.values())
        total = {what: sum(getattr(r, what, 0) for r in p.rounds) for what in ("reads", "copies", "syncs")}
        out = {"probe_rounds": rounds, **{f"probe_{k}_per_round": v / max(rounds, 1) for k, v in total.items()}}
        draft = summary.get("draft")
        if draft:
            out["probe_draft_round"] = ", ".join(f"{k} {v}" for k, v in draft.items() if k.startswith("max"))
        return out
    except Exception as err:  # noqa: BLE001 - the probe is optional
        return {"probe": f"failed: {type(err).__name__}: {err}"[:300]}


def _profile(ctx, target, drafter, vocab) -> dict:
    """About five tree rounds under torch.profiler; the trace is written to trace.json.gz."""
    from torch.profiler import ProfilerActivity, profile

    ids, mask = prompts(1, 512, vocab, seed=12, device=ctx.device)
    generate(target, ids, mask, 6, drafter, **TREE)
    ctx.sync()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate(target, ids, mask, 6, drafter, **TREE)  # a random drafter: about one token per round
        ctx.sync()
    wall = time.perf_counter() - start
    save_trace(prof, ctx.out / "trace.json.gz")
    events = prof.key_averages()
    on_device = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]  # kernels, memcpys
    device_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in on_device)
    kernels = sum(e.count for e in on_device)
    return {"wall_s (profiled)": wall, "device_busy_s": device_us / 1e6, "device_busy_fraction": device_us / 1e6 / wall,
            "rounds": loop_rounds(last_stats()) + 1, "kernel_launches": kernels}


def stage_profile(ctx: Context, budget: Budget) -> StageResult:
    """Where a round's time goes: plain decoding and a tree round (a random drafter, so about one token a round)
    under torch.profiler at each CONTEXTxBATCH cell, the prefill and catch-up subtracted (a shorter call beside it):
    wall and device time per round and the kernels (CPU: the operators) that take it."""
    res = StageResult()
    target, drafter = ctx.pair("bf16")
    vocab = target.config.vocab_size
    spec = ctx.args.profile_cells or ("64x1" if ctx.small else "512x1")
    cells = parse_cells(spec)
    table, last_cell = [], 0.0
    for ctx_len, rows in cells:
        if not budget.allows(last_cell * 1.2 + 5):
            res.find(f"budget: skipped context {ctx_len} x batch {rows}")
            res["status"] = "partial"
            continue
        start = time.perf_counter()
        ids, mask = prompts(rows, ctx_len, vocab, seed=13, device=ctx.device)
        for mode, kwargs in (("plain", None), ("tree", TREE), ("tree, keys unsplit", dict(TREE, split_keys="off"))):
            with draft_levels(kwargs or {}) as call:
                table.append(_profile_round(ctx, target, drafter if kwargs else None, ids, mask, call,
                                            f"{ctx_len}x{rows}", mode))
        last_cell = time.perf_counter() - start
        res["data"] = {"per round": table}
        ctx.partial(res)
    res.find("per round = (a 10-token call - a 4-token call) / the difference in rounds (both calls hold the prefill "
             "and the drafter's catch-up over the prompt); wall_ms_per_round under the profiler, "
             "unprofiled_wall_ms_per_round without it (the summary's); a batch's rounds are "
             "its verify forwards (the longest row's); device time is the kernels' own (CUDA), on the CPU the "
             "operators' self time; trace_<cell>.json.gz: the tree call's chrome trace (CUDA only)")
    res["summary"] = "; ".join(f"{r['cell']} {r['mode']}: {r['unprofiled_wall_ms_per_round']:.1f} ms wall, "
                               f"{r['device_ms_per_round']:.1f} ms device a round" for r in table)
    return res


def _profile_round(ctx, target, drafter, ids, mask, kwargs, cell: str, mode: str, new: int = 6, base: int = 4) -> dict:
    """Per round: a call of `base` + `new` tokens less one of `base` tokens, over the difference in rounds. Both
    calls hold the prefill and the drafter's catch-up over the prompt (which the first drafting round runs: a
    one-token call has none), so the difference is rounds alone."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    runs = {}
    for tokens in (base, base + new):
        generate(target, ids, mask, tokens, drafter, **kwargs)  # warm-up (one-time costs are not rounds)
        ctx.sync()
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            generate(target, ids, mask, tokens, drafter, **kwargs)
            ctx.sync()
        wall = time.perf_counter() - start
        rounds = loop_rounds(last_stats()) if drafter is not None else tokens - 1
        _, unprofiled = timed(ctx, generate, target, ids, mask, tokens, drafter, **kwargs)  # (the profiler's own
        # cost per operator is large on a host-bound loop: the wall time without it too)
        if ctx.cuda and drafter is not None and tokens == base + new:
            save_trace(prof, ctx.out / f"trace_{cell}.json.gz")
        per_op = {}
        for e in prof.key_averages():
            on_device = str(getattr(e, "device_type", "")).endswith("CUDA")
            if on_device != ctx.cuda:
                continue
            us = (getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) if ctx.cuda
                  else e.self_cpu_time_total)
            per_op[e.key] = (us / 1e3, e.count)
        runs[tokens] = dict(wall=wall, unprofiled=unprofiled, rounds=rounds, ops=per_op)
    short, long = runs[base], runs[base + new]
    n = max(long["rounds"] - short["rounds"], 1)
    diff = {k: ((ms - short["ops"].get(k, (0.0, 0))[0]) / n, (c - short["ops"].get(k, (0.0, 0))[1]) / n)
            for k, (ms, c) in long["ops"].items()}
    top = sorted(diff.items(), key=lambda kv: -kv[1][0])[:8]
    return {"cell": cell, "mode": mode, "rounds": n, "wall_ms_per_round": 1e3 * (long["wall"] - short["wall"]) / n,
            "unprofiled_wall_ms_per_round": 1e3 * (long["unprofiled"] - short["unprofiled"]) / n,
            "device_ms_per_round": sum(ms for ms, _ in diff.values()),
            "launches_per_round": sum(c for _, c in diff.values()),
            "top": "; ".join(f"{k[:60]} {ms:.2f} ms x{c:.0f}" for k, (ms, c) in top)}


def stage_memory(ctx: Context, budget: Budget) -> StageResult:
    """Peak device memory against plain generate() (batch 1 and 8, long context), its stability over repeated
    calls, and first-call against warm latency."""
    res = StageResult()
    s = ctx.shapes
    target, drafter = ctx.pair("bf16")
    vocab = target.config.vocab_size
    new = 32 if not ctx.small else 16
    cases = {"plain": None, "default": {}, "tree": TREE, "chain 5": CHAIN}
    if ctx.ran:
        res.find(f"first-call latency is this model's first EAGLE call in a process that already ran {ctx.ran}")
    first = None
    peaks = []
    for rows in s.memory_batches:
        ids, mask = prompts(rows, s.long_context, vocab, seed=21, device=ctx.device)
        for name, kwargs in cases.items():
            if not budget.allows(15):
                res["status"] = "partial"
                res.find(f"budget: skipped batch {rows} {name}")
                continue
            if ctx.cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(ctx.device)
                base = torch.cuda.memory_allocated(ctx.device)
            try:
                _, t = timed(ctx, generate, target, ids, mask, new, drafter if kwargs is not None else None,
                             **(kwargs or {}))
            except Exception as err:
                if not out_of_memory(err):
                    raise
                res.find(f"batch {rows} x {s.long_context} {name}: out of memory")
                continue
            if first is None and kwargs is not None:
                first = t
            row = {"batch": rows, "context": s.long_context, "mode": name, "seconds": t}
            if ctx.cuda:
                row["peak_over_weights_gib"] = (torch.cuda.max_memory_allocated(ctx.device) - base) / 2**30
            peaks.append(row)
    for row in peaks:
        plain = next((p for p in peaks if p["batch"] == row["batch"] and p["mode"] == "plain"), None)
        if ctx.cuda and plain and plain.get("peak_over_weights_gib"):
            row["x_plain"] = row["peak_over_weights_gib"] / plain["peak_over_weights_gib"]
    res["data"]["peak memory"] = peaks
    # repeated calls: the peak and what stays allocated must not grow
    ids, mask = prompts(1, s.long_context, vocab, seed=22, device=ctx.device)
    calls = []
    for i in range(s.memory_calls):
        if not budget.allows(5):
            res["status"] = "partial"
            res.find(f"budget: {i} of {s.memory_calls} repeated calls")
            break
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        _, t = timed(ctx, generate, target, ids, mask, new, drafter)
        call = {"call": i, "seconds": t}
        if ctx.cuda:
            call.update(peak_gib=torch.cuda.max_memory_allocated(ctx.device) / 2**30,
                        allocated_after_gib=torch.cuda.memory_allocated(ctx.device) / 2**30)
        calls.append(call)
    res["data"]["repeated calls"] = calls
    if ctx.cuda and len(calls) >= 3:
        grow = calls[-1]["allocated_after_gib"] - calls[1]["allocated_after_gib"]
        peak_grow = max(c["peak_gib"] for c in calls[2:]) - calls[1]["peak_gib"]
        stable = grow < 0.05 and peak_grow < 0.05
        res.find(f"over {len(calls)} calls: allocated after a call grew {grow * 1024:.0f} MiB, peak grew "
                 f"{peak_grow * 1024:.0f} MiB: {'stable' if stable else 'GROWING'}")
        if not stable:
            res["status"] = "failed"
    if not ctx.cuda:
        res.find("no CUDA device: peak memory not measured (latency only)")
    warm = statistics.median(c["seconds"] for c in calls[1:]) if len(calls) > 1 else None
    res["data"]["latency"] = {"first EAGLE call (s)": first, "warm call, median (s)": warm}
    res["summary"] = f"first call {first:.2f} s, warm {warm:.2f} s" if first and warm else "incomplete"
    if ctx.cuda and peaks:
        worst = max((p for p in peaks if "x_plain" in p), key=lambda p: p["x_plain"], default=None)
        if worst:
            res["summary"] += (f"; worst peak over plain: {worst['mode']} batch {worst['batch']} "
                               f"{worst['x_plain']:.2f}x ({worst['peak_over_weights_gib']:.2f} GiB above weights)")
    return res


def stage_kernels(ctx: Context, budget: Budget) -> StageResult:
    """Each attention implementation and the static cache (with and without a compiled forward): does EAGLE
    run, what mode ran, is the output plain generate()'s, how fast against plain. Refusals are findings."""
    res = StageResult()
    target, drafter = ctx.pair("bf16")
    vocab = target.config.vocab_size
    new = 16 if ctx.small else 48
    ids, mask = prompts(1, 64 if ctx.small else 1024, vocab, seed=31, device=ctx.device, repeat=True)
    impls = ["sdpa", "eager"]
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        res.find("torch has no flex_attention: not checked")
    elif ctx.small and not ctx.cuda:
        res.find("flex_attention not checked with --small on a CPU (it compiles its kernel: minutes here)")
    else:
        impls.append("flex_attention")
    if importlib.util.find_spec("flash_attn") is not None:
        impls.append("flash_attention_2")
    else:
        res.find("flash_attn is not importable: flash_attention_2 not checked")
    wanted = [x for x in ctx.args.kernels.split(",") if x]
    if wanted:
        impls = [i for i in impls if i in wanted]
        res.find(f"only {', '.join(wanted)} (--kernels)")
    table = []
    cases = {"default": {}, "tree": dict(draft_mode="tree"), "chain 5": CHAIN}
    for impl in impls:
        if not budget.allows(20):
            res["status"] = "partial"
            res.find(f"budget: skipped {impl}")
            continue
        try:
            target.set_attn_implementation(impl)
        except Exception as err:  # noqa: BLE001 - a refusal is a finding
            table.append({"attention": impl, "case": "set_attn_implementation", "runs": False,
                          "note": f"{type(err).__name__}: {err}"[:200]})
            continue
        table += _kernel_cases(ctx, target, drafter, ids, mask, new, cases, {"attention": impl, "cache": "dynamic"})
        res["data"]["runs"] = table
        ctx.partial(res)
    target.set_attn_implementation("sdpa")
    compiles = [False, True] if ctx.cuda else [False]
    if wanted:
        compiles = [c for c in compiles if ("static+compile" if c else "static") in wanted]
    if not ctx.cuda:
        res.find("no CUDA device: the static cache's automatic compile (CUDA only) not checked")
    for compiled in compiles:
        if not budget.allows(60 if compiled else 20):
            res["status"] = "partial"
            res.find(f"budget: skipped static cache {'compiled' if compiled else 'eager'}")
            continue
        extra = dict(cache_implementation="static", disable_compile=not compiled)
        table += _kernel_cases(ctx, target, drafter, ids, mask, new, cases,
                               {"attention": "sdpa", "cache": "static" + (" + compile" if compiled else "")}, extra)
        res["data"]["runs"] = table
        ctx.partial(res)
    if ctx.cuda and budget.allows(15):
        res["data"]["attention kernels in one tree generate"] = _attention_kernels(ctx, target, drafter, ids, mask)
    res["data"]["runs"] = table
    for r in table:
        if not r.get("runs", True):
            res.find(f"{r.get('attention')} {r.get('cache', 'dynamic')} {r['case']}: does not run: {r.get('note')}")
        elif r.get("equal") is False:
            res.find(f"{r.get('attention')} {r.get('cache', 'dynamic')} {r['case']}: output differs from plain")
        if "fallback" in str(r.get("ran", "")):
            res.find(f"{r.get('attention')} {r['case']}: tree mode fell back to chain")
    ok = sum(1 for r in table if r.get("runs", True) and r["case"] != "plain")
    res["summary"] = f"{ok} of {sum(1 for r in table if r['case'] != 'plain')} EAGLE runs ran; see findings"
    return res


def _kernel_cases(ctx, target, drafter, ids, mask, new, cases, label: dict, extra: dict | None = None) -> list[dict]:
    extra = extra or {}
    rows = []
    try:
        generate(target, ids, mask, new, **extra)  # warm-up (a compiled forward compiles here)
        ref, plain_t = timed(ctx, generate, target, ids, mask, new, **extra)
        rows.append(dict(label, case="plain", runs=True, seconds=plain_t))
    except Exception as err:  # noqa: BLE001
        return [dict(label, case="plain", runs=False, note=f"{type(err).__name__}: {err}"[:200])]
    for name, kwargs in cases.items():
        try:
            with eagle_logs() as records:
                generate(target, ids, mask, new, drafter, **kwargs, **extra)  # warm-up
                out, t = timed(ctx, generate, target, ids, mask, new, drafter, **kwargs, **extra)
            rows.append(dict(label, case=name, runs=True, ran=mode_ran(records[-50:]),
                             equal=bool(torch.equal(sequences(out), sequences(ref))), seconds=t,
                             speedup=plain_t / t))
        except Exception as err:  # noqa: BLE001 - what does not run is recorded, not raised
            rows.append(dict(label, case=name, runs=False, note=f"{type(err).__name__}: {err}"[:200]))
    return rows


def _attention_kernels(ctx, target, drafter, ids, mask) -> dict:
    """Which attention kernels one tree-mode generate() launches (the SDPA backend chosen for tree masks and
    for the drafter's mask shows in the kernel names)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate(target, ids, mask, 8, drafter, **TREE)
        ctx.sync()
    names = Counter()
    for e in prof.key_averages():
        if re.search(r"flash|fmha|attention|efficient|cudnn|softmax|sdp", e.key, re.IGNORECASE):
            names[e.key[:120]] += e.count
    return dict(names.most_common(15))


def stage_quant(ctx: Context, budget: Budget) -> StageResult:
    """A bitsandbytes 4-bit and 8-bit target, when the package imports: EAGLE runs, equality, speed."""
    res = StageResult()
    if importlib.util.find_spec("bitsandbytes") is None:
        res["status"], res["summary"] = "skipped", "bitsandbytes is not importable"
        return res
    try:
        import bitsandbytes  # noqa: F401
    except Exception as err:  # noqa: BLE001
        res["status"], res["summary"] = "skipped", f"bitsandbytes does not import: {type(err).__name__}: {err}"[:300]
        return res
    import transformers as tf

    s = ctx.shapes
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        build_target(s.quant, torch.bfloat16, torch.device("cpu"), seed=3).save_pretrained(tmp)
        for bits in (4, 8):
            if not budget.allows(20):
                res["status"] = "partial"
                res.find(f"budget: skipped {bits}-bit")
                continue
            q = (tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16) if bits == 4 else
                 tf.BitsAndBytesConfig(load_in_8bit=True))
            try:
                target = tf.AutoModelForCausalLM.from_pretrained(tmp, quantization_config=q, dtype=torch.bfloat16,
                                                                 device_map=str(ctx.device)).eval()
            except Exception as err:  # noqa: BLE001
                table.append({"bits": bits, "case": "load", "runs": False, "note": f"{type(err).__name__}: {err}"[:200]})
                continue
            target.generation_config.pad_token_id, target.generation_config.eos_token_id = 0, None
            drafter = build_drafter(target, s.draft_vocab if not ctx.small else 1024, seed=4)
            ids, mask = prompts(1, 64 if ctx.small else 512, target.config.vocab_size, seed=41, device=ctx.device,
                                repeat=True)
            table += _kernel_cases(ctx, target, drafter, ids, mask, 16 if ctx.small else 48, MODES, {"bits": bits})
            del target, drafter
            if ctx.cuda:
                torch.cuda.empty_cache()
    res["data"]["runs"] = table
    bad = [r for r in table if not r.get("runs", True) or r.get("equal") is False]
    for r in bad:
        res.find(f"{r['bits']}-bit {r['case']}: {'does not run: ' + r.get('note', '') if not r.get('runs', True) else 'differs from plain'}")
    res["summary"] = f"{len(table) - len(bad)} of {len(table)} runs ran and matched plain"
    return res


def stage_sampling(ctx: Context, budget: Budget) -> StageResult:
    """Lossless sampling: with do_sample=True, temperature 1, the joint distribution of the first two generated
    tokens (the second is the first that can be drafted) and the third's marginal, EAGLE against plain
    generate(), over many identical rows; a chi-square test of homogeneity and the total variation distance.

    Two setups, both with a 32-token vocabulary. "random drafter": both lm_heads scaled up (peaked,
    context-dependent distributions), so that drafts are accepted often and rejected often. "oracle": a
    `cycle_target` with a spread head and `oracle_drafter` (the drafter puts nearly all its mass on the target's
    most likely token):
    most drafts accepted, so the accept path of the recursive rejection carries most of the draws."""
    res = StageResult()
    shape = dict(hidden_size=64 if ctx.small else 256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128 if ctx.small else 512, vocab_size=32,
                 max_position_embeddings=512)
    target = build_target(shape, torch.float32, ctx.device, seed=5)
    drafter = build_drafter(target, 24, seed=6)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0 if ctx.small else 4.0)
        drafter.lm_head.weight.mul_(8.0 if ctx.small else 4.0)
    ids = torch.randint(1, 32, (1, 12), generator=torch.Generator().manual_seed(5)).to(ctx.device)
    within = draft_ids(32, 24, seed=8)  # (the cycle the drafter can propose)
    oracle, succ = cycle_target(shape, torch.float32, ctx.device, seed=7, gain=0.55 if ctx.small else 0.27,
                                within=within)  # P(succ) ~ 0.7
    follower = build_drafter(oracle, 24, seed=8)
    oracle_ids = ids.clone()
    oracle_ids[:, -1] = within[-1]  # (the last: not the padding id 0)
    chain3 = dict(draft_mode="chain", num_assistant_tokens=3)
    setups = {"random drafter": (target, drafter, None, ids), "oracle": (oracle, follower, succ, oracle_ids)}
    modes = {"tree (constant)": TREE, "chain 3 (constant)": chain3}
    table = []
    for setup, (model, draft_model, table_succ, prompt) in setups.items():
        if not budget.allows(10):
            res["status"] = "partial"
            res.find(f"budget: skipped the {setup} setup")
            continue
        table += _sampling_tests(ctx, res, setup, model, draft_model, table_succ, prompt, modes, budget)
        res["data"]["tests"] = table
        ctx.partial(res)
    failed = [r for r in table if r["p"] < 1e-3]
    if failed:
        res["status"] = "failed"
        for r in failed:
            res.find(f"{r['setup']} {r['mode']} {r['tokens']}: p = {r['p']:.2e} (TV {r['total_variation']:.3f}): "
                     "not plain sampling")
    res.find("threshold: p < 1e-3 fails (chi-square homogeneity, cells with fewer than 5 expected draws pooled)")
    res["summary"] = "; ".join(f"{r['setup']} {r['mode']} {r['tokens']}: p {r['p']:.3f}, TV {r['total_variation']:.3f}, "
                               f"acceptance {r['acceptance']:.2f}" for r in table)
    return res


def _sampling_tests(ctx, res, setup, target, drafter, succ, ids, modes, budget) -> list[dict]:
    """Draws of plain sampling and of each EAGLE mode (`oracle_drafter` when `succ` is given), and the tests."""
    s = ctx.shapes
    draws = {m: [] for m in ["plain", *modes]}
    accept = {}
    calls = -(-s.samples // s.sample_rows)
    for call in range(calls):
        if not budget.allows(5):
            res["status"] = "partial"
            res.find(f"budget: {setup}: {call} of {calls} calls per mode")
            break
        rows = ids.expand(s.sample_rows, -1).contiguous()
        mask = torch.ones_like(rows)
        for mode, kwargs in [("plain", None), *modes.items()]:
            torch.manual_seed(1000 * call + len(draws[mode]))
            with oracle_drafter(drafter, succ) if succ is not None and kwargs is not None else contextlib.nullcontext():
                out = generate(target, rows, mask, 3, drafter if kwargs is not None else None, do_sample=True,
                               temperature=1.0, **(kwargs or {}))
            draws[mode].append(out[:, -3:].cpu())
            if kwargs is not None:
                st = last_stats()
                a = accept.setdefault(mode, [0, 0])
                a[0], a[1] = a[0] + st.accepted, a[1] + st.drafted
    samples = {m: torch.cat(v) for m, v in draws.items() if v}
    table = []
    if "plain" not in samples:
        return table
    ref = samples["plain"]
    for mode in modes:
        if mode not in samples:
            continue
        got = samples[mode]
        for what, f in (("tokens 1-2 (joint)", lambda x: x[:, 0] * 32 + x[:, 1]), ("token 3", lambda x: x[:, 2])):
            stat, dof, p, tv = homogeneity(f(ref), f(got), 32 * 32)
            table.append({"setup": setup, "mode": mode, "tokens": what, "n": len(got), "chi2": stat, "dof": dof,
                          "p": p, "total_variation": tv, "acceptance": accept[mode][0] / max(accept[mode][1], 1)})
    return table


def homogeneity(a: torch.Tensor, b: torch.Tensor, cells: int) -> tuple[float, int, float, float]:
    """Chi-square test that two samples of category ids come from one distribution: (statistic, degrees of
    freedom, p-value, total variation distance of the empirical distributions). Cells where either sample expects
    fewer than 5 draws are pooled into one."""
    ca = torch.bincount(a, minlength=cells).double()
    cb = torch.bincount(b, minlength=cells).double()
    na, nb = ca.sum(), cb.sum()
    total = ca + cb
    ea, eb = total * na / (na + nb), total * nb / (na + nb)
    keep = (ea >= 5) & (eb >= 5)
    oa = torch.cat([ca[keep], ca[~keep].sum()[None]])
    ob = torch.cat([cb[keep], cb[~keep].sum()[None]])
    ea = torch.cat([ea[keep], ea[~keep].sum()[None]])
    eb = torch.cat([eb[keep], eb[~keep].sum()[None]])
    used = ea > 0
    stat = float((((oa - ea) ** 2 / ea)[used]).sum() + (((ob - eb) ** 2 / eb)[used]).sum())
    dof = int(used.sum()) - 1
    tv = float(0.5 * (ca / na - cb / nb).abs().sum())
    return stat, dof, chi2_sf(stat, dof), tv


def chi2_sf(x: float, k: int) -> float:
    """P(chi2_k > x): scipy's where it imports, else the Wilson-Hilferty approximation."""
    if k <= 0:
        return 1.0
    try:
        from scipy.stats import chi2

        return float(chi2.sf(x, k))
    except ImportError:
        import math

        z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
        return 0.5 * math.erfc(z / math.sqrt(2))


STAGE_FUNCTIONS = {"env": stage_env, "suite": stage_suite, "equality": stage_equality, "replay": stage_replay,
                   "compiled": stage_compiled,
                   "profile": stage_profile,
                   "sync": stage_sync, "memory": stage_memory, "kernels": stage_kernels, "quant": stage_quant,
                   "sampling": stage_sampling}


# ============================================================================ main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="small shapes (runs on a 2-core CPU in a few minutes)")
    p.add_argument("--only", help=f"comma-separated stages, in this order: {','.join(STAGES)}")
    p.add_argument("--skip", default="", help="comma-separated stages to leave out")
    p.add_argument("--out", default="device_report", help="report folder (kept stages of earlier runs are merged)")
    p.add_argument("--mirror", action="append", default=[], help="also copy the report here after every stage")
    p.add_argument("--budget-s", default="", help="seconds per stage: one number for all, or stage=seconds,...")
    p.add_argument("--total-s", type=float, default=570.0, help="seconds for the whole run (stages shrink to fit)")
    p.add_argument("--kernels", default="", help="kernels stage: only these of sdpa,eager,flex_attention,"
                   "flash_attention_2,static,static+compile (default: all)")
    p.add_argument("--replay-cells", default="", help="replay stage: CONTEXTxBATCH cells in this order, e.g. "
                   "8192x1,1024x16 (default: every context x batch of the shapes, batch 1 first)")
    p.add_argument("--compiled-cells", default="", help="compiled stage: CONTEXTxBATCH cells (default 1024x1,1024x4; "
                   "--small: 64x1,64x2)")
    p.add_argument("--compiled-modes", default="", help="compiled stage: these modes only, separated by ';' (chain 3; "
                   "chain 5; chain 8; tree; default; chain 5, eager levels; default, eager levels)")
    p.add_argument("--compiled-rates", default="", help="compiled stage: the acceptance curve's withheld rates, "
                   "e.g. 0.15,0.35,0.5,1.0 (default 0.15,0.25,0.35,0.5,1.0)")
    p.add_argument("--compile-cpu", action="store_true", help="compiled stage on a CPU: compile through inductor "
                   "(transformers compiles automatically on CUDA only)")
    p.add_argument("--profile-cells", default="", help="profile stage: CONTEXTxBATCH cells, e.g. 8192x1,1024x4 "
                   "(default: 512x1; --small: 64x1)")
    p.add_argument("--suite-args", nargs="*", help="pytest arguments of the suite stage (default: tests)")
    args = p.parse_args(argv)
    chosen = [x for x in (args.only.split(",") if args.only else STAGES) if x]
    unknown = [x for x in chosen + [x for x in args.skip.split(",") if x] if x not in STAGES]
    if unknown:
        p.error(f"unknown stage(s) {unknown}; stages: {', '.join(STAGES)}")
    args.stages = [x for x in STAGES if x in chosen and x not in args.skip.split(",")]
    args.budgets = {name: BUDGETS[name][1 if args.small else 0] for name in STAGES}
    for item in [x for x in args.budget_s.split(",") if x]:
        if "=" in item:
            name, secs = item.split("=", 1)
            args.budgets[name] = float(secs)
        else:
            args.budgets = {name: float(item) for name in STAGES}
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    import eagle_hf  # noqa: F401  (installs the generate() hooks)

    ctx = Context(args)
    if ctx.device.type == "cpu" and args.small:
        torch.set_num_threads(1)  # tiny models on a small shared CPU: one intra-op thread is several times faster
    meta = {"device": str(ctx.device), "small": args.small, "torch": torch.__version__,
            "transformers": transformers.__version__, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "host": platform.node(),
            "device_name": torch.cuda.get_device_name(ctx.device) if ctx.cuda else platform.processor() or "cpu"}
    report = ctx.report = Report(ctx.out, [Path(m) for m in args.mirror], meta)
    total = Budget(args.total_s)
    for name in args.stages:
        seconds = min(args.budgets[name], total.left() - 10)
        if seconds <= 5:
            report.record(name, dict(StageResult(), status="skipped", summary="the run's total budget is spent"))
            continue
        report.record(name, dict(StageResult(), status="running", summary="(running; a kill leaves this line)"))
        print(f"[device_check] {name} (budget {seconds:.0f} s)", flush=True)
        ctx.stage = name
        start = time.perf_counter()
        try:
            result = STAGE_FUNCTIONS[name](ctx, Budget(seconds))
        except Exception as err:  # noqa: BLE001 - every stage reports; the next one runs
            result = StageResult()
            result.update(status="error", summary=f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}",
                          error=traceback.format_exc())
            if ctx.cuda:
                torch.cuda.empty_cache()
        result["seconds"] = time.perf_counter() - start
        report.record(name, dict(result))
        ctx.ran.append(name)
        print(f"[device_check] {name}: {result['status']} in {result['seconds']:.0f} s: {result['summary']}", flush=True)
    print(f"[device_check] report: {ctx.out / 'report.md'}", flush=True)
    return 0 if all(report.stages.get(n, {}).get("status") in ("ok", "skipped", "partial") for n in args.stages) else 1


if __name__ == "__main__":
    sys.exit(main())
