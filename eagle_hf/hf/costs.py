"""The cost model of a target on its device (learnt, kept per model object and on disk), the drafter's
acceptance (kept per drafter object, from one call to the next), and the adaptive schedule's controller for one
call."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import weakref
from pathlib import Path

import torch

from ..devices import input_device
from ..speculation.costs import CostEntryError, CostModel
from ..speculation.drafting import wanted as fixed_levels
from ..speculation.schedule import DraftLengthController
from ..speculation.settings import DraftSettings

logger = logging.getLogger(__name__)

#: environment variable: "off" keeps learnt costs in memory only (default: also in eagle_hf's cache folder, for
#: models loaded from a name or folder, keyed by model, device, dtype and library versions)
COST_CACHE_ENV = "EAGLE_HF_COST_CACHE"

#: bump when what is kept changes: costs kept on disk by an older version are then not read
_COST_FORMAT = 2
#: a cost file larger than this is not read
MAX_COST_FILE = 1 << 20
#: cost files whose problem was already reported in this process (`_read_store`)
_WARNED: set[Path] = set()
#: per model object (weakly: a model that is gone takes its costs with it) -> key -> cost model
_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: per drafter object (weakly) -> kind of call (`_acceptance_key`) -> the acceptance its last call ended with
_ACCEPTANCE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cost_model(target, drafter=None, compiled: bool = False) -> CostModel:
    """The cost model of `target` (with `drafter`'s steps) on its device: nothing is measured here. It starts
    from what an earlier process learnt on this machine (`COST_CACHE_ENV`), else from its device kind's prior,
    and learns from the forwards the decoding loops time; kept per model object (weakly) for later calls, and
    on disk by `keep_costs` after each call. `compiled`: the costs of transformers' compiled forward (a static
    cache), kept apart from the uncompiled forward's."""
    key = _cost_key(target, drafter, compiled)
    known = _COSTS.setdefault(target, {})
    if key not in known:
        known[key] = _read_persisted(target, key) or CostModel.prior(input_device(target).type)
    return known[key]


def keep_costs(target) -> None:
    """Write what `target`'s cost models learnt to eagle_hf's cache folder (named models; see `cost_model`): the
    file's valid entries (`_read_store`) with this process's, through a temporary file of this writer's own that
    replaces the file at once, so that concurrent writers never leave a partial file (the last one's stays)."""
    models = _COSTS.get(target)
    path = _cost_file(target) if models else None
    if path is None:
        return
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = _read_store(path)
        entries.update({key: model.as_dict() for key, model in models.items() if model.observed})
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{path.stem}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(entries, allow_nan=False))
        os.replace(tmp, path)
        tmp = None
    except (OSError, ValueError) as e:  # a read-only cache folder: costs stay in memory
        logger.info("Could not keep the learnt costs in %s: %s", path, e)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _cost_key(target, drafter, compiled: bool = False) -> str:
    """Apart: each drafter width and dtype, the compiled forward, and draft levels at fixed shapes (a CUDA
    graph's level costs a third of an eager one: `eagle_hf.speculation.drafting`)."""
    fixed = drafter is not None and fixed_levels(drafter, compiled)
    return json.dumps(["costs", drafter.config.hidden_size if drafter is not None else 0,
                       str(drafter.fc.weight.dtype) if drafter is not None else ""] + (["compiled"] if compiled else [])
                      + (["fixed levels"] if fixed else []))


def _cost_file(target) -> Path | None:
    """Where a named model's learnt costs live on this machine (None: not persisted)."""
    name = getattr(target, "name_or_path", "") or getattr(target.config, "_name_or_path", "")
    if not name or os.environ.get(COST_CACHE_ENV, "").lower() in ("off", "0", "false", "none"):
        return None
    import transformers

    from ..drafter.default import cache_root

    root = cache_root()
    if root is None:
        return None
    device = input_device(target)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{device.type}:{torch.get_num_threads()}"
    ident = json.dumps([name, target.config.to_json_string(use_diff=False), where, str(target.dtype),
                        torch.__version__, transformers.__version__, _COST_FORMAT])
    return root / "costs" / f"{hashlib.sha256(ident.encode()).hexdigest()[:20]}.json"


