"""Where and how a target loads: `device` / `device_map`, `dtype` and `attn_implementation` (transformers' names).

Every value is checked before any loading, so a typo (``"gpu"``), a device this machine lacks (``"cuda:7"``) or an
unknown attention implementation fails in a second with an error that names the fix, not after minutes of
loading. The same options are the CLI's ``--device``, ``--device-map``, ``--dtype`` and ``--attn-implementation``
(`add_device_arguments`, `load_options`).
"""

from __future__ import annotations

import argparse
import logging

import torch

from .errors import EagleCompatibilityError

logger = logging.getLogger(__name__)

#: accelerate's placement strategies for `device_map` (anything else is a device, or a dict of them)
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
#: the dtypes the CLI offers ("auto": the checkpoint's own dtype)
DTYPE_CHOICES = ("bfloat16", "float16", "float32", "auto")
#: examples shown in the CLI help and in errors
ATTN_EXAMPLES = ("sdpa", "eager", "flash_attention_2", "flex_attention")
_DEVICE_HINT = "a torch device such as 'cpu', 'cuda', 'cuda:1', 'mps' or 'xpu'"


def check_device(device) -> torch.device:
    """`device` as a `torch.device`, if this machine has it; else an error naming the devices it has."""
    if isinstance(device, str) and device.strip().lower() in DEVICE_MAP_STRATEGIES:
        raise EagleCompatibilityError(
            f"device={device!r} is a placement strategy, not a device: pass device_map={device!r} "
            f"(--device-map {device}) to let accelerate place the layers, or a device ({_DEVICE_HINT})."
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as err:
        hint = ("For a GPU pass 'cuda' (NVIDIA, AMD ROCm), 'mps' (Apple) or 'xpu' (Intel)." if str(device) == "gpu"
                else f"({err})")
        raise EagleCompatibilityError(f"Unknown device {device!r}: pass {_DEVICE_HINT}. {hint}") from None
    count = _device_count(dev.type)
    if count == 0:
        cpu_only = dev.type == "cuda" and torch.version.cuda is None and torch.version.hip is None
        build = " (this torch is a CPU-only build)" if cpu_only else ""
        raise EagleCompatibilityError(
            f"Device {str(device)!r} is not available: torch sees no {dev.type} device on this machine{build}. "
            f"Pass device='cpu' (--device cpu), or run where a {dev.type} device is visible."
        )
    if count is not None and dev.index is not None and dev.index >= count:
        have = ", ".join(f"{dev.type}:{i}" for i in range(count))
        raise EagleCompatibilityError(
            f"Device {str(device)!r} does not exist: this machine has {count} {dev.type} device(s) ({have}). "
            f"Pass one of them."
        )
    return dev


def _device_count(kind: str) -> int | None:
    """Devices of this kind torch sees (0: none); None where torch gives no count (then torch itself checks)."""
    if kind in ("cpu", "meta"):
        return None
    if kind == "mps":
        return 1 if torch.backends.mps.is_available() else 0
    module = getattr(torch, kind, None)
    if module is None or not hasattr(module, "device_count"):
        return None
    try:
        return module.device_count() if module.is_available() else 0
    except (RuntimeError, AssertionError):  # a backend compiled in but not usable here
        return 0


def check_device_map(device_map):
    """A strategy name (``"auto"``, ...), a device, or a dict of module name -> device / ``"cpu"`` / ``"disk"``."""
    if isinstance(device_map, str) and device_map in DEVICE_MAP_STRATEGIES:
        return device_map
    if isinstance(device_map, dict):
        for module, where in device_map.items():
            if where != "disk":
                _check_map_entry(module, where)
        return device_map
    if isinstance(device_map, (str, int, torch.device)) and not isinstance(device_map, bool):
        try:
            check_device(device_map)
        except EagleCompatibilityError as err:
            strategies = ", ".join(map(repr, DEVICE_MAP_STRATEGIES))
            raise EagleCompatibilityError(f"device_map={device_map!r}: {err} Or a strategy: {strategies}.") from None
        return device_map
    raise EagleCompatibilityError(
        f"device_map={device_map!r} ({type(device_map).__name__}) is not a device map: pass a strategy "
        f"({', '.join(map(repr, DEVICE_MAP_STRATEGIES))}), a device ('cuda:0') or a dict of module name -> device, "
        "as transformers' from_pretrained takes it."
    )


def _check_map_entry(module, where) -> None:
    try:
        check_device(where)
    except EagleCompatibilityError as err:
        raise EagleCompatibilityError(f"device_map[{module!r}]: {err}") from None


def check_dtype(dtype):
    """A torch floating dtype, its name (``"bfloat16"``, ``"torch.float16"``), ``"auto"`` or a dict (per
    sub-model, as transformers takes it); names become dtypes."""
    if isinstance(dtype, (torch.dtype, dict)) or dtype == "auto":
        return dtype
    found = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else None
    if isinstance(found, torch.dtype) and found.is_floating_point:
        return found
    raise EagleCompatibilityError(
        f"Unknown dtype {dtype!r}: pass {', '.join(map(repr, DTYPE_CHOICES))} or a torch floating dtype "
        "(torch.bfloat16). 'auto' keeps the checkpoint's own dtype."
    )


def check_attention_kernel(name):
    """None (the model's default), a known implementation or a Hub kernel (``"org/repo"``); per-sub-model dicts
    pass through. Whether the model and this machine support it is transformers' check, at load time."""
    if name is None or isinstance(name, dict):
        return name
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, is_kernel

    known = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    if isinstance(name, str) and (name in known or name.removeprefix("paged|") in known or is_kernel(name)):
        return name
    raise EagleCompatibilityError(
        f"Unknown attention implementation {name!r}: pass one of {', '.join(known)}, or a Hub kernel "
        "('kernels-community/flash-attn'); leave it out for the model's default (sdpa where supported)."
    )


def check_load_options(dtype=torch.bfloat16, device=None, device_map=None, attn_implementation=None, **rest) -> dict:
    """The `from_pretrained` keywords, checked: `device` becomes `device_map` (loading straight onto it), a dtype
    name becomes a dtype; the other keywords pass through. Raises `EagleCompatibilityError` before any loading."""
    if "torch_dtype" in rest:  # transformers' older name
        dtype = rest.pop("torch_dtype")
    if device is not None and device_map is not None:
        raise EagleCompatibilityError(
            f"Pass device= or device_map=, not both (got device={device!r}, device_map={device_map!r}): a device "
            "loads the whole model there; device_map='auto' spreads it over the GPUs (and the CPU when it does "
            "not fit)."
        )
    if device is not None:
        check_device(device)
        device_map = device
    options = {"dtype": check_dtype(dtype), **rest}
    if device_map is not None:
        options["device_map"] = check_device_map(device_map)
    if attn_implementation is not None:
        options["attn_implementation"] = check_attention_kernel(attn_implementation)
    return options


def single_device(device_map) -> torch.device:
    """The one device a small model goes to for `device_map`: a device as given; a strategy picks this machine's
    accelerator (the CPU without one). A dict spreads modules: refused (the model must stay on one device)."""
    if device_map is None:
        return torch.device("cpu")
    if isinstance(device_map, dict):
        raise EagleCompatibilityError(
            "The embedded default target (135M parameters) loads whole onto one device: pass device='cuda' (or "
            "device_map='auto'), not a dict device_map."
        )
    if device_map in DEVICE_MAP_STRATEGIES:
        accelerator = torch.accelerator.current_accelerator(check_available=True)
        return accelerator if accelerator is not None else torch.device("cpu")
    return torch.device(device_map)


def native_bf16(device) -> bool:
    """Whether `device` computes bfloat16 natively: a CUDA GPU that supports it, or a CPU with AVX512-BF16 or AMX
    (read from Linux's /proc/cpuinfo). Elsewhere bf16 is emulated: on a CPU with AVX2 alone a forward over 16
    tokens of SmolLM2-135M took 0.32 s in bf16 against 0.14 s in float32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return True  # (mps, xpu: their own kernels)
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def input_device(model) -> torch.device:
    """Where a model's inputs go: the device of its input embeddings (with a `device_map` that spreads the model,
    its first layers; `model.device` is only the device of its first parameter)."""
    return model.get_input_embeddings().weight.device


# ------------------------------------------------------------------------------------------------ CLI
def add_device_arguments(parser: argparse.ArgumentParser, dtype_default: str = "bfloat16",
                         dtype_help: str = "the target's dtype", dtypes: tuple[str, ...] = DTYPE_CHOICES) -> None:
    """``--device`` / ``--device-map`` (exclusive), ``--dtype`` and ``--attn-implementation``."""
    unset = "%(default).0s"  # prints nothing; stops ArgumentDefaultsHelpFormatter from adding "(default: None)"
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--device", default="cpu",
                       help="load the target straight onto this device: cpu, cuda, cuda:1, mps, xpu, ...")
    where.add_argument("--device-map", default=None, metavar="MAP",
                       help="instead of --device: a transformers device_map strategy (auto, balanced, sequential) "
                            "that spreads the target over the GPUs and offloads to the CPU what does not fit" + unset)
    auto = "auto: the checkpoint's own; " if "auto" in dtypes else ""
    parser.add_argument("--dtype", default=dtype_default, choices=dtypes,
                        help=f"{dtype_help} ({auto}bf16 is ~2x faster than float32 on CPUs with AVX512-BF16)")
    parser.add_argument("--attn-implementation", default=None, metavar="NAME",
                        help=f"the target's attention ({', '.join(ATTN_EXAMPLES)}, ...; default: the model's own)" + unset)


def load_options(args: argparse.Namespace) -> dict:
    """`load_target` keywords from the parsed ``--device`` / ``--device-map`` / ``--dtype`` /
    ``--attn-implementation`` (unchecked: `load_target` checks them, or `check_load_options`)."""
    options = {"dtype": args.dtype, "attn_implementation": args.attn_implementation}
    if args.device_map is not None:
        options["device_map"] = args.device_map
    else:
        options["device"] = args.device
    return options
