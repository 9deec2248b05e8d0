"""Costs measured on the target's device, and the adaptive schedule's controller for one call."""

from __future__ import annotations

import functools
import logging
import statistics

import torch

from ..adaptive import CostModel, DraftLengthController
from ..settings import DraftSettings
from ..timing import Clock
from .cache import new_cache
from .version import cache_kwarg

logger = logging.getLogger(__name__)

_COST_CACHE: dict[tuple, CostModel] = {}
#: the largest verify forward measured (copy branches included); beyond it the cost is extrapolated
MAX_MEASURED_TOKENS = 64


@torch.no_grad()
def measure_costs(target, drafter=None, max_tokens: int = 9, context: int = 128, repeats: int = 5) -> CostModel:
    """Time target forwards over 1..max_tokens new tokens (on a `context`-token cache) and one drafter step
    (none without a drafter).

    Cached per (target, drafter width, device, dtype), once per process: on this project's 2-core CPU about a
    second for the 9 sizes of chain drafting, about 20 s for the 64 of copy branches (SmolLM2-135M, bf16).
    """
    key = (id(target), drafter.config.hidden_size if drafter is not None else 0, str(target.device), str(target.dtype))
    if key in _COST_CACHE and len(_COST_CACHE[key].verify) >= max_tokens:
        return _COST_CACHE[key]
    device = target.device
    vocab = target.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, context + max_tokens), device=device)

    clock = Clock(device)

    def timed(fns: list) -> list[float]:
        """Median time of each fn over `repeats` interleaved rounds (after one untimed round)."""
        samples = [[] for _ in fns]
        for r in range(repeats + 1):
            for i, fn in enumerate(fns):
                t0 = clock()
                fn()
                if r:
                    samples[i].append(clock() - t0)
        return [statistics.median(s) for s in samples]

    cache = new_cache(target)
    target(ids[:, :context], **cache_kwarg(cache), use_cache=True)

    def forward(n: int):
        target(ids[:, context : context + n], **cache_kwarg(cache), use_cache=True)
        cache.crop(-n)

    times = timed([functools.partial(forward, n) for n in range(1, max_tokens + 1)])
    base = times[0]
    verify = [max(t / base, 1.0) for t in times]
    for i in range(1, len(verify)):  # monotone, for a well-behaved argmax
        verify[i] = max(verify[i], verify[i - 1])
    if drafter is None:  # copy drafting alone: only the verify costs matter
        model = CostModel(verify=verify, draft_step=0.0, base_seconds=base)
        _COST_CACHE[key] = model
        return model
    h = drafter.config.hidden_size
    hidden = torch.zeros(1, 1, h, device=device, dtype=drafter.fc.weight.dtype)
    tok = torch.zeros(1, 1, dtype=torch.long, device=device)
    past_out = drafter.step(hidden.expand(1, context, h), tok.expand(1, context), torch.arange(context, device=device)[None])
    (draft,) = timed([lambda: drafter.step(hidden, tok, torch.tensor([[context]], device=device), past=past_out.kv)])
    model = CostModel(verify=verify, draft_step=draft / base, base_seconds=base)
    logger.info("Measured costs on %s: verify %s, drafter step %.3f (relative to one target token)",
                device, [round(v, 2) for v in verify], model.draft_step)
    _COST_CACHE[key] = model
    return model


_ROW_COSTS: dict[tuple, dict[int, float]] = {}


@torch.no_grad()
def row_costs(target, sizes, context: int = 64, repeats: int = 5) -> dict[int, float]:
    """Seconds of a one-token target forward for a batch of each of `sizes` rows (median of `repeats`, after one
    untimed step), measured once per process and size.

    A batch does not always get cheaper as its rows finish: on this project's CPU a float32 forward of 7 rows
    costs about a fifth more than one of 8 (matrix kernels favour some row counts). The tree loop keeps finished
    rows as passengers where that is cheaper than letting them leave (`TreeLoop.retire`)."""
    key = (id(target), str(target.device), str(target.dtype))
    known = _ROW_COSTS.setdefault(key, {})
    vocab = target.config.get_text_config().vocab_size
    clock = Clock(target.device)
    for rows in sorted(set(sizes) - set(known)):
        ids = torch.randint(0, vocab, (rows, context + repeats + 1), device=target.device)
        cache = new_cache(target)
        target(ids[:, :context], **cache_kwarg(cache), use_cache=True, logits_to_keep=1)
        times = []
        for i in range(repeats + 1):
            start = clock()
            target(ids[:, context + i : context + i + 1], **cache_kwarg(cache), use_cache=True, logits_to_keep=1)
            times.append(clock() - start)
        known[rows] = statistics.median(times[1:])
    return {rows: known[rows] for rows in sizes}


def controller_for(target, drafter, settings: DraftSettings) -> DraftLengthController | None:
    """The per-call controller of the "adaptive" schedule (None for fixed schedules), chain or tree."""
    if not settings.adaptive:
        return None
    tree = settings.mode == "tree"
    verified = max(9, settings.total_tokens if tree else settings.depth + 1)
    if settings.uses_copy:  # copy branches come on top: measure their verify cost, never extrapolate it
        verified = min(verified + settings.copy_branch_count * settings.copy_length, MAX_MEASURED_TOKENS)
    cost = measure_costs(target, drafter, max_tokens=verified)
    return DraftLengthController(
        cost,
        max_draft=settings.depth,
        probe_every=settings.probe_every,
        min_gain=settings.min_gain,
        keep_gain=settings.keep_gain,
        tree=(settings.top_k, settings.total_tokens) if tree else None,
    )
