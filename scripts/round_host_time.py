"""Host milliseconds a round outside the target's forward on the compiled path, on the CPU: transformers' automatic
compile forced on (a static cache, as tests/test_static_cache.py does), the device check's cycle target (32 layers,
tiny widths) and its oracle drafter (every draft accepted), one thread, warm calls (the compiles and the first
calls' set-up left out). The target's forward (`TreeLoop.forward`) is timed and taken out; what is left is what
the host spends on everything else a round: planning, drafting (the drafter's programs or eager passes), the
verify's set-up, acceptance, the commit, the bookkeeping. Two figures: per round of a 48-token call (its own
work, the prompt's catch-up among it, shared by its rounds), and the steady state (the slope between calls of 48
and 96 new tokens: what one more round costs).

    python scripts/round_host_time.py                   # chain 5 and a depth-5 tree, medians of 7 calls
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


def host_ms(name: str, target, drafter, succ, calls: int, new_tokens: int) -> tuple[float, float]:
    """(ms a round, steady ms a round): the median over `calls` warm calls of (call time - the target's forwards)
    / rounds, and the slope of the host ms a call between `new_tokens` and twice as many (the call's own work,
    the prefill's catch-up among it, taken out), calls of the two lengths alternating."""
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

    samples = {new_tokens: [], 2 * new_tokens: []}  # per length: (host ms, rounds) a call
    TreeLoop.forward = timed
    try:
        with oracle_drafter(drafter, succ, rows=rows):
            for call in range(2 * calls + 6):  # (three warm-ups of each length: compiles, first shapes)
                length = new_tokens * (1 + call % 2)
                spent[0] = 0.0
                start = time.perf_counter()
                target.generate(**round_ops.prompt(rows, succ), **dict(run, max_new_tokens=length))
                total = time.perf_counter() - start
                s = eagle_hf.last_stats()
                if call >= 6:
                    samples[length].append((1000 * (total - spent[0]), s.cycles + s.fallback_steps + s.final_steps))
    finally:
        TreeLoop.forward = forward
    short, long = (samples[n] for n in sorted(samples))
    per_round = statistics.median(ms / max(r, 1) for ms, r in short)
    more = statistics.median(r for _, r in long) - statistics.median(r for _, r in short)
    steady = (statistics.median(ms for ms, _ in long) - statistics.median(ms for ms, _ in short)) / max(more, 1)
    return per_round, steady


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
        out[name], out[f"{name}, steady"] = host_ms(name, target, drafter, succ, args.calls, args.new_tokens)
        print(f"{name}: {out[name]:.2f} host ms a round outside the target's forward ({args.new_tokens} new "
              f"tokens); steady state {out[f'{name}, steady']:.2f} ms a round")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
