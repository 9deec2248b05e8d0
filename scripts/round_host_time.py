"""Host milliseconds a round outside the target's forward on the compiled path, on the CPU: transformers' automatic
compile forced on (a static cache, as tests/test_static_cache.py does), the device check's cycle target (32 layers,
tiny widths) and its oracle drafter (every draft accepted), one thread, warm calls (the compiles and the first
calls' set-up left out). The target's forward (`TreeLoop.forward`) is timed and taken out; what is left is what
the host spends on everything else a round: planning, drafting (the drafter's programs or eager passes), the
verify's set-up, acceptance, the commit, the bookkeeping.

    python scripts/round_host_time.py                   # chain 5 and a depth-5 tree, median of 7 calls
    PYTHONPATH=/path/to/other/checkout python scripts/round_host_time.py --json other.json   # another version

To compare two versions, run both in turn on a quiet machine (farm-bench pairs whole commands). Times are
reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # (after PYTHONPATH: another checkout may be measured)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import round_ops  # (the same target, drafter and prompts)

SCENARIOS = {name: round_ops.SCENARIOS[name] for name in ("chain 5", "tree, depth 5")}


def host_ms_per_round(name: str, target, drafter, succ, calls: int, new_tokens: int) -> float:
    """Median over `calls` warm calls of (call time - the target's forwards) / rounds, in ms."""
    from transformers import CompileConfig

    import eagle_hf
    from benchmarks.device_check.common import oracle_drafter
    from eagle_hf.hf.tree_loop import TreeLoop

    rows, kwargs = SCENARIOS[name]
    config = CompileConfig()
    config._compile_all_devices = True  # (transformers compiles on accelerators only unless told)
    run = dict(kwargs, assistant_model=drafter, max_new_tokens=new_tokens, do_sample=False,
               cache_implementation="static", compile_config=config)
    spent = [0.0]
    forward = TreeLoop.forward

    def timed(self, *args, **kw):
        start = time.perf_counter()
        try:
            return forward(self, *args, **kw)
        finally:
            spent[0] += time.perf_counter() - start

    samples = []
    TreeLoop.forward = timed
    try:
        with oracle_drafter(drafter, succ, rows=rows):
            for call in range(calls + 3):  # (three warm-ups: compiles, first shapes)
                spent[0] = 0.0
                start = time.perf_counter()
                target.generate(**round_ops.prompt(rows, succ), **run)
                total = time.perf_counter() - start
                s = eagle_hf.last_stats()
                rounds = max(s.cycles + s.fallback_steps + s.final_steps, 1)
                if call >= 3:
                    samples.append(1000 * (total - spent[0]) / rounds)
    finally:
        TreeLoop.forward = forward
    print(name, " ".join(f"{x:.2f}" for x in samples), file=sys.stderr)
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("EAGLE_HF_COST_CACHE", "off")
    torch.set_num_threads(1)
    import eagle_hf

    target, drafter, succ = round_ops.pair()
    out = {"eagle_hf": str(Path(eagle_hf.__file__).parent)}
    for name in SCENARIOS:
        out[name] = host_ms_per_round(name, target, drafter, succ, args.calls, args.new_tokens)
        print(f"{name}: {out[name]:.2f} host ms a round outside the target's forward")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
