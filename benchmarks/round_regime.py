"""Reads and host time a round where copies are found and the drafter is often wrong: regime R.

A tiny 8-layer Llama target (hidden 64, vocabulary 512), a random EAGLE-3.1 drafter (the reference layout, random
weights), prompts of 48 tokens that repeat their first half (so the copy source finds matches), 64 new tokens, greedy,
float32, one thread. Modes: chain 5, a depth-5 tree (top-k 4, 16 tokens) and the default; batch 1 and a ragged batch
of 4 (left padded); (i) a static cache with transformers' compile forced on the CPU, (ii) the default dynamic cache.

Per case: the blocking device-to-host reads a round (median and mean over the call's rounds, the prefill and the
last round left out: `eagle_hf.tools.sync_probe`), and the host milliseconds a round outside the target's forward
(median over warm calls of the call's time less its target forwards, over its rounds).

    python benchmarks/round_regime.py                      # the table (markdown), 5 timed calls a case
    python benchmarks/round_regime.py --calls 3 --only dynamic
    python benchmarks/round_regime.py --only dynamic --no-time --ops   # torch operations a round (deterministic)
    python benchmarks/round_regime.py --only static --modes "chain 5" --rows 1 --split   # the drafting step apart
    PYTHONPATH=/path/to/other/checkout python benchmarks/round_regime.py --json other.json   # another version

To compare two versions, run both in turn on a quiet machine; times are reported, never asserted. Reads are
deterministic (tests/test_round_ops.py pins them).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # (after PYTHONPATH: another checkout may be measured)

SHAPE = dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=512, max_position_embeddings=4096)
MODES = {
    "chain 5": dict(draft_mode="chain", num_assistant_tokens=5, num_assistant_tokens_schedule="constant"),
    "tree, depth 5": dict(draft_mode="tree", tree_depth=5, tree_top_k=4, tree_total_tokens=16,
                          num_assistant_tokens_schedule="constant"),
    "default": {},
}
CACHES = ("static", "dynamic")
#: the ragged batch's prompt lengths (each repeats its first half), left padded to the longest
RAGGED = (48, 40, 44, 36)


def pair(seed: int = 0):
    """(target, drafter): the tiny Llama and a random EAGLE-3.1 drafter for it, float32 on the CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle_hf import EagleDrafter

    torch.manual_seed(seed)
    target = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    drafter = EagleDrafter.for_target(target, eagle31=True).eval()
    return target, drafter


