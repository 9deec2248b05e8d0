"""One launch of regime R's drafting program, timed apart from the round: warm, and right after a target forward.

Runs regime R's case (`benchmarks/round_regime.py`: the tiny Llama target, a random EAGLE-3.1 drafter, greedy,
float32, one thread) on the static compiled path for a few calls, then takes the drafter program launched most often
(a drafting round's catch-up and levels as one program) and launches it again and again with the buffers its last
launch left, under ``torch.no_grad`` as the loop runs it:

* "warm": back to back, its code and data in the caches;
* "after a target forward": each launch right after one forward of the target over 8 tokens, as in a round, where
  the target's forward has pushed the program's code and data out of the core's caches.

The median µs a launch of each. What the program does is unchanged by launching it again (its catch-up writes the
same rows; its levels write the tree rows the next launch overwrites): only its time is measured.

    python benchmarks/program_launch.py                          # chain 5
    python benchmarks/program_launch.py --mode "tree, depth 5"

Times are reported, never asserted; on a shared 2-core host run it with nothing else running.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent))  # (round_regime's regime R)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="chain 5", help="a mode of round_regime.py")
    parser.add_argument("--launches", type=int, default=300)
    args = parser.parse_args()
    os.environ.setdefault("EAGLE_HF_COST_CACHE", "off")
    torch.set_num_threads(1)
    import round_regime

    from eagle_hf import programs

    launched: dict[int, list] = {}  # program id -> [program, its arguments, launches]
    launch = programs.Program.__call__

    def counted(program, *first):
        launched.setdefault(id(program), [program, first, 0])[2] += 1
        return launch(program, *first)

    target, drafter = round_regime.pair()
    kwargs = round_regime.run_kwargs(args.mode, "static", drafter, 64)
    programs.Program.__call__ = counted
    try:
        for _ in range(3):
            target.generate(**round_regime.prompts(1), **kwargs)
    finally:
        programs.Program.__call__ = launch
    program, first, count = max((entry for entry in launched.values() if entry[0].name.startswith("drafter")),
                                key=lambda entry: entry[2])  # (not the cache's commit: a drafting program)
    ids = torch.randint(3, round_regime.SHAPE["vocab_size"], (1, 8))
    with torch.no_grad():
        for _ in range(20):
            program(*first)
        figures = {}
        for case in ("warm", "after a target forward"):
            times = []
            for _ in range(args.launches):
                if case != "warm":
                    target(input_ids=ids)
                start = time.perf_counter()
                program(*first)
                times.append(time.perf_counter() - start)
            figures[case] = 1e6 * statistics.median(times)
    print(f"{args.mode}: the {program.name} ({count} launches in 3 calls), µs a launch: "
          + ", ".join(f"{case} {us:.0f}" for case, us in figures.items()))


if __name__ == "__main__":
    main()