def _read_persisted(target, key: str) -> CostModel | None:
    path = _cost_file(target)
    entry = _read_store(path).get(key) if path is not None else None
    if entry is None:
        return None
    logger.info("Costs of %s read from %s", target.name_or_path, path)
    return CostModel.from_dict(entry, prior=CostModel.prior(input_device(target).type))


def _read_store(path: Path) -> dict[str, dict]:
    """The entries of a cost file that pass `CostModel.from_dict`'s checks, by key. The file is untrusted input:
    one that is not a JSON object of such entries is ignored, with one warning per file in a process, and
    replaced at the next write (`keep_costs`); a missing or unreadable one is an empty store."""
    try:
        if path.stat().st_size > MAX_COST_FILE:
            raise CostEntryError(f"{path.stat().st_size} bytes, more than {MAX_COST_FILE} (a few kB is usual)")
        entries = json.loads(path.read_text())
        if not isinstance(entries, dict):
            raise CostEntryError(f"a JSON {type(entries).__name__}, not an object")
        bad = {}
        for key, entry in entries.items():
            try:
                CostModel.from_dict(entry)
            except ValueError as e:
                bad[key] = str(e)
    except OSError:
        return {}
    except (ValueError, RecursionError) as e:  # (RecursionError: JSON nested deeper than Python's stack)
        _warn_once(path, str(e) or type(e).__name__)
        return {}
    if bad:
        _warn_once(path, "; ".join(f"entry {key}: {why}" for key, why in bad.items()))
    return {key: entry for key, entry in entries.items() if key not in bad}


def _warn_once(path: Path, why: str) -> None:
    if path not in _WARNED:
        _WARNED.add(path)
        logger.warning("Ignoring the learnt costs in %s (%s): learnt again, and the file replaced after this "
                       "call.", path, why)


def controller_for(target, drafter, settings: DraftSettings, compiled: bool = False,
                   sampling: bool = False) -> DraftLengthController | None:
    """The per-call controller of the "adaptive" schedule (None for fixed schedules), chain or tree, on the costs
    of the forward that verifies (`compiled`: transformers' compiled one), starting from the acceptance the
    drafter's last call of the same kind ended with (`keep_acceptance`; `sampling`: whether the call samples)."""
    if not settings.adaptive:
        return None
    tree = settings.mode == "tree"
    known = _ACCEPTANCE.get(drafter, {}).get(_acceptance_key(settings, sampling)) if drafter is not None else None
    return DraftLengthController(
        cost_model(target, drafter, compiled),
        acceptance=known.carried() if known is not None else None,
        max_draft=settings.depth,
        probe_every=settings.probe_every,
        min_gain=settings.min_gain,
        keep_gain=settings.keep_gain,
        tree=(settings.top_k, settings.total_tokens) if tree else None,
        drafts=settings.uses_eagle,
        copying=settings.uses_copy,
    )


def keep_acceptance(drafter, settings: DraftSettings, controller: DraftLengthController | None,
                    sampling: bool = False) -> None:
    """What the call's drafting taught of the drafter's acceptance, as the start of its next call of the same kind
    in this process (`AcceptanceEstimate.carried`): a call that never drafted leaves the last one's."""
    if drafter is not None and controller is not None and controller.acceptance.seeded:
        _ACCEPTANCE.setdefault(drafter, {})[_acceptance_key(settings, sampling)] = controller.acceptance


def _acceptance_key(settings: DraftSettings, sampling: bool) -> tuple:
    """Calls whose acceptance carries from one to the next: the same shape of draft, the same sources (beside
    copies the drafter drafts in the rounds copies leave it, the harder ones) and the same kind of decoding
    (sampling accepts fewer drafts than greedy decoding). A benchmark that runs EAGLE alone and the default on
    each prompt in turn thus starts neither from the other's call on the same prompt."""
    return settings.mode, settings.top_k, settings.depth, settings.uses_copy, sampling
