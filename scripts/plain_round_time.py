"""Host time of a plain round of eagle_hf's loop against a plain generate() step (tiny random Llama target, one
thread): every round of eagle_hf's loop made plain (the adaptive schedule's choice patched to 0, the drafter
alone), the two interleaved, median of the per-round host time outside the target's forwards and the drafter.

    python scripts/plain_round_time.py          # issue 32's target: within 0.1 ms of a plain generate() step
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import sync_probe  # (this folder's: the tiny target and its inputs)

import eagle_hf
from eagle_hf.speculation.schedule import DraftLengthController


def main(repeats: int = 15, new_tokens: int = 64) -> None:
    torch.set_num_threads(1)
    target, drafter = sync_probe.tiny_pair()
    forward_time = [0.0]
    original = type(target).forward

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
    for r in range(repeats + 1):
        for name, kwargs in modes.items():
            forward_time[0] = 0.0
            start = time.perf_counter()
            target.generate(**sync_probe.inputs_for(1), max_new_tokens=new_tokens, do_sample=False, **kwargs)
            total = time.perf_counter() - start
            stats = eagle_hf.last_stats() if kwargs else None
            rounds = stats.steps if stats else new_tokens - 1
            drafter_time = stats.drafter_time if stats else 0.0
            if r:  # (the first: warm-up)
                samples[name].append(1000 * (total - forward_time[0] - drafter_time) / rounds)
    for name, values in samples.items():
        print(f"{name}: {statistics.median(values):.3f} ms host time per round (median of {repeats}; "
              f"min {min(values):.3f}, max {max(values):.3f})")


if __name__ == "__main__":
    main()
