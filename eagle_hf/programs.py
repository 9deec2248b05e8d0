"""Device programs: a round's fixed-shape work as one launch.

A speculation round on a GPU is dominated by launches, not arithmetic: each eager operation costs the host 15-25 µs
to launch (an H200's host), while a one-layer drafter level's kernels take a few. A `Program` is a function of
static buffers only (no host value read, no data-dependent shape), so it can run three ways, the same arithmetic:

* captured once as a CUDA graph and replayed (on CUDA, where the target's forward is compiled);
* compiled by torch.compile with ``fullgraph=True`` (where compile is forced on another device, as tests do on the
  CPU): one call into inductor's kernels (on the CPU, called from its generated C++ wrapper), launched directly
  once compiled, not through torch.compile's entry (`_Direct`). A launch checks the global state alone; what
  else its graph depends on is read when the program is made (`signature`);
* eagerly (everywhere else, and whenever capture or compile fails: never the call's failure).

The caller writes a launch's inputs into the program's buffers (``copy_``, in place), calls it, and reads its
outputs before the next launch overwrites them. `running()` tells a counter (`eagle_hf.tools.sync_probe`) that an
operation belongs to a program's body, not to the launches around it; `LAUNCHES` counts launches in this process.

What a launch reads from the host gets there without stalling it: `pack` puts a step's small host arrays (draft
tokens, positions, tree masks, accepted paths) into one buffer copied once (on CUDA from pinned memory, with
``non_blocking=True``: the host goes on queueing work), `to_device` does the same for one tensor.
"""

from __future__ import annotations

import array
import contextlib
import itertools
import logging
import math
import types
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: programs launched in this process (a counter reads the difference over a round)
LAUNCHES = 0
#: programs captured as CUDA graphs or compiled in this process (a round that made one teaches no cost)
CAPTURES = 0
#: graphs torch.compile made for programs in this process (programs of the same code and shapes share one)
GRAPHS = 0
_DEPTH = 0


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def running() -> bool:
    """Whether a program's body is running now (its operations are the program's, one launch in all)."""
    return _DEPTH > 0


#: graphs a function's programs compile in a process (one a `signature`: rows, widths, buckets, drafters); the
#: programs of later signatures run eagerly, as torch.compile's recompile limit has them
RECOMPILE_ROOM = 64
#: the compiled bodies, one per function and `signature`: programs of the same function and signature share a graph
_COMPILED: dict[tuple, Callable] = {}


