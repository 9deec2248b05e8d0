"""Count, on the CPU, what one speculation round would cost a GPU in host-device traffic.

On a GPU every read of a device tensor by the host (``int(t)``, ``t.tolist()``, ``bool(t)``, a boolean-mask index,
``nonzero``) waits for all queued kernels, and every blocking host-to-device copy (``torch.tensor(data,
device=...)``, ``t.to(device)``) waits for the copy; a ``torch.cuda.synchronize`` in a clock waits for everything.
None of that shows on a CPU, where work is synchronous. This probe makes it show: a `TorchFunctionMode` tags as
*device* every tensor that comes from a model's parameters or buffers, from the inputs, or from a factory given a
``device=``, propagates the tag through every op, and counts per round

* ``reads``: device-to-host reads (``item``, ``tolist``, ``bool``/``int``/``float``, ``cpu``, ``nonzero``, boolean
  masks, ...);
* ``copies``: blocking host-to-device copies (host data put on the device: ``torch.tensor(..., device=)``,
  ``.to(device)`` of a host tensor, a host tensor written into or indexing a device tensor);
* ``async_copies``: host-to-device copies that do not block (``.to(device, non_blocking=True)``, from pinned
  memory on a GPU: `eagle_hf.programs`);
* ``syncs``: whole-device synchronisations (eagle_hf's timing, ``torch.cuda.synchronize``);
* ``mixed``: ops that combine a device tensor with a host tensor of one element or more (they fail on a GPU, or
  copy implicitly).

A round starts where the decoding loop plans its drafts (eagle_hf's loop) or asks for candidates (transformers'
assisted loop, chain mode); what runs before the first round is the prefill. Counts are deterministic for a
deterministic schedule (``num_assistant_tokens_schedule="constant"``): tests pin them.

    report = probe_generate(target, inputs, assistant_model=drafter, tree_depth=5, max_new_tokens=16,
                            num_assistant_tokens_schedule="constant")
    report.summary()   # per round kind: the most reads, copies and syncs of one round
"""

from __future__ import annotations

import contextlib
import statistics
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .. import programs
from ..speculation.drafting import LevelGraphs

_TAG = "_eagle_hf_device"
#: tensor methods and functions that read a device tensor's values on the host
READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "__format__", "__repr__",
         "equal", "allclose", "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}
#: factories that copy host data onto the device when given one
DATA_FACTORIES = {"tensor", "as_tensor", "asarray"}
#: methods that never read, copy or mix (attribute-like)
QUIET = {"__get__", "__set__", "dim", "size", "numel", "__len__", "shape", "dtype", "device", "is_floating_point",
         "data_ptr", "stride", "element_size", "requires_grad_", "storage_offset", "is_contiguous", "__hash__",
         "__eq__", "__ne__", "__iter__"}


def _tensors(obj) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def on_device(t: torch.Tensor) -> bool:
    return getattr(t, _TAG, False)


def _tag(obj) -> None:
    for t in _tensors(obj):
        try:
            setattr(t, _TAG, True)
        except (AttributeError, RuntimeError):  # (some tensor subclasses refuse attributes)
            pass


@dataclass
class Round:
    """One round's counts; ``width`` is the number of tokens verified (1: a plain step; 0: the prefill)."""

    width: int = 0
    reads: int = 0
    copies: int = 0
    async_copies: int = 0  # host-to-device copies that do not block the host (pinned, ``non_blocking``)
    syncs: int = 0
    mixed: int = 0
    bytes: int = 0  # bytes eagle_hf's own ops wrote outside the models' forwards (with ``count_bytes``)
    ops: int = 0  # device operations outside the target's forward and the programs' bodies (with ``count_ops``)
    launches: int = 0  # programs launched (`eagle_hf.programs`: one CUDA graph replay each on a GPU)
    where: Counter = field(default_factory=Counter)  # "kind:function" -> count, to find the culprits
    bytes_by_op: Counter = field(default_factory=Counter)  # aten op -> bytes written (with ``count_bytes``)

    @property
    def kind(self) -> str:
        return "prefill" if self.width == 0 else ("plain" if self.width == 1 else "draft")


