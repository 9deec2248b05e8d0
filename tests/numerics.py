"""The numerics rule of greedy-equality checks on a device (used by the tests and by the equality stage of
scripts/device_check.py, benchmarks/device_check/equality.py).

Speculative decoding verifies several tokens in one forward; plain decoding computes one token per forward. The
two run different kernels, so on a GPU even float32 can round a near-tie differently. The rule: compare with
TF32 off (`exact_matmuls`); where outputs differ, look at plain generate()'s own logits at the first differing
token. A top-2 margin below `NUMERICS_MARGIN` (float32) is numerics, anything larger is a bug. In bf16 only the
count of differing outputs and their margins are reported (no verdict).

Nothing here imports pytest: the device check imports this file from the repository's ``tests/`` folder.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch

#: float32: a first difference at a top-2 logit margin below this is rounding, not a bug
NUMERICS_MARGIN = 1e-3


@contextlib.contextmanager
def exact_matmuls():
    """TF32 off for CUDA matmuls and cuDNN inside the block (restored after); a no-op on a CPU."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@dataclass
class Mismatch:
    """Where one row of a speculative output first leaves plain generate()'s output."""

    row: int
    step: int  # index among the generated tokens (0 = the prefill's token)
    expected: int | None  # plain generate()'s token (None: plain output ended first)
    got: int | None
    margin: float | None  # top-2 logit margin of plain generate()'s logits at `step` (None: not recorded)
    verdict: str  # "numerics" (float32 margin below NUMERICS_MARGIN), "bug", or "unjudged" (bf16, no logits)

    def to_dict(self) -> dict:
        return asdict(self)


def top2_margin(step_logits: torch.Tensor) -> float:
    """Top-1 minus top-2 logit of one row's ``[V]`` logits (float32)."""
    top = torch.topk(step_logits.float(), 2).values
    return float(top[0] - top[1])


def first_difference(expected: torch.Tensor, got: torch.Tensor) -> int | None:
    """The first index where two 1-D token sequences differ (a length difference counts), or None."""
    n = min(expected.shape[-1], got.shape[-1])
    diff = (expected[:n].cpu() != got[:n].cpu()).nonzero()
    if len(diff):
        return int(diff[0, 0])
    return None if expected.shape[-1] == got.shape[-1] else n


def compare_greedy(expected: torch.Tensor, got: torch.Tensor, prompt_width: int, logits=None,
                   judge: bool = True, margin: float = NUMERICS_MARGIN) -> list[Mismatch]:
    """Rows of `got` that differ from `expected` (both ``[B, T]`` generate() outputs of the same left-padded
    prompts, `prompt_width` columns of prompt). `logits`: plain generate()'s per-step logits (``output_logits=True``
    or ``output_scores=True`` with ``return_dict_in_generate=True``: a tuple of ``[B, V]``), used for the margin at
    the first difference. `judge`: give a verdict by the float32 rule (False in bf16)."""
    out = []
    for row in range(expected.shape[0]):
        e, g = expected[row, prompt_width:], got[row, prompt_width:]
        step = first_difference(e, g)
        if step is None:
            continue
        m = top2_margin(logits[step][row]) if logits is not None and step < len(logits) else None
        verdict = "unjudged" if not judge or m is None else ("numerics" if m < margin else "bug")
        out.append(Mismatch(row, step, int(e[step]) if step < e.shape[-1] else None,
                            int(g[step]) if step < g.shape[-1] else None, m, verdict))
    return out
