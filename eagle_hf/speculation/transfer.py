"""Host data onto the device without stalling the host: one copy per step, from pinned memory, asynchronously.

A decoding round builds small index tensors on the host (draft tokens, positions, tree masks, the accepted paths).
Each ``torch.tensor(data, device="cuda")`` is a blocking copy; `pack` puts a step's arrays into one host buffer
and copies it once (on CUDA from pinned memory with ``non_blocking=True``: the host goes on queueing work).
"""

from __future__ import annotations

import math

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`, copied without blocking the host (pinned memory on CUDA)."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def pack(device: torch.device, **arrays) -> dict[str, torch.Tensor]:
    """Integer (or bool) host arrays (nested lists or host tensors) in one copy: name -> int64 device tensor of
    the array's shape."""
    flat, shapes = [], {}
    for name, a in arrays.items():  # lists of up to two levels: flattened here (a plain round's are one element)
        if isinstance(a, torch.Tensor) or (a and isinstance(a[0], list) and a[0] and isinstance(a[0][0], list)):
            return _pack_tensors(device, arrays)
        if a and isinstance(a[0], list):
            shapes[name] = (len(a), len(a[0]))
            for row in a:
                flat.extend(row)
        else:
            shapes[name] = (len(a),)
            flat.extend(a)
    return _views(to_device(torch.tensor(flat, dtype=torch.long), device), shapes)


def _pack_tensors(device: torch.device, arrays: dict) -> dict[str, torch.Tensor]:
    hosts = {name: a if isinstance(a, torch.Tensor) else torch.tensor(a, dtype=torch.long)
             for name, a in arrays.items()}
    flat = torch.cat([h.reshape(-1).long() for h in hosts.values()]) if hosts else torch.zeros(0, dtype=torch.long)
    return _views(to_device(flat, device), {name: tuple(h.shape) for name, h in hosts.items()})


def _views(on_device: torch.Tensor, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    out, at = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        out[name] = on_device[at : at + n].view(shape)
        at += n
    return out
