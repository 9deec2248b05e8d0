"""What a round launches around the target's forward, counted on the CPU: device operations outside the target's
forward and outside the programs' bodies (`eagle_hf.programs`: one launch each), program launches, and blocking
device-to-host reads, per round (median), on the compiled path's code: a static cache and fixed-shape drafting.

The target is the device check's cycle target (a random Llama whose next token is a fixed function of the current
one), 32 layers as Llama-3.1-8B has, tiny widths; the drafter is its oracle (its drafts follow the target, so every
draft is accepted: the widest commits). On a GPU each operation is about one kernel launch (15-25 µs of host time on
an H200's host); a program launch is one CUDA graph replay.

    python scripts/round_ops.py              # the table (markdown)
    python scripts/round_ops.py --culprits   # the operations behind the counts, per scenario
    python scripts/round_ops.py --json out.json

Counts are deterministic; tests/test_round_ops.py pins them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # (after PYTHONPATH: another checkout may be measured)

#: name -> (rows, generate() keywords)
SCENARIOS = {
    "chain 5": (1, dict(draft_mode="chain", num_assistant_tokens=5, num_assistant_tokens_schedule="constant")),
    "tree, depth 5": (1, dict(draft_mode="tree", tree_depth=5, tree_top_k=4, tree_total_tokens=16,
                              draft_sources="eagle", num_assistant_tokens_schedule="constant")),
    "chain 5, batch of 4": (4, dict(draft_mode="chain", num_assistant_tokens=5,
                                    num_assistant_tokens_schedule="constant")),
    "default, resting": (1, dict(draft_sources="eagle")),  # the drafter never right: plain rounds
}
#: scenarios whose drafter is never right (its continuation withheld everywhere), and the rounds counted there
NEVER_RIGHT = {"default, resting"}
SHAPE = dict(hidden_size=64, num_hidden_layers=32, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=512, max_position_embeddings=4096)
DRAFT_VOCAB = 128


def pair():
    """(cycle target, drafter, succ) at `SHAPE`, float32 on the CPU."""
    from benchmarks.device_check.common import build_drafter, cycle_target, draft_ids

    within = draft_ids(SHAPE["vocab_size"], DRAFT_VOCAB, seed=22)
    target, succ = cycle_target(SHAPE, torch.float32, torch.device("cpu"), seed=21, within=within)
    drafter = build_drafter(target, DRAFT_VOCAB, seed=22)
    return target, drafter, succ


def prompt(rows: int, succ: torch.Tensor, length: int = 24) -> dict:
    """Prompts on the target's cycle, each from another token of the draft vocabulary (so the oracle's drafts are
    the continuation from the first round)."""
    from benchmarks.device_check.common import draft_ids

    starts = draft_ids(SHAPE["vocab_size"], DRAFT_VOCAB, seed=22)
    ids = torch.zeros(rows, length, dtype=torch.long)
    for b in range(rows):
        t = int(starts[7 * b])
        for i in range(length):
            ids[b, i], t = t, int(succ[t])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def count(name: str, target, drafter, succ, new_tokens: int = 40) -> dict:
    """The scenario's per-round medians (drafting rounds; plain ones where the drafter is never right): ops,
    launches, reads; and the ops behind them."""
    from benchmarks.device_check.common import oracle_drafter
    from eagle_hf.tools.sync_probe import probe_generate

    rows, kwargs = SCENARIOS[name]
    run = dict(kwargs, assistant_model=drafter, max_new_tokens=new_tokens, do_sample=False,
               cache_implementation="static")
    with oracle_drafter(drafter, succ, rows=rows, corrupt=1.0 if name in NEVER_RIGHT else 0.0):
        target.generate(**prompt(rows, succ), **run)  # what a process does once (costs, storage) is not a round's
        probe = probe_generate(target, prompt(rows, succ), count_ops=True, **run)
    kind = "plain" if name in NEVER_RIGHT else "draft"
    rounds = [r for r in probe.rounds[1:-1] if r.kind == kind]
    out = {"rounds": len(rounds)}
    for what in ("ops", "launches", "reads"):
        out[what] = statistics.median(getattr(r, what) for r in rounds) if rounds else None
    culprits = probe.culprits(kind, top=1000)
    out["culprits"] = [(w, n / max(len(rounds), 1)) for w, n in culprits if w.startswith("ops:")][:20]
    out["reads_where"] = [(w, n) for w, n in culprits if w.startswith("reads:")]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--culprits", action="store_true", help="list the operations behind the counts")
    parser.add_argument("--json", default=None, help="write the table as JSON here")
    args = parser.parse_args()
    os.environ.setdefault("EAGLE_HF_DRAFTER_GRAPHS", "on")  # fixed-shape drafting, as on the compiled path
    os.environ.setdefault("EAGLE_HF_COST_CACHE", "off")
    torch.set_num_threads(1)
    import eagle_hf  # noqa: F401 (hooks generate())

    target, drafter, succ = pair()
    table = {}
    print("| round | operations outside the target and the programs | program launches | blocking reads |")
    print("|---|---|---|---|")
    for name in SCENARIOS:
        row = table[name] = count(name, target, drafter, succ)
        print(f"| {name} | {row['ops']} | {row['launches']} | {row['reads']} |")
        if args.culprits:
            for where, n in row["culprits"]:
                print(f"|   {where} | {n:.1f} | | |")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
