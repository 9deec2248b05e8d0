"""Check eagle_hf on one device in one command and leave a report: versions, the test suite, greedy equality with
plain generate(), the loop's ceiling with a replay drafter, host-device syncs, where a round's time goes (profile),
memory, attention kernels and caches, quantized targets, and the sampling distribution. Nothing is downloaded: every model is random, built from a config.

The command line of scripts/device_check.py, which runs `main` after its bootstrap: the arguments, the stages'
budgets and functions, and the run loop that records each stage in the report.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

from .common import STAGES, Budget, Context, Report, StageResult
from .compiled import stage_compiled
from .env import stage_env
from .equality import stage_equality
from .kernels import stage_kernels
from .memory import stage_memory
from .profile import stage_profile
from .quant import stage_quant
from .replay import stage_replay
from .sampling import stage_sampling
from .suite import stage_suite
from .sync import stage_sync
from .training import stage_training

#: seconds per stage: (full shapes on a GPU, --small)
#: (full shapes: a few stages at a time fit ten minutes, docs/gpu.md)
BUDGETS = {"env": (30, 30), "suite": (540, 900), "equality": (200, 120), "replay": (300, 120), "compiled": (300, 240), "sync": (120, 90), "profile": (120, 60),
           "memory": (130, 60), "kernels": (210, 120), "quant": (120, 90), "sampling": (120, 120),
           "training": (120, 60)}


STAGE_FUNCTIONS = {"env": stage_env, "suite": stage_suite, "equality": stage_equality, "replay": stage_replay,
                   "compiled": stage_compiled,
                   "profile": stage_profile,
                   "sync": stage_sync, "memory": stage_memory, "kernels": stage_kernels, "quant": stage_quant,
                   "sampling": stage_sampling, "training": stage_training}


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
                   "chain 5; chain 8; tree; default; chain 5, eager levels; default, eager levels; by name only: chain 5, "
                   "chain 8 and default with ', dynamic widths'; chain 5, tree and default with ', dynamic cache': the default dynamic "
                   "cache, the README's GPU example's path)")
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
        if seconds < min(args.budgets[name], 5):  # (a stage asked for 5 s runs: env's budget)
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