class _Provenance(TorchFunctionMode):
    def __init__(self, probe: SyncProbe):
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in QUIET:
            return func(*args, **kwargs)
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        device_in = [t for t in inputs if on_device(t)]
        host_in = [t for t in inputs if not on_device(t) and t.numel() > 0]
        out = func(*args, **kwargs)
        probe = self.probe
        if name in READS and device_in:
            probe.count("reads", f"{name} in a program" if programs.running() else name)
            if name == "cpu":
                return out  # the host copy stays untagged
        elif name in ("__getitem__", "__setitem__", "index_put_", "index_put") and device_in:
            index = args[1] if len(args) > 1 else None
            if any(t.dtype == torch.bool and t.dim() > 0 for t in _tensors(index)):  # a mask index runs nonzero
                probe.count("reads", f"{name}[bool mask]" + (" in a program" if programs.running() else ""))
            if host_in and on_device(args[0]):
                probe.count("copies", f"{name} with host tensors")
        elif name in DATA_FACTORIES and kwargs.get("device") is not None:
            if not (isinstance(args[0], torch.Tensor) and on_device(args[0])):
                probe.count("copies", name)
            _tag(out)
            return out
        elif name in ("to", "cuda") and not device_in and _names_device(args[1:], kwargs):
            probe.count("async_copies" if kwargs.get("non_blocking") else "copies", name)
            _tag(out)
            return out
        elif name == "new_tensor" and device_in:
            probe.count("copies", name)
        elif device_in and host_in and not name.startswith("new_") and name not in ("to", "copy_"):
            probe.count("mixed", name)
        elif name == "copy_" and device_in and host_in and on_device(args[0]):
            probe.count("copies", name)
        if device_in or kwargs.get("device") is not None:
            _tag(out)
        return out


def _names_device(args, kwargs) -> bool:
    """Whether a ``.to(...)`` call names a device (not only a dtype)."""
    if kwargs.get("device") is not None:
        return True
    for a in args:
        if isinstance(a, (str, torch.device)):
            return True
        if isinstance(a, torch.Tensor):
            return on_device(a)
    return False


class SyncProbe:
    """Counts per round while active (a context manager); `rounds[0]` is what ran before the first round."""

    def __init__(self, *models, inputs=(), count_bytes: bool = False, count_ops: bool = False):
        self.models, self.inputs = [m for m in models if m is not None], inputs
        self.count_bytes = count_bytes  # also the bytes written outside the models' forwards (`Round.bytes`)
        self.count_ops = count_ops  # also the operations outside the target's forward and the programs (`Round.ops`)
        self.rounds: list[Round] = [Round()]

    def count(self, kind: str, where: str) -> None:
        r = self.rounds[-1]
        setattr(r, kind, getattr(r, kind) + 1)
        r.where[f"{kind}:{where}"] += 1

    def start_round(self, width: int) -> None:
        self.rounds.append(Round(width=width))

    @contextlib.contextmanager
    def active(self):
        tagged = []
        for m in self.models:
            for t in list(m.parameters()) + list(m.buffers()) + LevelGraphs.kept_tensors(m):
                if not on_device(t):
                    _tag(t)
                    tagged.append(t)
        _tag(list(self.inputs))
        with contextlib.ExitStack() as stack:
            stack.enter_context(_count_syncs(self))
            stack.enter_context(_round_markers(self))
            stack.enter_context(_Provenance(self))
            if self.count_bytes:
                stack.enter_context(_ByteCounter(self))
            if self.count_ops:
                stack.enter_context(_OpsOutside(self))
            try:
                yield self
            finally:
                for t in tagged:
                    with contextlib.suppress(AttributeError):
                        delattr(t, _TAG)

    # ------------------------------------------------------------------ results
    def summary(self) -> dict[str, dict[str, float]]:
        """Per round kind: rounds, and the most and the median reads, copies, syncs and mixed ops of one round.
        The last round also holds the loop's wrap-up; it is left out where other rounds of its kind exist."""
        out = {}
        rounds = self.rounds[:-1] if len(self.rounds) > 2 else self.rounds
        for kind, rs in _group(rounds).items():
            row = {"rounds": len(rs)}
            for what in ("reads", "copies", "async_copies", "syncs", "mixed", "ops", "launches"):
                values = [getattr(r, what) for r in rs]
                row[f"max_{what}"] = max(values)
                row[f"median_{what}"] = statistics.median(values)
            out[kind] = row
        return out

    def culprits(self, kind: str = "draft", top: int = 12) -> list[tuple[str, int]]:
        """The functions behind the counts of the rounds of one kind, most frequent first."""
        total = Counter()
        for r in self.rounds[1:]:
            if r.kind == kind:
                total.update(r.where)
        return total.most_common(top)


def _group(rounds: list[Round]) -> dict[str, list[Round]]:
    out: dict[str, list[Round]] = {}
    for r in rounds:
        out.setdefault(r.kind, []).append(r)
    return out


@contextlib.contextmanager
def _count_syncs(probe: SyncProbe):
    """Counts device synchronisations: torch.cuda.synchronize (and an accelerator's own, where torch has one)."""
    patched = [(torch.cuda, "synchronize")] + [(getattr(torch, kind), "synchronize") for kind in ("xpu", "mps")
                                                if hasattr(getattr(torch, kind, None), "synchronize")]
    originals = [getattr(module, name) for module, name in patched]

    def counted(kind):
        return lambda *args, **kwargs: probe.count("syncs", f"{kind}.synchronize")

    for module, name in patched:
        setattr(module, name, counted(module.__name__))
    try:
        yield
    finally:
        for (module, name), original in zip(patched, originals):
            setattr(module, name, original)


