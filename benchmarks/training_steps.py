#!/usr/bin/env python
"""Profile drafter training steps on captured data: tokens/s and where the time goes.

Loads the default target (its embedding and lm_head), a drafter (the shipped one by default, as a warm start
would), a few shards of captured data, and runs the same optimizer steps as `eagle-hf train` for each variant,
interleaved batch by batch (so that a change in machine load hits every variant alike). Per variant: the time in
`fc` (fusing the taps), in the decoder layer per TTT step, in the drafter's lm_head, the rest of the forward
(target distribution, loss, masks), backward, and the optimizer (clipping + AdamW).

    .venv/bin/python benchmarks/training_steps.py --data runs/data/shared --shards 3 --batches 8 \
        --variants reference,fast --threads 2
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="runs/data/shared", help="a folder of captured shards")
    p.add_argument("--shards", type=int, default=3, help="shards to load (the first ones)")
    p.add_argument("--init", default="default", help="drafter to start from ('default' = the shipped one)")
    p.add_argument("--tokens-per-batch", type=int, default=1024)
    p.add_argument("--ttt-steps", type=int, default=5)
    p.add_argument("--batches", type=int, default=6, help="timed batches per variant (after one warm-up batch)")
    p.add_argument("--variants", default="reference,fast",
                   help="comma list of: reference (per-step target softmax, autograd log-softmax), fast (target "
                        "distribution once per batch, fused soft cross-entropy), fast-fp32 (no bf16 autocast), "
                        "fast-compile (torch.compile of the decoder layer, dynamic shapes)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the summary here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()

    from safetensors.torch import load_file

    from eagle_hf.drafter.default import load_target
    from eagle_hf.training.data import unpack_shard
    from eagle_hf.training.pipeline import load_init_drafter
    from eagle_hf.training.trainer import TrainConfig, collate, make_batches
    from eagle_hf.training.ttt import ttt_loss

    target, _ = load_target("default", dtype=torch.bfloat16)
    target.requires_grad_(False)
    base = load_init_drafter(args.init)
    paths = sorted(Path(args.data).glob("shard_*.safetensors"))[: args.shards]
    samples = [s for path in paths for s in unpack_shard(load_file(str(path)))]
    lengths = [min(s["input_ids"].shape[0], 1024) for s in samples]
    batches = make_batches(lengths, args.tokens_per_batch, 0)[: args.batches + 1]
    t2d = base.t2d.bool()
    head = target.get_output_embeddings().weight[torch.arange(base.config.draft_vocab_size) + base.d2t].float()
    cfg = TrainConfig(ttt_steps=args.ttt_steps)

    variants = args.variants.split(",")
    models, opts, timers = {}, {}, {}
    for v in variants:
        d = copy.deepcopy(base).float().train()
        d.bind_target_embedding(target.get_input_embeddings())
        if v == "fast-compile":
            d.midlayer.compile(dynamic=True)
        models[v] = d
        opts[v] = torch.optim.AdamW(d.parameters(), lr=1e-5, betas=cfg.betas)
        timers[v] = _hook_timers(d)

    results = {v: defaultdict(list) for v in variants}
    for b, batch in enumerate(batches):
        ids, aux, final, mask, in_vocab = collate(samples, batch, 1024, head, t2d, torch.device("cpu"))
        for v in variants:
            d, opt, tm = models[v], opts[v], timers[v]
            tm.reset()
            c0 = time.process_time()
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=v != "fast-fp32"):
                out = ttt_loss(d, aux, final, head, ids, mask, in_vocab, args.ttt_steps, cfg.step_decay,
                               fast=v != "reference")
            t1 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            t2 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(d.parameters(), cfg.max_grad_norm)
            opt.step()
            t3 = time.perf_counter()
            c3 = time.process_time()
            if b == 0:
                results[v]["warmup_step_s"].append(t3 - t0)
                continue  # warm-up (allocator, oneDNN kernels, compilation)
            r = results[v]
            r["step_s"].append(t3 - t0)
            r["step_cpu_s"].append(c3 - c0)  # CPU time of all threads: less sensitive to other processes
            r["forward_s"].append(t1 - t0)
            r["fc_s"].append(tm.totals["fc"])
            for k, s in enumerate(tm.per_call["midlayer"]):
                r[f"layer_step{k}_s"].append(s)
            r["lm_head_s"].append(tm.totals["lm_head"])
            r["rest_of_forward_s"].append(t1 - t0 - tm.totals["fc"] - tm.totals["midlayer"] - tm.totals["lm_head"])
            r["backward_s"].append(t2 - t1)
            r["optimizer_s"].append(t3 - t2)
            r["padded_tokens"].append(int(ids.numel()))
            r["answer_tokens"].append(int(mask.sum()))
            r["loss"].append(float(out.loss))
    summary = {"load_average": load_start, "threads": torch.get_num_threads(), "batches": args.batches,
               "tokens_per_batch": args.tokens_per_batch, "ttt_steps": args.ttt_steps, "variants": {}}
    for v in variants:
        r = results[v]
        total = sum(r["step_s"])
        row = {k: statistics.mean(x) for k, x in r.items() if k.endswith("_s")}
        row["warmup_step_s"] = r["warmup_step_s"][0]
        row["padded_tokens_per_s"] = sum(r["padded_tokens"]) / total
        row["padded_tokens_per_cpu_s"] = sum(r["padded_tokens"]) / sum(r["step_cpu_s"])
        row["answer_tokens_per_s"] = sum(r["answer_tokens"]) / total
        row["mean_loss"] = statistics.mean(r["loss"])
        summary["variants"][v] = row
    summary["load_average_end"] = os.getloadavg()
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


class _hook_timers:
    """Wall time spent in the forward of fc, the decoder layer (per call = per TTT step) and lm_head."""

    def __init__(self, drafter):
        self.totals = defaultdict(float)
        self.per_call = defaultdict(list)
        for name in ("fc", "midlayer", "lm_head"):
            mod = getattr(drafter, name)
            mod.register_forward_pre_hook(self._start(name))
            mod.register_forward_hook(self._stop(name))
        self._t0 = {}

    def reset(self):
        self.totals.clear()
        self.per_call.clear()

    def _start(self, name):
        def hook(module, args):
            self._t0[name] = time.perf_counter()
        return hook

    def _stop(self, name):
        def hook(module, args, output):
            dt = time.perf_counter() - self._t0[name]
            self.totals[name] += dt
            self.per_call[name].append(dt)
        return hook


if __name__ == "__main__":
    raise SystemExit(main())
