"""A verify forward's attention and cache growth, kernel by kernel: what one layer of a tree round costs on a device
against plain decoding's one-token step (the 2026-11-27 H100 profile found the masked attention of a tree round
at 8k context taking 25x plain's, and the cache's concatenation 4.5x: docs/gpu.md).

    python benchmarks/verify_attention_kernels.py [--device cuda] [--contexts 1024,8192] [--batches 1,4]
                                                  [--out FILE] [--heads 32 --kv-heads 8 --head-dim 128]

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
  case) and from a cropped view (a tree round's, after the commit crops the cache);
- split-key candidates for the masked attention (no fused backend splits the keys for a short masked query):
  ``prefix unmasked``: the stacked queries against the committed slots alone, with no mask (every tree node sees
  all of them: the part a flash-decoding kernel would take); ``prefix + tree``: the whole attention as that part
  (flash with its log-sum-exp) merged with the N x N tree part by matmul; ``flex``: compiled ``flex_attention``
  with a block mask (its decoding path splits the keys), ``flex block mask``: building that mask (once a forward).

Times are medians of CUDA-event timed repeats (CPU: wall clock), microseconds per call (one layer). Every
attention row over the same K/V also reports ``err``: its largest difference from a float32 reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM, NODES = 32, 8, 128, 16
#: how a backend, a private op missing from this torch or a compiler missing from this machine refuses a case
REFUSALS = (RuntimeError, AttributeError, TypeError, NotImplementedError, ImportError, ValueError)
_compiled_flex = None  # torch.compile(flex_attention), made on first use


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
    reference = attention_reference(query, key, value, mask)  # [B, H, N, D] float32

    def row(name, fn, checked=False):
        try:
            err = (fn().float().reshape(reference.shape) - reference).abs().max().item() if checked else None
            us = timed_us(fn, device)
        except REFUSALS as e:  # a backend or private op that refuses these inputs, or is missing from this torch
            out.append({"batch": rows, "context": context, "case": name, "us": None,
                        "note": f"{type(e).__name__}: {str(e)[:80]}"})
            return
        out.append({"batch": rows, "context": context, "case": name, "us": round(us, 1)}
                   | ({"err": float(f"{err:.3g}")} if checked else {}))

    row("plain 1 token", lambda: F.scaled_dot_product_attention(
        one, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)))
    row("plain 1 token (gqa)", lambda: F.scaled_dot_product_attention(one, key, value, enable_gqa=True))
    for name, backend in backends().items():
        row(f"stacked {name}", lambda b=backend: sdpa(b, stacked_q, key, value, attn_mask=stacked_mask), True)
        row(f"gqa {name}", lambda b=backend: sdpa(b, query, key, value, attn_mask=mask, enable_gqa=True), True)

    def matmul():
        scores = torch.matmul(stacked_q, key.transpose(-1, -2)).float() * head_dim ** -0.5  # [B, Hkv, G*N, L+N]
        probs = torch.softmax(scores + stacked_mask.float(), dim=-1).to(dtype)
        return torch.matmul(probs, value)  # [B, Hkv, G*N, D]

    row("matmul", matmul, True)
    scale = head_dim ** -0.5
    prefix_k, prefix_v = key[:, :, :context], value[:, :, :context]  # the committed slots: seen by every node
    tree_k, tree_v, tree_mask = key[:, :, context:], value[:, :, context:], stacked_mask[..., context:]
    row("prefix unmasked", lambda: F.scaled_dot_product_attention(stacked_q, prefix_k, prefix_v))
    row("prefix + tree", lambda: prefix_and_tree(stacked_q, prefix_k, prefix_v, tree_k, tree_v, tree_mask, scale),
        True)
    try:
        flex, block_mask = flex_parts(mask, rows, n, length, device)
        row("flex block mask", block_mask)
        block = block_mask()
        row("flex", lambda: flex(query, key, value, block_mask=block, enable_gqa=True, scale=scale), True)
    except REFUSALS as e:  # no flex_attention in this torch, or no compiler for it on this machine
        out.append({"batch": rows, "context": context, "case": "flex", "us": None,
                    "note": f"{type(e).__name__}: {str(e)[:80]}"})
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


def attention_reference(query, key, value, mask) -> torch.Tensor:
    """The masked attention in float32 by matmuls: query [B, H, N, D], key/value [B, Hkv, L, D], mask [B, 1, N, L]
    additive -> [B, H, N, D] float32."""
    groups = query.shape[1] // key.shape[1]
    k, v = key.float().repeat_interleave(groups, 1), value.float().repeat_interleave(groups, 1)  # [B, H, L, D]
    scores = query.float() @ k.transpose(-1, -2) * query.shape[-1] ** -0.5 + mask.float()  # [B, H, N, L]
    return torch.softmax(scores, dim=-1) @ v


def attention_with_lse(query, key, value, scale):
    """Unmasked attention and its log-sum-exp through the flash kernel's private op (the public SDPA returns no
    log-sum-exp): query [B, H, Q, D], key/value [B, H, L, D] -> ([B, H, Q, D], [B, H, Q] float32)."""
    if query.device.type == "cuda":
        result = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, False, False, scale=scale)
    else:
        result = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, False, scale=scale)
    return result[0], result[1]


def prefix_and_tree(query, prefix_k, prefix_v, tree_k, tree_v, tree_mask, scale):
    """Exact masked attention split at the committed slots: the prefix (no mask: every node sees it) by the flash
    kernel, the N tree slots by matmul under the tree mask, merged by their log-sum-exps. query [B, Hkv, G*N, D],
    prefix_k/v [B, Hkv, P, D], tree_k/v [B, Hkv, N, D], tree_mask [B, 1, G*N, N] additive -> [B, Hkv, G*N, D]."""
    out_p, lse_p = attention_with_lse(query, prefix_k, prefix_v, scale)  # [B, Hkv, G*N, D], [B, Hkv, G*N]
    scores = (query @ tree_k.transpose(-1, -2)).float() * scale + tree_mask.float()  # [B, Hkv, G*N, N]
    lse_t = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G*N]
    out_t = torch.softmax(scores, dim=-1).to(query.dtype) @ tree_v  # [B, Hkv, G*N, D]
    w_p = torch.sigmoid(lse_p - lse_t).unsqueeze(-1)  # e^lse_p / (e^lse_p + e^lse_t): [B, Hkv, G*N, 1]
    return (w_p * out_p.float() + (1 - w_p) * out_t.float()).to(query.dtype)


def flex_parts(mask, rows, n, length, device):
    """Compiled `flex_attention` and a builder of its block mask for the tree mask `mask` [B, 1, N, L] additive."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    allowed = mask[:, 0] == 0  # [B, N, L]

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed[b, q_idx, kv_idx]

    global _compiled_flex
    if _compiled_flex is None:  # one compiled function for every cell: dynamo compiles again at most once, with
        _compiled_flex = torch.compile(flex_attention)  # dynamic shapes (compiling per cell costs a GPU call minutes)
    return _compiled_flex, lambda: create_block_mask(mask_mod, rows, None, n, length, device=device)


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
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "nodes": NODES}
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        for c in (int(x) for x in args.contexts.split(",")):
            for r in cell(device, b, c, args.heads, args.kv_heads, args.head_dim):
                rows.append(r)
                print(f"{r['batch']:>3} {r['context']:>6} {r['case']:<24} {r['us'] if r['us'] is not None else r['note']}"
                      + (f"  err {r['err']}" if "err" in r else ""), flush=True)
            if args.out:  # after every cell: a run cut short by its time limit keeps what it measured
                with open(args.out, "w") as f:
                    json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