@contextlib.contextmanager
def _round_markers(probe: SyncProbe):
    """Marks where rounds start: eagle_hf's loop planning and drafting, transformers' loop asking for candidates."""
    from ..hf.candidate import EagleCandidateGenerator
    from ..hf.tree_loop import TreeLoop

    draft, get_candidates = TreeLoop.draft, EagleCandidateGenerator.get_candidates

    def planned(self, active, *args, **kwargs):
        marker = Round()
        probe.rounds.append(marker)
        plan, trees = draft(self, active, *args, **kwargs)
        marker.width = trees.width if hasattr(trees, "width") else max(t.size for t in trees)
        return plan, trees

    def candidates(self, input_ids, *args, **kwargs):
        marker = Round()
        probe.rounds.append(marker)
        ids, q = get_candidates(self, input_ids, *args, **kwargs)
        marker.width = ids.shape[1] - input_ids.shape[1] + 1 if marker is not probe.rounds[1] else 0
        return ids, q

    TreeLoop.draft, EagleCandidateGenerator.get_candidates = planned, candidates
    try:
        yield
    finally:
        TreeLoop.draft, EagleCandidateGenerator.get_candidates = draft, get_candidates


class _ByteCounter(TorchDispatchMode):
    """Bytes that every aten op writes (its outputs; an in-place op's view) outside the models' forwards: the
    target's forward and the drafter's layers are the models' work, the rest (drafter cache writes, masks, cache
    commits, gathers) eagle_hf's own."""

    def __init__(self, probe: SyncProbe):
        super().__init__()
        self.probe, self.inside, self.handles = probe, 0, []

    def __enter__(self):
        modules = [m for model in self.probe.models
                   for m in ([model] if hasattr(model, "generate") else list(model.children()))]
        for m in modules:
            self.handles.append(m.register_forward_pre_hook(lambda *a: self._enter_model()))
            self.handles.append(m.register_forward_hook(lambda *a: self._leave_model()))
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return super().__exit__(*exc)

    def _enter_model(self):
        self.inside += 1

    def _leave_model(self):
        self.inside -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.inside and not func.is_view:  # (a view writes nothing)
            written = sum(t.numel() * t.element_size() for t in _tensors(out))
            r = self.probe.rounds[-1]
            r.bytes += written
            r.bytes_by_op[str(func.overloadpacket)] += written
        return out


class _OpsOutside(TorchDispatchMode):
    """Device operations (about one kernel launch each on a GPU) outside the target's forward and outside the
    programs' bodies (`eagle_hf.programs`: one launch each, counted as `Round.launches`): what a round launches
    eagerly around the target's forward and the programs."""

    def __init__(self, probe: SyncProbe):
        super().__init__()
        self.probe, self.inside, self.handles = probe, 0, []
        self.launches = programs.LAUNCHES

    def __enter__(self):
        for m in self.probe.models:
            if hasattr(m, "generate"):  # the target (a drafter's eager passes are launches of their own)
                self.handles.append(m.register_forward_pre_hook(lambda *a: self._move(1)))
                self.handles.append(m.register_forward_hook(lambda *a: self._move(-1)))
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return super().__exit__(*exc)

    def _move(self, by: int) -> None:
        self.inside += by

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        r = self.probe.rounds[-1]
        if programs.LAUNCHES != self.launches:
            r.launches += programs.LAUNCHES - self.launches
            self.launches = programs.LAUNCHES
        if not self.inside and not programs.running() and not func.is_view:  # (a view launches nothing)
            r.ops += 1
            r.where[f"ops:{func.overloadpacket}"] += 1
        return out


def probe_generate(target, inputs: dict, count_bytes: bool = False, count_ops: bool = False,
                   **generate_kwargs) -> SyncProbe:
    """Run ``target.generate(**inputs, **generate_kwargs)`` under a probe and return it (its rounds counted)."""
    probe = SyncProbe(target, generate_kwargs.get("assistant_model"), inputs=list(_tensors(inputs)),
                      count_bytes=count_bytes, count_ops=count_ops)
    with probe.active(), torch.no_grad():
        target.generate(**inputs, **generate_kwargs)
    return probe


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count_aten_ops(fn, *args, **kwargs) -> tuple[int, Counter]:
    """(aten ops, by op) that ``fn(*args, **kwargs)`` dispatches: about the kernels it launches on a GPU."""
    counter = _OpCounter()
    with counter, torch.no_grad():
        fn(*args, **kwargs)
    return sum(counter.ops.values()), counter.ops