class Program:
    """``function(*args)`` over static buffers, launched as one unit. `function` is a plain function of its
    arguments (tensors, lists of tensors, a module, numbers), so that programs of the same function and shapes
    share one compiled graph. `how`: "graph" (CUDA graph capture on first launch), "compile" (torch.compile,
    fullgraph), or "eager". The outputs of a launch are the function's return value, the same tensors every
    launch when captured (read them before the next launch)."""

    def __init__(self, function: Callable, args: tuple, how: str = "eager", name: str = "program",
                 warm_args: Callable[[], tuple] | None = None):
        self.function, self.args, self.how, self.name = function, args, how, name
        # the arguments the warm-ups before a capture run the function with (None: its own): a function that
        # moves data in place (run twice, it moves it twice) warms up on arguments that leave the data as it is
        self.warm_args = warm_args
        self._run: Callable[[], Any] | None = None
        self._graph, self._out = None, None
        self._device: torch.device | None = None  # (a captured program's: where it records and replays)

    def body(self, *first) -> Any:
        return self.function(*first, *self.args)

    def __call__(self, *first) -> Any:
        """A launch; `first`: arguments before the kept ones (a module held weakly elsewhere, the same each
        launch where captured)."""
        global LAUNCHES, _DEPTH
        LAUNCHES += 1
        _DEPTH += 1  # (its body runs: `running`)
        try:
            if self.how == "graph":
                return self._replay(*first)
            if self.how == "compile":
                return self._compiled(*first)
            return self.body(*first)
        finally:
            _DEPTH -= 1

    def _compiled(self, *first) -> Any:
        made = self._run is None
        if made:
            global CAPTURES
            CAPTURES += 1
            key = (self.function, signature(first, self.args))
            self._run = _COMPILED.get(key)
            if self._run is None:
                if sum(function is self.function for function, _ in _COMPILED) >= RECOMPILE_ROOM:
                    logger.info("The %s runs eagerly: %d graphs of it are compiled already", self.name, RECOMPILE_ROOM)
                    self.how = "eager"
                    return self.body(*first)
                self._run = _COMPILED[key] = _compile(self.function, _options(self.args))
        try:
            if not made:
                return self._run(*first, *self.args)
            graphs = _graphs()
            out = self._run(*first, *self.args)  # (the first launch compiles, or reuses a graph of the same shapes)
            global GRAPHS
            GRAPHS += _graphs() - graphs
            return out
        except RuntimeError as err:  # (never the call's failure: the same body runs eagerly; dynamo's and
            # inductor's errors are runtime errors)
            logger.warning("The %s could not be compiled (%s); it runs eagerly", self.name,
                           str(err).splitlines()[0][:200] if str(err) else type(err).__name__)
            self.how = "eager"
            return self.body(*first)

    def _replay(self, *first) -> Any:
        if self._graph is None:
            self._device = _device_of((first, self.args))
            try:
                self._capture(*first)
            except RuntimeError as err:
                logger.warning("The %s could not be captured as a CUDA graph (%s); it runs eagerly", self.name,
                               str(err).splitlines()[0][:200])
                self.how = "eager"
                return self.body(*first)
        with _on(self._device):  # (a graph replays on the current device's stream: the program's own)
            self._graph.replay()
        return self._out

    def _capture(self, *first) -> None:
        """Two warm-up launches on a side stream (on `warm_args`), then the capture, which runs nothing: the first
        replay runs the body once (a private memory pool: programs replay in any order; other threads' CUDA calls
        stay legal meanwhile). All of it on the program's device, whichever device is current."""
        global CAPTURES
        warm = self.args if self.warm_args is None else self.warm_args()
        with _on(self._device):
            with _side_stream():
                for _ in range(2):
                    self.function(*first, *warm)
            self._graph, self._out = self._record(*first)
        CAPTURES += 1

    def _record(self, *first) -> tuple[Any, Any]:
        """(a CUDA graph of what the body queues, its outputs): recorded, not run."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = self.body(*first)
        return graph, out


def _device_of(args: tuple) -> torch.device:
    """The device of the first tensor among `args` (a program's tensors share one)."""
    return next(a.device for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, torch.Tensor))


def _on(device: torch.device | None):
    """`device` made current for CUDA's calls that take the current device (streams, graphs)."""
    return torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext()