def prompts(rows: int, seed: int = 1) -> dict:
    """`rows` prompts that repeat their first half (48 tokens for one row; `RAGGED` lengths for a batch), left
    padded."""
    g = torch.Generator().manual_seed(seed)
    lengths = [48] if rows == 1 else list(RAGGED[:rows])
    width = max(lengths)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for b, n in enumerate(lengths):
        half = torch.randint(3, SHAPE["vocab_size"], (n // 2,), generator=g)
        ids[b, width - n :], mask[b, width - n :] = torch.cat([half, half]), 1
    return {"input_ids": ids, "attention_mask": mask}


def run_kwargs(mode: str, cache: str, drafter, new_tokens: int) -> dict:
    from transformers import CompileConfig

    out = dict(MODES[mode], assistant_model=drafter, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if cache == "static":
        config = CompileConfig()
        config._compile_all_devices = True  # (transformers compiles on accelerators only unless told)
        out.update(cache_implementation="static", compile_config=config)
    return out


def reads(target, drafter, mode: str, cache: str, rows: int, new_tokens: int) -> dict:
    """Reads a round over one call (after a warm call): median, mean, and the rounds counted."""
    from eagle_hf.tools.sync_probe import probe_generate

    kwargs = run_kwargs(mode, cache, drafter, new_tokens)
    target.generate(**prompts(rows), **kwargs)
    probe = probe_generate(target, prompts(rows), **kwargs)
    counted = [r.reads for r in probe.rounds[2:-1]]  # (rounds[0]: before the first round; [1]: the prefill)
    return {"reads median": statistics.median(counted) if counted else None,
            "reads mean": statistics.fmean(counted) if counted else None, "rounds": len(counted)}


@contextlib.contextmanager
def target_forwards(target):
    """The target's forwards (eagle_hf's loop's, the compiled one too, and those transformers' assisted loop runs)
    watched while the block runs: the yielded dict holds the seconds spent in them ("spent") and how many are
    running ("inside")."""
    from eagle_hf.hf.tree_loop import TreeLoop

    state = {"spent": 0.0, "inside": 0}
    forward, model_forward = TreeLoop.forward, type(target).forward

    def watched(run):
        def call(self, *args, **kw):
            if state["inside"]:  # (the model's forward inside eagle_hf's loop's)
                return run(self, *args, **kw)
            start, state["inside"] = time.perf_counter(), 1
            try:
                return run(self, *args, **kw)
            finally:
                state["spent"] += time.perf_counter() - start
                state["inside"] = 0

        return functools.wraps(run)(call)  # (its signature kept: routing reads which arguments the forward takes)

    TreeLoop.forward, type(target).forward = watched(forward), watched(model_forward)
    try:
        yield state
    finally:
        TreeLoop.forward, type(target).forward = forward, model_forward


def rounds_of_last_call() -> int:
    import eagle_hf

    s = eagle_hf.last_stats()
    return max(s.cycles + s.fallback_steps + s.final_steps, 1)


#: the host steps `--split` times apart, each where the measured version has it (the first of its places that it
#: has): the round's drafting step, the copy branches' host part (laid out in the drafting launch: their rows;
#: grafted after it: the whole layout), and the tree loop's acceptance (the round's read), commit (the caches and
#: the drafter's rows) and verify mask
STEPS = {"drafting": [("eagle_hf.hf.tree_loop", "draft_round")],
         "copy branches": [("eagle_hf.speculation.drafting", "TreeRequest.copy_rows"),
                           ("eagle_hf.speculation.drafting", "PendingTrees.graft_copies"),
                           ("eagle_hf.speculation.speculator", "PendingTrees.graft_copies")],
         "accept": [("eagle_hf.hf.tree_loop", "TreeLoop.accept")],
         "commit": [("eagle_hf.hf.tree_loop", "TreeLoop.commit")],
         "verify mask": [("eagle_hf.hf.tree_loop", "TreeLoop.verify_mask")]}


@contextlib.contextmanager
def steps_timed():
    """The `STEPS` this version has, timed while the block runs: the yielded dict holds each one's seconds."""

    spent, undo = {}, []
    for name, places in STEPS.items():
        found = [place for place in (_place(*where) for where in places) if place is not None]
        if not found:
            continue
        owner, attr, step = found[0]

        def timed(*args, _step=step, _name=name, **kw):
            start = time.perf_counter()
            try:
                return _step(*args, **kw)
            finally:
                spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - start

        setattr(owner, attr, functools.wraps(step)(timed))
        undo.append((owner, attr, step))
    try:
        yield spent
    finally:
        for owner, attr, step in undo:
            setattr(owner, attr, step)


def _place(module: str, path: str):
    """(the object holding `path` in `module`, its last name, what it holds there), or None where it is not."""
    import importlib

    owner = importlib.import_module(module)
    *holder, attr = path.split(".")
    for part in holder:
        owner = getattr(owner, part, None)
    step = getattr(owner, attr, None)
    return None if step is None else (owner, attr, step)


def calibration_ms() -> float:
    """The host's speed now: the median ms of a fixed piece of host work like a round's (small tensor operations and
    Python between them), the same in every version. This host's speed moves by up to half from process to
    process; a round's host time over this, measured beside it in the same process, does not move with it."""
    a, b = torch.randn(4, 64), torch.randn(64, 64)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for i in range(200):
            c = torch.cat([a @ b, a], 1).argmax(-1).tolist()
            _ = {j: [x + i for x in c] for j in range(4)}
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def host_ms(target, drafter, mode: str, cache: str, rows: int, new_tokens: int, calls: int,
            split: bool = False) -> dict[str, float]:
    """Medians over `calls` warm calls: "host ms", the call's time less its target forwards over its rounds, in ms;
    "host ms a call", the same for the whole call (a round's host time also moves with how the schedule split the
    call into rounds, and every version emits the same tokens: greedy, lossless); "host per calibration", a round's
    host time over `calibration_ms` timed before its call (x 1000: what a change to the round's host work moves,
    whatever the host's speed); with `split`, "<step> ms" a round in each of the `STEPS`."""
    kwargs = run_kwargs(mode, cache, drafter, new_tokens)
    samples: dict[str, list[float]] = {}
    with target_forwards(target) as state, (steps_timed() if split else contextlib.nullcontext({})) as spent:
        for call in range(calls + 2):  # (two warm-ups: compiles, first shapes)
            calibration = calibration_ms() if call >= 2 else None
            state["spent"] = 0.0
            spent.clear()
            start = time.perf_counter()
            target.generate(**prompts(rows), **kwargs)
            host = 1000 * (time.perf_counter() - start - state["spent"])
            if call >= 2:
                rounds = rounds_of_last_call()
                for name, ms in {"host ms": host / rounds, "host ms a call": host,
                                 "host per calibration": 1000 * host / rounds / calibration,
                                 **{f"{step} ms": 1000 * sec / rounds for step, sec in spent.items()}}.items():
                    samples.setdefault(name, []).append(ms)
    return {name: statistics.median(v) for name, v in samples.items()}


def host_ops(target, drafter, mode: str, cache: str, rows: int, new_tokens: int) -> float:
    """The torch operations a warm call dispatches outside its target's forwards, per round (deterministic: what
    the host time a round is mostly made of on a CPU; a compiled program's body counts as the calls it makes through
    torch's dispatcher: under inductor's C++ wrapper, its extern kernels)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    kwargs = run_kwargs(mode, cache, drafter, new_tokens)
    count = [0]
    with target_forwards(target) as state:

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kw=None):
                count[0] += not state["inside"]
                return func(*args, **(kw or {}))

        target.generate(**prompts(rows), **kwargs)  # (warm)
        with Count():
            target.generate(**prompts(rows), **kwargs)
    return count[0] / rounds_of_last_call()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--only", choices=CACHES, default=None, help="one cache only")
    parser.add_argument("--modes", default=";".join(MODES), help="modes, separated by ';'")
    parser.add_argument("--rows", default="1,4", help="batch sizes, separated by ','")
    parser.add_argument("--no-time", action="store_true", help="reads only")
    parser.add_argument("--ops", action="store_true", help="also the torch operations a round outside the target's "
                        "forward (deterministic)")
    parser.add_argument("--split", action="store_true", help="also the host ms a round in the drafting step "
                        "(`draft_round`), and in the JSON in each of `STEPS`; time one mode a process for it (a "
                        "mode's compiled graphs stay for the next)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("EAGLE_HF_COST_CACHE", "off")
    torch.set_num_threads(1)
    import eagle_hf

    target, drafter = pair()
    out = {"eagle_hf": str(Path(eagle_hf.__file__).parent), "cases": {}}
    print("| cache | mode | rows | reads a round (median / mean) | host ms a round outside the target's forward |"
          + (" of which the drafting step |" if args.split else "") + (" operations a round outside it |" if args.ops else ""))
    print("|---|---|---|---|---|" + ("---|" if args.split else "") + ("---|" if args.ops else ""))
    for cache in [args.only] if args.only else CACHES:
        for mode in args.modes.split(";"):
            for rows in [int(r) for r in args.rows.split(",")]:
                row = {}  # (timed first: the probes' modes, once a compiled forward ran under them, leave it
                # recompiled for them, and a static case timed after them measured up to three times its time)
                if not args.no_time:
                    row.update(host_ms(target, drafter, mode, cache, rows, args.new_tokens, args.calls, args.split))
                if args.ops:
                    row["ops"] = host_ops(target, drafter, mode, cache, rows, args.new_tokens)
                row.update(reads(target, drafter, mode, cache, rows, args.new_tokens))
                out["cases"][f"{cache} | {mode} | {rows}"] = row
                mean = row["reads mean"]
                print(f"| {cache} | {mode} | {rows} | {row['reads median']} / "
                      f"{'-' if mean is None else f'{mean:.2f}'} | {row.get('host ms', float('nan')):.2f} |"
                      + (f" {row.get('drafting ms', float('nan')):.2f} |" if args.split else "") + (f" {row['ops']:.0f} |" if args.ops else ""),
                      flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
