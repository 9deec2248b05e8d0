"""A verify forward's attention and cache growth, kernel by kernel: what one layer of a tree round costs on a device
against plain decoding's one-token step (the 2026-11-27 H100 profile found the masked attention of a tree round
at 8k context taking 25x plain's, and the cache's concatenation 4.5x: docs/gpu.md).

    python scripts/verify_attention_bench.py [--device cuda] [--contexts 1024,8192] [--batches 1,4] [--out FILE]
                                             [--heads 32 --kv-heads 8 --head-dim 128]

Llama-3.1-8B's attention shape by default (32 query heads, 8 K/V heads, head dim 128; SmolLM2-135M's: 9, 3, 64),
bf16, N = 16 tree nodes. Rows:

- ``plain 1 token``: plain decoding's attention (one query per head, no mask, K/V repeated per query head as
  transformers' sdpa path does);
- ``stacked <backend>``: eagle_hf's tree attention (the G query heads of a K/V head stacked into G*N queries, the
  additive tree mask tiled G times), SDPA restricted to one backend (``auto``: torch's choice);
- ``gqa <backend>``: the same with ``enable_gqa=True`` (query heads apart, K/V not repeated);
- ``matmul``: the same arithmetic as two batched matmuls and a float32 softmax (no fused kernel);
- ``..., views``: K/V as views of a larger buffer (a cache with room to grow), and ``write in place``: N slots
  written into such a buffer (what would replace the concatenation);
- ``cat contiguous`` / ``cat view``: a layer's cache growing by N slots from a contiguous tensor (plain decoding's
  case) and from a cropped view (a tree round's, after the commit crops the cache).

Times are medians of CUDA-event timed repeats (CPU: wall clock), microseconds per call (one layer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM, NODES = 32, 8, 128, 16


def timed_us(fn, device: torch.device, repeats: int = 50, warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
    else:
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def backends():
    from torch.nn.attention import SDPBackend

    names = {"auto": None, "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
    return {k: (getattr(SDPBackend, v) if v else None) for k, v in names.items() if v is None or hasattr(SDPBackend, v)}


def sdpa(backend, *args, **kwargs):
    from torch.nn.attention import sdpa_kernel

    if backend is None:
        return F.scaled_dot_product_attention(*args, **kwargs)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(*args, **kwargs)


def cell(device: torch.device, rows: int, context: int, heads: int = HEADS, kv_heads: int = KV_HEADS,
         head_dim: int = HEAD_DIM, dtype=torch.bfloat16) -> list[dict]:
    """Every case at one batch size and context length: one row each (us: microseconds a call, or a note)."""
    g = torch.Generator(device=device).manual_seed(0)
    groups, n, length = heads // kv_heads, NODES, context + NODES

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    key, value = rand(rows, kv_heads, length, head_dim), rand(rows, kv_heads, length, head_dim)
    query = rand(rows, heads, n, head_dim)  # [B, H, N, D]
    tree = torch.tril(torch.ones(n, n, dtype=torch.bool, device=device))  # a chain: each node sees its ancestors
    mask = torch.zeros(rows, 1, n, length, dtype=dtype, device=device)
    mask[:, 0, :, context:].masked_fill_(~tree, torch.finfo(dtype).min)  # [B, 1, N, L+N]
    stacked_q = query.reshape(rows, kv_heads, groups * n, head_dim)  # [B, Hkv, G*N, D]
    stacked_mask = mask.repeat(1, 1, groups, 1)  # [B, 1, G*N, L+N]
    one = rand(rows, heads, 1, head_dim)
    out = []

    def row(name, fn):
        try:
            us = timed_us(fn, device)
        except RuntimeError as e:  # a backend that refuses these inputs
            out.append({"batch": rows, "context": context, "case": name, "us": None,
                        "note": f"{type(e).__name__}: {str(e)[:80]}"})
            return
        out.append({"batch": rows, "context": context, "case": name, "us": round(us, 1)})

    row("plain 1 token", lambda: F.scaled_dot_product_attention(
        one, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)))
    row("plain 1 token (gqa)", lambda: F.scaled_dot_product_attention(one, key, value, enable_gqa=True))
    for name, backend in backends().items():
        row(f"stacked {name}", lambda b=backend: sdpa(b, stacked_q, key, value, attn_mask=stacked_mask))
        row(f"gqa {name}", lambda b=backend: sdpa(b, query, key, value, attn_mask=mask, enable_gqa=True))

    def matmul():
        scores = torch.matmul(stacked_q, key.transpose(-1, -2)).float() * head_dim ** -0.5  # [B, Hkv, G*N, L+N]
        probs = torch.softmax(scores + stacked_mask.float(), dim=-1).to(dtype)
        return torch.matmul(probs, value)  # [B, Hkv, G*N, D]

    row("matmul", matmul)
    # K/V as views of buffers with room to grow (a cache that writes in place instead of concatenating): the
    # sequence dimension's stride is the buffer's, not the view's; do the kernels read them at the same speed?
    room = -(-(length + length // 8) // 256) * 256
    key_buf, value_buf = rand(rows, kv_heads, room, head_dim), rand(rows, kv_heads, room, head_dim)
    key_view, value_view = key_buf[:, :, :length], value_buf[:, :, :length]
    row("plain 1 token (gqa), views", lambda: F.scaled_dot_product_attention(one, key_view, value_view, enable_gqa=True))
    row("stacked auto, views", lambda: F.scaled_dot_product_attention(stacked_q, key_view, value_view,
                                                                      attn_mask=stacked_mask))
    row("write in place", lambda: key_buf[:, :, length - n:length].copy_(key[:, :, :n]))
    full = rand(rows, kv_heads, length + n, head_dim)
    view, contiguous, new = full[:, :, :length], full[:, :, :length].contiguous(), rand(rows, kv_heads, n, head_dim)
    row("cat contiguous", lambda: torch.cat([contiguous, new], dim=-2))
    row("cat view", lambda: torch.cat([view, new], dim=-2))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--contexts", default="1024,8192")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--out", default="")
    p.add_argument("--heads", type=int, default=HEADS)
    p.add_argument("--kv-heads", type=int, default=KV_HEADS)
    p.add_argument("--head-dim", type=int, default=HEAD_DIM)
    args = p.parse_args()
    device = torch.device(args.device)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        for c in (int(x) for x in args.contexts.split(",")):
            for r in cell(device, b, c, args.heads, args.kv_heads, args.head_dim):
                rows.append(r)
                print(f"{r['batch']:>3} {r['context']:>6} {r['case']:<24} {r['us'] if r['us'] is not None else r['note']}",
                      flush=True)
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "nodes": NODES}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