@contextlib.contextmanager
def _side_stream():
    """Work queued in the block runs on a side stream, after what is queued now and before what follows (a
    capture's warm-ups, as torch asks)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream().wait_stream(stream)


def _options(args: tuple) -> dict:
    """inductor's options for a program over `args`. On the CPU its kernels are called from generated C++
    (``cpp_wrapper``) rather than from Python, a launch's host work; and a product of one row (a chain's level,
    one row) is a multiply and a sum fused into the kernels around it (``decompose_mm_pass``) rather than a call
    into the BLAS library: chain 5's program then launches in 109 µs instead of 139 (docs/results/round_regime.md,
    "The drafting program's launch")."""
    devices = {a.device.type for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, torch.Tensor)}
    if devices != {"cpu"}:
        return {}
    return {"cpp_wrapper": True, "post_grad_fusion_options": {"decompose_mm_pass": {}}}


def signature(first: tuple, args: tuple) -> tuple:
    """What a compiled program's graph depends on that its launches do not check (`_global_state_guards`): the structure
    of its arguments and their numbers, and everything its modules hold (classes, settings, configuration, hooks,
    their tensors' shapes, dtypes, devices and sharing). Read once, when the program is made: a program is made
    again when its drafter's weights move (`eagle_hf.speculation.drafting.LevelGraphs`)."""
    leaves, spec = torch.utils._pytree.tree_flatten((first, args))
    seen: dict[int, int] = {}
    return str(spec), tuple(_held(leaf, seen) for leaf in leaves)


#: attributes every module has: its parameters, buffers, submodules and hooks (read apart)
_MODULE_ATTRIBUTES = frozenset(vars(torch.nn.Module()))


def _held(value: Any, seen: dict[int, int]) -> Any:
    """`value` as a hashable description of what a graph reads of it; a tensor by shape, dtype, device, stride and
    the place in `seen` of the first tensor on its storage (storage address -> place)."""
    if isinstance(value, torch.Tensor):
        first = seen.setdefault(value.untyped_storage().data_ptr(), len(seen))
        return "tensor", tuple(value.shape), value.dtype, value.device, value.stride(), first
    if isinstance(value, torch.nn.Module):
        hooks = tuple(len(getattr(value, name)) for name in sorted(_MODULE_ATTRIBUTES) if "hooks" in name)
        tensors = tuple((name, _held(t, seen)) for name, t in (*value._parameters.items(), *value._buffers.items())
                        if t is not None)
        held = tuple((name, _held(v, seen)) for name, v in sorted(vars(value).items())
                     if name not in _MODULE_ATTRIBUTES)
        children = tuple((name, _held(m, seen)) for name, m in value._modules.items() if m is not None)
        return type(value), value.training, hooks, tensors, held, children
    if hasattr(value, "to_json_string"):  # (a model's configuration)
        return type(value), value.to_json_string(use_diff=False)
    if isinstance(value, (list, tuple)):
        return type(value), tuple(_held(v, seen) for v in value)
    if isinstance(value, dict):
        return type(value), tuple((k, _held(v, seen)) for k, v in value.items())
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    return type(value)  # (functions, classes: the code the graph traced)


def _compile(function: Callable, options: dict) -> _Direct:
    """`function` compiled by torch.compile (fullgraph, static shapes), launched directly once compiled (`_Direct`)."""
    own = _own_code(function)
    return _Direct(torch.compile(own, fullgraph=True, dynamic=False,
                                 options={**options, "guard_filter_fn": _global_state_guards}), own)


class _Direct:
    """A compiled program's graph launched without torch.compile's entry, which looks a code object's graphs up
    and checks their guards at every call (about 50 µs a launch on a 2-core CPU, more with a module's
    arguments). The first launch goes through the `guarded` entry, which compiles the graph (or finds it in
    inductor's caches); later launches run the code torch.compile made for that graph, which calls it with the
    arguments' tensors, as the entry would. What the graph depends on is its `signature`, read when the program
    is made; the global state (grad mode, deterministic algorithms, ...) is checked at each launch (torch's
    `GlobalStateGuard`: well under a microsecond), and under another state the entry runs (and compiles that
    state's graph). Where torch does not hand the code out, every launch goes through the entry."""

    def __init__(self, guarded: Callable, own: Callable):
        self.guarded, self.own = guarded, own
        self.direct: Callable | None = None
        self.state = None  # the global state the direct code was compiled in
        self.looked = False

    def __call__(self, *args) -> Any:
        if self.direct is not None and self.state.check():
            return self.direct(*args)
        out = self.guarded(*args)
        if not self.looked:
            self.looked = True
            self.direct, self.state = _compiled_code(self.own)
        return out


def _compiled_code(own: Callable) -> tuple[Callable | None, Any]:
    """The code torch.compile made for `own`'s one graph, as a function of `own`'s arguments, with the global
    state it holds for (None where there is not exactly one graph, or torch does not hand it out)."""
    try:
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(own.__code__)
        if len(entries) != 1:
            return None, None
        direct = types.FunctionType(entries[0].code, own.__globals__, own.__name__, own.__defaults__, own.__closure__)
        return direct, torch._C._dynamo.guards.GlobalStateGuard()
    except Exception as err:  # noqa: BLE001  (private parts of torch: whatever fails, the entry launches)
        logger.debug("Programs of %s launch through torch.compile's entry: %s", own.__name__, err)
        return None, None


def _global_state_guards(entries: list) -> list[bool]:
    """Which of torch.compile's guards a compiled program's launch checks: those on the global state alone (grad
    mode, default device, deterministic algorithms). Its arguments' are read once, when the program is made
    (`signature`, the key of its graph), and its code is the program's: a module's hundreds of guards (its
    attributes' types, empty hook dictionaries, each parameter) cost a launch about 150 µs on a 2-core CPU."""
    return [not entry.name for entry in entries]


def _own_code(function: Callable) -> Callable:
    """`function` with a code object of its own. torch.compile keeps its graphs on the code object and tells them
    apart by their guards alone: graphs of two signatures of one function must not meet there."""
    own = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                             function.__defaults__, function.__closure__)
    own.__kwdefaults__ = function.__kwdefaults__
    return own


