"""Costs measured on the target's device, and the adaptive schedule's controller for one call."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import weakref
from pathlib import Path

import torch

from ..adaptive import CostModel, DraftLengthController
from ..settings import DraftSettings
from ..timing import Clock
from .cache import new_cache
from .version import cache_kwarg

logger = logging.getLogger(__name__)

#: the largest verify forward measured (copy branches included); beyond it the cost is extrapolated
MAX_MEASURED_TOKENS = 64
#: verify sizes timed before the first token (the others interpolated): a forward's cost is piecewise smooth in
#: its tokens, and each size timed is a pause before the first token (48 sizes took 31 s here before)
MEASURED_SIZES = (1, 4, 16, 64)
#: environment variable: "off" keeps measured costs in memory only (default: also in eagle_hf's cache folder,
#: for models loaded from a name or folder, keyed by model, device, dtype and library versions)
COST_CACHE_ENV = "EAGLE_HF_COST_CACHE"

#: bump when the way costs are measured changes: costs kept on disk by an older version are then not read
_COST_FORMAT = 1
#: per model object (weakly: a model that is gone takes its costs with it) -> key -> costs
_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _timed(clock: Clock, fns: list, repeats: int, warmup: bool = True) -> list[float]:
    """The fastest time of each fn over `repeats` interleaved rounds (after one untimed round with `warmup`): the
    fastest is the steadiest estimate on a shared machine (interference only ever adds time)."""
    samples = [[] for _ in fns]
    for r in range(repeats + warmup):
        for i, fn in enumerate(fns):
            t0 = clock()
            fn()
            if r or not warmup:
                samples[i].append(clock() - t0)
    return [min(s) for s in samples]


def _interpolate(sizes: list[int], times: list[float], max_tokens: int) -> list[float]:
    """Relative costs of 1..max_tokens tokens from the measured sizes, piecewise linear and monotone."""
    base, out = times[0], []
    for n in range(1, max_tokens + 1):
        hi = next(i for i, s in enumerate(sizes) if s >= n)
        lo = max(hi - 1, 0)
        if sizes[hi] == n or hi == lo:
            t = times[hi]
        else:
            t = times[lo] + (times[hi] - times[lo]) * (n - sizes[lo]) / (sizes[hi] - sizes[lo])
        out.append(max(t / base, out[-1] if out else 1.0))
    return out


@torch.no_grad()
def measure_costs(target, drafter=None, max_tokens: int = 9, context: int = 32, repeats: int = 2) -> CostModel:
    """Time target forwards over a few sizes up to `max_tokens` new tokens (on a `context`-token cache;
    `MEASURED_SIZES`, the others interpolated; the fastest of `repeats`) and one drafter step (none without a
    drafter). About 1-3 s before the first token of a process on this project's CPU (31 s for 48 sizes before);
    the loop corrects the verify costs with the forwards it times (`DraftLengthController.observe_verify`).

    Kept per model object (weakly) and drafter width, and on disk in eagle_hf's cache folder for named models
    (`COST_CACHE_ENV`; keyed by the model's name and config, the device, dtype, torch and transformers versions):
    a later process starts without measuring."""
    key = _cost_key(target, drafter, context)
    known = _COSTS.setdefault(target, {})
    if key in known and len(known[key].verify) >= max_tokens:
        return known[key]
    model = _read_persisted(target, key)
    if model is None or len(model.verify) < max_tokens:
        model = _measure(target, drafter, max_tokens, context, repeats)
        _persist(target, key, model)
    known[key] = model
    return model


def _measure(target, drafter, max_tokens: int, context: int, repeats: int) -> CostModel:
    device = target.device
    vocab = target.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, context + max_tokens), device=device)
    clock = Clock(device)
    cache = new_cache(target)
    target(ids[:, :context], **cache_kwarg(cache), use_cache=True)

    def forward(n: int):
        target(ids[:, context : context + n], **cache_kwarg(cache), use_cache=True)
        cache.crop(-n)

    sizes = sorted({n for n in MEASURED_SIZES if n < max_tokens} | {1, max_tokens})
    times = _timed(clock, [lambda n=n: forward(n) for n in sizes], repeats, warmup=False)  # (the prefill warmed up)
    verify = _interpolate(sizes, times, max_tokens)
    if drafter is None:  # copy drafting alone: only the verify costs matter
        return CostModel(verify=verify, draft_step=0.0, base_seconds=times[0])
    h = drafter.config.hidden_size
    hidden = torch.zeros(1, 1, h, device=device, dtype=drafter.fc.weight.dtype)
    tok = torch.zeros(1, 1, dtype=torch.long, device=device)
    past = drafter.step(hidden.expand(1, context, h), tok.expand(1, context),
                        torch.arange(context, device=device)[None]).kv
    position = torch.tensor([[context]], device=device)
    (draft,) = _timed(clock, [lambda: drafter.step(hidden, tok, position, past=past)], repeats)
    model = CostModel(verify=verify, draft_step=draft / times[0], base_seconds=times[0])
    logger.info("Measured costs on %s (%d sizes): verify %s, drafter step %.3f (relative to one target token)",
                device, len(sizes), [round(v, 2) for v in verify], model.draft_step)
    return model


def _cost_key(target, drafter, context: int) -> str:
    return json.dumps(["costs", context, drafter.config.hidden_size if drafter is not None else 0,
                       str(drafter.fc.weight.dtype) if drafter is not None else ""])


def _cost_file(target) -> Path | None:
    """Where a named model's measured costs live on this machine (None: not persisted)."""
    name = getattr(target, "name_or_path", "") or getattr(target.config, "_name_or_path", "")
    if not name or os.environ.get(COST_CACHE_ENV, "").lower() in ("off", "0", "false", "none"):
        return None
    import transformers

    from ..default import cache_root

    root = cache_root()
    if root is None:
        return None
    device = target.device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{device.type}:{torch.get_num_threads()}"
    ident = json.dumps([name, target.config.to_json_string(use_diff=False), where, str(target.dtype),
                        torch.__version__, transformers.__version__, _COST_FORMAT])
    return root / "costs" / f"{hashlib.sha256(ident.encode()).hexdigest()[:20]}.json"


def _read_persisted(target, key: str) -> CostModel | None:
    path = _cost_file(target)
    try:
        entry = json.loads(path.read_text()).get(key) if path is not None and path.is_file() else None
    except (OSError, ValueError):
        return None
    if entry is None:
        return None
    logger.info("Costs of %s read from %s", target.name_or_path, path)
    return CostModel(**entry)


def _persist(target, key: str, model: CostModel) -> None:
    path = _cost_file(target)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = json.loads(path.read_text()) if path.is_file() else {}
        entries[key] = {"verify": model.verify, "draft_step": model.draft_step, "base_seconds": model.base_seconds}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entries))
        tmp.replace(path)
    except (OSError, ValueError) as e:  # a read-only cache folder: costs stay in memory
        logger.info("Could not keep the measured costs in %s: %s", path, e)


_ROW_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.no_grad()
def row_costs(target, sizes, context: int = 64, repeats: int = 3) -> dict[int, float]:
    """Seconds of a one-token target forward for a batch of each of `sizes` rows (the fastest of `repeats`, after
    one untimed step), measured once per model object (weakly) and size.

    A batch does not always get cheaper as its rows finish: on this project's CPU a float32 forward of 7 rows
    costs about a fifth more than one of 8 (matrix kernels favour some row counts). The tree loop keeps finished
    rows as passengers where that is cheaper than letting them leave (`TreeLoop.retire`)."""
    known = _ROW_COSTS.setdefault(target, {}).setdefault((str(target.device), str(target.dtype)), {})
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
        known[rows] = min(times[1:])
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
