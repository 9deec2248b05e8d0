"""The host-device traffic of one speculation round, counted on the CPU (`eagle_hf.tools.sync_probe`), and the host time
of a round outside the target's forward, on a tiny random Llama target.

    python scripts/sync_probe.py                 # the table of docs/benchmarks.md, "GPU-grade round"
    python scripts/sync_probe.py --time          # also host milliseconds per round (one thread; quiet machine)
    python scripts/sync_probe.py --culprits      # which functions read / copy, per scenario
    python scripts/sync_probe.py --bytes         # bytes eagle_hf writes per round, 256 vs 4,096 tokens of context

Counts are deterministic (a constant schedule); times are not: they are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter

import torch
import transformers as tf

import eagle_hf
from eagle_hf import EagleDrafter
from eagle_hf.tools.sync_probe import count_aten_ops, probe_generate

VOCAB = 256


def tiny_pair(seed: int = 0):
    torch.manual_seed(seed)
    target = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8192, bos_token_id=None, eos_token_id=None, pad_token_id=0))
    target.generation_config.pad_token_id = 0
    drafter = EagleDrafter.for_target(target).float().eval()
    return target.eval(), drafter


#: name -> (rows, generate() keywords); a constant schedule: the same rounds every run
SCENARIOS = {
    "tree, depth 5, top-k 4, 16 tokens, one row": (1, dict(draft_mode="tree", tree_depth=5, tree_top_k=4,
                                                             tree_total_tokens=16, draft_sources="eagle")),
    "same, batch of 4": (4, dict(draft_mode="tree", tree_depth=5, tree_top_k=4, tree_total_tokens=16,
                                 draft_sources="eagle")),
    "sampling tree, depth 5": (1, dict(draft_mode="tree", tree_depth=5, tree_top_k=4, tree_total_tokens=16,
                                       draft_sources="eagle", do_sample=True)),
    "chain of 5 (transformers' loop)": (1, dict(draft_mode="chain", num_assistant_tokens=5)),
    "default mode (drafter + copies)": (1, dict()),
}


def inputs_for(rows: int, length: int = 24, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    for b in range(1, rows):  # left padding of different lengths
        mask[b, : 2 * b] = 0
        ids[b, : 2 * b] = 0
    return {"input_ids": ids, "attention_mask": mask}


def probe(name: str, target, drafter, new_tokens: int = 24):
    rows, kwargs = SCENARIOS[name]
    kwargs = dict(kwargs)
    if "default" not in name:
        kwargs["num_assistant_tokens_schedule"] = "constant"
    target.generate(**inputs_for(rows), assistant_model=drafter, max_new_tokens=new_tokens, **kwargs)  # what a
    # process measures once (costs, row costs) is not a round's
    torch.manual_seed(0)
    return probe_generate(target, inputs_for(rows), assistant_model=drafter, max_new_tokens=new_tokens, **kwargs)


def plain_step_probe(target):
    """Plain generate(): a round starts at each target forward after the prefill."""
    from eagle_hf.tools.sync_probe import SyncProbe

    p = SyncProbe(target, inputs=list(inputs_for(1).values()))
    original = type(target).forward
    calls = []

    def forward(self, *args, **kwargs):
        if calls:
            p.start_round(1)
        calls.append(1)
        return original(self, *args, **kwargs)

    type(target).forward = forward
    try:
        with p.active(), torch.no_grad():
            target.generate(**inputs_for(1), max_new_tokens=8, do_sample=False)
    finally:
        type(target).forward = original
    return p


def bytes_per_round(target, drafter, contexts=(256, 4096), new_tokens: int = 16) -> dict:
    """Per scenario and context length: the median bytes eagle_hf's own ops write per drafting round outside the
    models' forwards (`SyncProbe` with ``count_bytes``), and the ops that write the most."""
    out = {}
    for name in ("tree, depth 5, top-k 4, 16 tokens, one row", "same, batch of 4", "chain of 5 (transformers' loop)"):
        rows, kwargs = SCENARIOS[name]
        kwargs = dict(kwargs, num_assistant_tokens_schedule="constant")
        for context in contexts:
            torch.manual_seed(0)
            p = probe_generate(target, inputs_for(rows, length=context), count_bytes=True, assistant_model=drafter,
                               max_new_tokens=new_tokens, **kwargs)
            rounds = [r for r in p.rounds[1:-1] if r.kind == "draft"]
            ops = Counter()
            for r in rounds:
                ops.update(r.bytes_by_op)
            out[f"{name}, context {context}"] = {
                "median_bytes": statistics.median(r.bytes for r in rounds),
                "top_ops": {op: n // len(rounds) for op, n in ops.most_common(4)}}
    return out


def host_times(target, drafter, repeats: int = 5, new_tokens: int = 48) -> dict[str, float]:
    """Per scenario: host milliseconds per round outside the target's forwards (median over repeats)."""
    out = {}
    forward_time = [0.0]
    original = type(target).forward

    def timed_forward(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            forward_time[0] += time.perf_counter() - start

    type(target).forward = timed_forward
    try:
        for name, (rows, kwargs) in SCENARIOS.items():
            kwargs = dict(kwargs, num_assistant_tokens_schedule="constant") if "default" not in name else kwargs
            samples = []
            for r in range(repeats + 1):
                forward_time[0] = 0.0
                torch.manual_seed(0)
                start = time.perf_counter()
                target.generate(**inputs_for(rows), assistant_model=drafter, max_new_tokens=new_tokens, **kwargs)
                total = time.perf_counter() - start
                stats = eagle_hf.last_stats()
                rounds = max(stats.cycles + stats.fallback_steps + stats.final_steps, 1)
                if r:
                    samples.append(1000 * (total - forward_time[0] - stats.drafter_time) / rounds)
            out[name] = statistics.median(samples)
    finally:
        type(target).forward = original
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time", action="store_true", help="also time the host's share of a round")
    parser.add_argument("--culprits", action="store_true", help="list the functions behind the counts")
    parser.add_argument("--bytes", action="store_true", help="bytes written per round at two context lengths")
    parser.add_argument("--json", default=None, help="write the table as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, drafter = tiny_pair()
    table = {}
    print("| round | device-to-host reads | device syncs | blocking host-to-device copies | asynchronous copies "
          "| host/device mixes |")
    print("|---|---|---|---|---|---|")
    for name in SCENARIOS:
        p = probe(name, target, drafter)
        s = p.summary().get("draft", {})
        table[name] = s
        print(f"| {name} | {s.get('max_reads')} | {s.get('max_syncs')} | {s.get('max_copies')} "
              f"| {s.get('max_async_copies', '-')} | {s.get('max_mixed')} |")
        if args.culprits:
            for where, n in p.culprits():
                print(f"|   {where} | {n} | | | | |")
    plain = plain_step_probe(target).summary().get("plain", {})
    table["plain generate() step"] = plain
    print(f"| plain generate() step | {plain.get('max_reads')} | {plain.get('max_syncs')} | {plain.get('max_copies')} "
          f"| {plain.get('max_async_copies', '-')} | {plain.get('max_mixed')} |")
    h = drafter.config.hidden_size
    past = drafter.step(torch.zeros(1, 32, h), torch.zeros(1, 32, dtype=torch.long), torch.arange(32)[None]).kv
    ops, _ = count_aten_ops(drafter.step, torch.zeros(1, 4, h), torch.zeros(1, 4, dtype=torch.long),
                            torch.full((1, 4), 32), past=past)
    print(f"\naten ops per drafter step (4 nodes, cache of 32): {ops}")
    table["aten_ops_per_drafter_step"] = ops
    if args.time:
        times = host_times(target, drafter)
        print("\nhost ms per round outside the target's forwards and the drafter (one thread):")
        for name, ms in times.items():
            print(f"  {name}: {ms:.2f} ms")
        table["host_ms_per_round"] = times
    if args.bytes:
        print("\nbytes eagle_hf writes per drafting round outside the models' forwards (median; top ops per round):")
        table["bytes_per_round"] = bytes_per_round(target, drafter)
        for name, row in table["bytes_per_round"].items():
            print(f"  {name}: {row['median_bytes']:,} B  {row['top_ops']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