def how_to_run(device: torch.device, compiled: bool) -> str:
    """How a call's programs run on `device`: captured as CUDA graphs on CUDA, compiled where the target's forward
    is compiled on another device (compile forced there, as tests do on the CPU), else eagerly."""
    if device.type == "cuda":
        return "graph"
    return "compile" if compiled else "eager"


# ------------------------------------------------------------------ host data onto the device
def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`, copied without blocking the host (pinned memory on CUDA)."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class Ints:
    """A program's integer inputs, a [n] int64 buffer on the device that the host writes before each launch: on the
    CPU in place, through a view of its memory (no tensor made, no operation: a few of them a round cost a CPU
    round more than the launch's own host work); elsewhere in one copy that does not block the host (`to_device`)."""

    def __init__(self, n: int, device: torch.device):
        self.tensor = torch.zeros(n, dtype=torch.long, device=device)
        self._memory = self.tensor.numpy() if self.tensor.device.type == "cpu" else None

    def write(self, values: list[int]) -> None:
        if self._memory is not None:
            self._memory[:] = values
        else:
            self.tensor.copy_(to_device(host_longs(values), self.tensor.device))


def pack(device: torch.device, **arrays) -> dict[str, torch.Tensor]:
    """Integer (or bool) host arrays (nested lists or host tensors) in one copy: name -> int64 device tensor of
    the array's shape. On the CPU, where nothing is copied, each array is its own tensor (no joining, no views)."""
    if device.type == "cpu":  # (`to_device` copies nothing here: it names the arrays as the device's)
        return {name: to_device(a.to(torch.long, copy=True) if isinstance(a, torch.Tensor) else host_longs(a), device)
                for name, a in arrays.items()}
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
    return _views(to_device(host_longs(flat), device), shapes)


def host_longs(a: list) -> torch.Tensor:
    """An int64 host tensor of a list of ints or bools, or of equal rows of them: through a flat `array`, which
    costs a fraction of torch.tensor's element by element conversion (a tree's ancestor rows: about 10 µs
    against 30 µs on a 2-core CPU). Anything else (deeper, ragged, empty, not integral) as torch.tensor has it."""
    rows = len(a) if a and isinstance(a[0], list) else None
    width = len(a[0]) if rows is not None else len(a)
    if not width or (rows is not None and (isinstance(a[0][0], list) or
                                           any(not isinstance(r, list) or len(r) != width for r in a))):
        return torch.tensor(a, dtype=torch.long)
    try:
        flat = array.array("q", a if rows is None else itertools.chain.from_iterable(a))
    except TypeError:  # (floats: torch.tensor truncates them)
        return torch.tensor(a, dtype=torch.long)
    out = torch.frombuffer(flat, dtype=torch.long)  # (it holds the array)
    return out if rows is None else out.view(rows, width)


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
