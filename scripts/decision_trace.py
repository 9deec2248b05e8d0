"""Trace the adaptive schedule's decisions, call by call (issue 35: why the default's speed differs between
processes). Runs `eagle-hf bench` with plain generate() and the default on one prompt set, and records for every
call of the default the controller's choice each round (depth, modelled gain), its round timings and what it had
learnt at the end (costs relative to a one-token forward, acceptance per depth).

    python scripts/decision_trace.py questions /tmp/trace_1.json [--limit 20]   # once per process, then:
    python scripts/decision_trace.py --compare /tmp/trace_1.json /tmp/trace_2.json

The comparison lists, per prompt, the share of rounds where the drafter rested in each process and the gains the
controller saw in its first rounds: a prompt decided differently by two processes shows the gain on either side
of the threshold there.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def trace(set_name: str, out: str, limit: int) -> None:
    from eagle_hf.cli import main
    from eagle_hf.hf import call as eagle_call  # (where a call builds its controller)

    calls = []
    original = eagle_call.controller_for

    def recording(*args, **kwargs):
        c = original(*args, **kwargs)
        if c is None:
            return c
        log = {"choices": [], "timings": []}
        calls.append((c, log))
        choose, observe = c.choose, c.observe

        def choose_logged():
            gain = c.best()[1]
            depth = choose()
            log["choices"].append((depth, round(gain, 3)))
            return depth

        def observe_logged(t):
            log["timings"].append((t.seconds, t.verify, t.draft, t.catch_up, t.width, t.levels, t.drafter_prefill))
            observe(t)

        c.choose, c.observe = choose_logged, observe_logged
        return c

    eagle_call.controller_for = recording
    os.environ.setdefault("EAGLE_HF_COST_CACHE", "off")
    main(["bench", "--dtype", "bfloat16", "--prompts", set_name, "--limit", str(limit), "--max-new-tokens", "128",
          "--repeats", "1", "--modes", "eagle default", "--out", out + ".bench"])
    rows = []
    for c, log in calls[1:]:  # (the first call is the bench's warm-up)
        r = c.costs
        rows.append({"base_ms": r.cost.base_seconds * 1e3, "draft_step": r.draft_step,
                     "round_overhead": r.round_overhead, "loop_overhead": r.loop_overhead,
                     "cycle_overhead": r.cycle_overhead,
                     "forward": {n: round(r.cost.forward(n), 3) for n in (1, 2, 4, 8, 16, 32)},
                     "acceptance": [round(a, 3) for a in c.acceptance.values], **log})
    with open(out, "w") as f:
        json.dump(rows, f)
    print(f"{len(rows)} calls traced: {out}")


def rested(row: dict) -> float:
    return sum(depth == 0 for depth, _ in row["choices"]) / max(len(row["choices"]), 1)


def compare(a: str, b: str) -> None:
    ra, rb = (json.loads(Path(p).read_text()) for p in (a, b))
    flips = 0
    for i, (x, y) in enumerate(zip(ra, rb)):
        differs = abs(rested(x) - rested(y)) > 0.3
        flips += differs
        print(f"prompt {i:2d}: drafter rested {rested(x):4.0%} / {rested(y):4.0%} of rounds; first gains "
              f"{[g for _, g in x['choices'][:3]]} / {[g for _, g in y['choices'][:3]]}{'  <- decided apart' if differs else ''}")
    print(f"{flips} of {min(len(ra), len(rb))} prompts decided apart (rest shares more than 30 points apart)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("set_or_trace")
    p.add_argument("out_or_trace")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--compare", action="store_true", help="compare two traces instead of running one")
    args = p.parse_args()
    if args.compare:
        compare(args.set_or_trace, args.out_or_trace)
    else:
        trace(args.set_or_trace, args.out_or_trace, args.limit)
