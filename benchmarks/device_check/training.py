"""The training stage: one training step of a drafter of the published Llama-3.1-8B EAGLE-3.1 shape (random
weights, bf16 autocast as `eagle-hf train` runs it, 7 unrolled steps), timed on random captured features: tokens a
second and the device's peak memory, per sequence length."""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch

from .common import Budget, Context, StageResult


def stage_training(ctx: Context, budget: Budget) -> StageResult:
    """A training step (forward, backward, AdamW) of the drafter alone, on random features of its target's shape:
    what `eagle-hf train` runs per batch once the features are captured."""
    import transformers as tf

    from eagle_hf import EagleDrafter
    from eagle_hf.training.ttt import ttt_loss

    res = StageResult()
    s = ctx.shapes
    config = tf.LlamaConfig(**s.target)
    embedding = torch.nn.Embedding(config.vocab_size, config.hidden_size, device=ctx.device, dtype=torch.bfloat16)
    target = SimpleNamespace(config=config, get_input_embeddings=lambda: embedding, name_or_path="llama-3.1-8b-shape")
    torch.manual_seed(0)
    with torch.device(ctx.device):
        drafter = EagleDrafter.for_target(target, draft_vocab_size=s.draft_vocab).float()
    drafter.bind_target_embedding(embedding)
    drafter.train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    hidden = config.hidden_size
    head = torch.randn(s.draft_vocab, hidden, device=ctx.device, dtype=torch.bfloat16) / hidden**0.5  # [Vd, H]
    rows = []
    for length in ((256, 1024) if ctx.small else (1024, 2048, 4096)):
        if not budget.allows(20):
            res["status"] = "partial"
            res.find(f"budget: skipped length {length}")
            continue
        g = torch.Generator(device=ctx.device).manual_seed(length)
        aux = torch.randn(1, length, 3 * hidden, device=ctx.device, dtype=torch.bfloat16, generator=g)
        final = torch.randn(1, length, hidden, device=ctx.device, dtype=torch.bfloat16, generator=g)
        ids = torch.randint(0, config.vocab_size, (1, length), device=ctx.device, generator=g)
        mask = torch.ones(1, length, device=ctx.device)
        in_vocab = torch.ones(1, length, dtype=torch.bool, device=ctx.device)

        def step(*batch):
            with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
                out = ttt_loss(drafter, *batch, steps=7)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        if ctx.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(ctx.device)
        times = []
        for i in range(5 if not ctx.small else 3):
            ctx.sync()
            start = time.perf_counter()
            step(aux, final, head, ids, mask, in_vocab)
            ctx.sync()
            if i:  # (the first: allocations and kernel selection)
                times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        row = {"length": length, "step_s": seconds, "tokens_per_s": length / seconds}
        if ctx.cuda:
            row["peak_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
        rows.append(row)
        ctx.partial(res)
    res["data"]["training step"] = rows
    res.find("one batch of one sequence, 7 unrolled steps (training-time test), bf16 autocast over float32 weights, "
             "AdamW; random features: the drafter's cost alone (capture not included)")
    res["summary"] = "; ".join(f"{r['length']} tokens: {r['tokens_per_s']:.0f} tok/s" +
                               (f", peak {r['peak_gib']:.1f} GiB" if "peak_gib" in r else "") for r in rows)
    return res
