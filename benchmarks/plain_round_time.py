"""Host time of a plain round of eagle_hf's loop against a plain generate() step (tiny random Llama target, one
thread): every round of eagle_hf's loop made plain (the adaptive schedule's choice patched to 0, the drafter
alone), the two interleaved, median of the per-round host time outside the target's forwards and the drafter.

    python benchmarks/plain_round_time.py             # target: within 0.1 ms of a plain generate() step
    python benchmarks/plain_round_time.py --compiled  # transformers' compiled path (static cache, compile forced
                                                      # on the CPU): wall time per round, the forwards included
    python benchmarks/plain_round_time.py --compiled --profile  # and the eagle_hf rounds' hottest functions
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import sync_probe  # (scripts/sync_probe.py: the tiny target and its inputs)

import eagle_hf
from eagle_hf.speculation.schedule import DraftLengthController


def main(repeats: int = 15, new_tokens: int = 64, compiled: bool = False, profile: bool = False) -> None:
    torch.set_num_threads(1)
    target, drafter = sync_probe.tiny_pair()
    forward_time = [0.0]
    original = type(target).forward
    call = {}
    if compiled:  # the forwards inside the compiled graph are not timed apart: per-round wall time
        from transformers import CompileConfig

        config = CompileConfig()
        config._compile_all_devices = True  # (transformers compiles on accelerators only unless told)
        call = dict(cache_implementation="static", compile_config=config)
    else:
        def timed(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                forward_time[0] += time.perf_counter() - start

        type(target).forward = timed
    DraftLengthController.choose = lambda self: 0  # every round plain
    modes = {"plain generate() step": {}, "eagle_hf plain round": {"assistant_model": drafter,
                                                                     "draft_sources": "eagle"}}
    samples = {name: [] for name in modes}
    profiler = cProfile.Profile() if profile else None
    for r in range(repeats + 1):
        for name, kwargs in modes.items():
            forward_time[0] = 0.0
            measured = profiler is not None and r and kwargs
            if measured:
                profiler.enable()
            start = time.perf_counter()
            target.generate(**sync_probe.inputs_for(1), max_new_tokens=new_tokens, do_sample=False, **call, **kwargs)
            total = time.perf_counter() - start
            if measured:
                profiler.disable()
            stats = eagle_hf.last_stats() if kwargs else None
            rounds = stats.steps if stats else new_tokens - 1
            drafter_time = stats.drafter_time if stats else 0.0
            if r:  # (the first: warm-up, and the compiles)
                samples[name].append(1000 * (total - forward_time[0] - drafter_time) / rounds)
    what = "wall time" if compiled else "host time"
    for name, values in samples.items():
        print(f"{name}: {statistics.median(values):.3f} ms {what} per round (median of {repeats}; "
              f"min {min(values):.3f}, max {max(values):.3f})")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compiled", action="store_true", help="transformers' compiled path (static cache)")
    parser.add_argument("--profile", action="store_true", help="cProfile the eagle_hf rounds")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    main(repeats=args.repeats, compiled=args.compiled, profile=args.profile)
