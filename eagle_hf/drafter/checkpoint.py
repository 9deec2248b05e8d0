"""Loading every published EAGLE-3 drafter layout, and saving the one vLLM and SGLang read.

Layouts (eagle_spec.md §2-3):

* ``eagle``: the EAGLE reference / SpecForge / TorchSpec flat Llama config (``LlamaForCausalLMEagle3``), weights
  ``midlayer.*`` in ``pytorch_model.bin`` or ``model.safetensors`` (possibly sharded, possibly ``model.``-prefixed).
  Explicit aux ids whose first id is 1 are in the "output of layer" convention (SpecForge/TorchSpec).
* ``speculators``: vllm-project/speculators (``Eagle3DraftModel``, ``transformer_layer_config``), weights
  ``layers.0.*``, usually with ``embed_tokens.weight``.
* ``eagle_hf``: ours, which is the ``eagle`` layout plus provenance; aux ids in the boundary convention.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

import torch
from transformers.activations import ACT2FN

from ..compat import rope_types
from .capture import CONVENTIONS, guess_convention
from .config import EAGLE3_ARCHITECTURES, SPECULATORS_ARCHITECTURES, EagleConfig

logger = logging.getLogger(__name__)

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
#: Tensors some trainers ship that inference never reads; dropped with a log line, never silently.
TRAINING_ONLY_PREFIXES = ("verifier_lm_head.", "verifier_norm.", "verifier.")


class DrafterLoadError(ValueError):
    """A drafter checkpoint that cannot be loaded; the message names the problem and the fix."""


# ---------------------------------------------------------------------------------------------- files
def resolve_folder(name_or_path: str | os.PathLike, revision: str | None = None, **hub_kwargs) -> Path:
    """A local folder, or a Hub repo id fetched (or found in the cache) with huggingface_hub."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.exists():
        raise DrafterLoadError(f"{path} is a file; pass the folder that holds config.json and the weights.")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    try:
        folder = snapshot_download(
            str(name_or_path),
            revision=revision,
            allow_patterns=["*.json", "*.safetensors", "*.bin", "*.md"],
            **hub_kwargs,
        )
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as err:
        # offline, huggingface_hub 1.x asks the Hub for a pinned revision's file list even when its snapshot is
        # cached (2.x reads the cache): the cached snapshot is the answer either way
        cached = _cached_snapshot(str(name_or_path), revision, hub_kwargs.get("cache_dir"))
        if cached is not None:
            return cached
        raise DrafterLoadError(
            f"Drafter {name_or_path!r} (revision {revision or 'main'}) is neither a local folder nor in the Hugging "
            "Face cache, and the Hub cannot be reached (offline, or HF_HUB_OFFLINE=1). Download it once with "
            f"`huggingface-cli download {name_or_path}` on a connected machine, or pass a local folder."
        ) from err
    except (HfHubHTTPError, ValueError) as err:
        raise DrafterLoadError(
            f"Could not fetch drafter {name_or_path!r} from the Hub: {err}. If you meant a local folder, no folder "
            f"exists at {Path(name_or_path).resolve()}."
        ) from err
    return Path(folder)


def _cached_snapshot(repo_id: str, revision: str | None, cache_dir) -> Path | None:
    """The Hugging Face cache's snapshot folder of `repo_id` at `revision` (a branch or a commit), if it holds a
    config.json; None otherwise."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir, revision=revision)
    except ValueError:  # not a valid repo id
        return None
    return Path(found).parent if isinstance(found, str) else None


def present(path: Path) -> bool:
    """Whether a drafter's file `path` is there: a regular file, or a link to one. Anything else under that name
    (a FIFO, a socket, a device, a folder, a link to nothing) is a `DrafterLoadError` naming it, found before
    anything reads it: reading a FIFO would wait for a writer forever."""
    if not os.path.lexists(path):
        return False
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        raise DrafterLoadError(
            f"{path} is a link to {os.readlink(path) if os.path.islink(path) else '?'}, which does not exist "
            f"({err.strerror}); fetch the drafter again, or restore the file it points to."
        ) from err
    if not stat.S_ISREG(mode):
        kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else
                "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "not a file")
        raise DrafterLoadError(f"{path} is {kind}, not a regular file; eagle_hf does not read it. Put the drafter's "
                               "file there (or fetch the drafter again).")
    return True


def read_config(folder: Path) -> dict[str, Any]:
    """A drafter folder's config.json, each field eagle_hf reads checked (`check_fields`)."""
    path = folder / "config.json"
    if not present(path):
        raise DrafterLoadError(f"{folder} has no config.json; it is not a drafter checkpoint folder.")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise DrafterLoadError(f"{path} is not valid JSON ({err}); the download may be corrupt: fetch it again.") from err
    if not isinstance(raw, dict):
        raise DrafterLoadError(
            f"{path} holds {_kind(raw)}, not a JSON object of config fields; the download may be corrupt: fetch it again."
        )
    check_fields(raw, path)
    return raw


#: config.json fields eagle_hf reads, by what each must be when set (null: not set)
POSITIVE_INTS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "num_hidden_layers", "vocab_size", "draft_vocab_size", "target_hidden_size", "max_position_embeddings",
                 "num_aux_hidden_states")
FLAGS = ("attention_bias", "bias", "fc_norm", "norm_output", "norm_before_fc", "norm_before_residual", "use_aux_norm",
         "tie_word_embeddings", "use_aux_hidden_state")
OBJECTS = ("rope_scaling", "rope_parameters", "draft_settings", "eagle_config", "eagle_hf", "transformer_layer_config")
STRINGS = ("target_model", "model_type", "aux_layer_convention")
AUX_IDS = "eagle_aux_hidden_state_layer_ids"
ROPE_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor",
                "original_max_position_embeddings")
#: where fields sit besides the top level: EAGLE-3 engines' block, the speculators layout's layer, eagle_hf's own,
#: the RoPE settings (either spelling)
NESTED = ("eagle_config", "transformer_layer_config", "eagle_hf", "rope_scaling", "rope_parameters")
#: what a drafter's config.json must set (else Llama-3-8B's sizes would be assumed)
REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")


def check_fields(raw: dict[str, Any], path: Path) -> None:
    """Every field eagle_hf reads from a drafter's config.json (top level and `NESTED` blocks) is of its kind,
    else a `DrafterLoadError` naming the field and the file (rather than a failure deep in loading or in
    ``generate()``)."""

    def bad(name: str, value, what: str):
        return DrafterLoadError(
            f"{path}: `{name}` is {value!r}, not {what}. Fix this field (the file may be damaged, edited by hand or "
            "not a drafter's), or fetch the drafter again."
        )

    blocks = [("", raw)] + [(f"{key}.", raw[key]) for key in NESTED if isinstance(raw.get(key), dict)]
    layer = raw.get("transformer_layer_config")
    blocks += [(f"transformer_layer_config.{key}.", layer[key]) for key in NESTED
               if isinstance(layer, dict) and isinstance(layer.get(key), dict)]
    for prefix, block in blocks:
        for key, value in block.items():
            name = prefix + key
            if value is None:
                continue
            if key in POSITIVE_INTS and not (_is_int(value) and value >= 1):
                raise bad(name, value, "a positive integer")
            if key in FLAGS and not (isinstance(value, bool) or value in (0, 1) and _is_int(value)):
                raise bad(name, value, "true or false")
            if key in OBJECTS and not isinstance(value, dict):
                raise bad(name, value, "a JSON object")
            if key in STRINGS and not isinstance(value, str):
                raise bad(name, value, "a string")
            if key == "rms_norm_eps" and not (_is_number(value) and 0 < value < 1):
                raise bad(name, value, "a number between 0 and 1 (e.g. 1e-05)")
            if key == "rope_theta" and not (_is_number(value) and 0 < value < math.inf):
                raise bad(name, value, "a positive number (e.g. 10000.0)")
            if key in ROPE_NUMBERS and not (_is_number(value) and 0 < value < math.inf):
                raise bad(name, value, "a positive number")
            if (key in ("rope_type", "type") and prefix.endswith(("rope_scaling.", "rope_parameters."))
                    and (not isinstance(value, str) or value not in rope_types())):
                raise bad(name, value, f"a RoPE type transformers knows ({', '.join(sorted(rope_types()))})")
            if key == "hidden_act" and (not isinstance(value, str) or value not in ACT2FN):
                raise bad(name, value, f"an activation transformers knows ({', '.join(sorted(ACT2FN)[:8])}, ...)")
            if key in ("torch_dtype", "dtype") and _as_dtype(value) is None:
                raise bad(name, value, "a floating-point dtype name (e.g. \"bfloat16\")")
            if key == "architectures" and not (isinstance(value, list) and all(isinstance(a, str) for a in value)):
                raise bad(name, value, "a list of class names")
            if key == AUX_IDS and not (isinstance(value, list) and value and all(_is_int(i) and i >= 0 for i in value)):
                raise bad(name, value, "a list of target layer numbers (e.g. [2, 16, 29])")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _kind(value) -> str:
    return "null" if value is None else f"a JSON {type(value).__name__}"


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    present(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # safetensors, pickle and zip errors differ in type
        raise DrafterLoadError(
            f"Cannot read weight file {path} ({type(err).__name__}: {err}). The file is truncated or corrupt: "
            "delete it and download the drafter again (e.g. `snapshot_download(..., force_download=True)`)."
        ) from err


def load_weights(folder: Path, origins: dict[str, Path] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder: single file or sharded (index json), safetensors or torch pickle.
    `origins`, when given, receives the file each tensor came from (for messages about a tensor)."""
    origins = {} if origins is None else origins

    def read(path: Path) -> dict[str, torch.Tensor]:
        tensors = _load_file(path)
        origins.update(dict.fromkeys(tensors, path))
        return tensors

    for index_name in INDEX_FILES:
        index = folder / index_name
        if present(index):
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as err:
                raise DrafterLoadError(f"{index} is not a valid shard index: {err}") from err
            state = {}
            for shard in shards:
                if not present(folder / shard):
                    raise DrafterLoadError(f"{index} lists shard {shard}, which is missing from {folder}.")
                state.update(read(folder / shard))
            return state
    for name in WEIGHT_FILES:
        if present(folder / name):
            return read(folder / name)
    others = sorted(p for p in folder.glob("*.safetensors") if present(p))
    if len(others) == 1:
        return read(others[0])
    raise DrafterLoadError(
        f"No weights in {folder}: expected model.safetensors, pytorch_model.bin or a sharded index."
    )


# ---------------------------------------------------------------------------------------------- config
def detect_layout(raw: dict[str, Any], where: Path | str = "config.json") -> str:
    archs = raw.get("architectures") or []
    if "speculators_model_type" in raw or "transformer_layer_config" in raw or set(archs) & set(SPECULATORS_ARCHITECTURES):
        return "speculators"
    if "eagle_hf" in raw:
        return "eagle_hf"
    if set(archs) & set(EAGLE3_ARCHITECTURES) or "draft_vocab_size" in raw or "eagle_config" in raw:
        return "eagle"
    if any(a.startswith("Eagle3Deepseek") for a in archs):
        raise DrafterLoadError(
            f"{where}: {archs[0]} drafters use multi-head latent attention (MLA), which eagle_hf does not implement yet."
        )
    raise DrafterLoadError(
        f"{where}: this config.json is not an EAGLE-3 drafter (architectures={archs}, model_type={raw.get('model_type')}). "
        "Pass the drafter's repo (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B), not the target model."
    )


def _first(*values):
    for v in values:
        if v is not None:
            return v
    return None


def normalize_config(raw: dict[str, Any], layout: str,
                     where: Path | str = "config.json") -> tuple[dict[str, Any], list[int] | None, str]:
    """EagleConfig kwargs from a raw config, plus the raw aux ids and their convention."""
    if layout == "speculators":
        layer = raw.get("transformer_layer_config") or {}
        base = dict(layer)
        for key in ("draft_vocab_size", "target_hidden_size", "norm_before_residual", "fc_norm", "norm_output"):
            if raw.get(key) is not None:
                base[key] = raw[key]
        eagle = {}
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        norm_before_fc = raw.get("norm_before_fc")
        convention = "boundary"
    else:
        base = dict(raw)
        eagle = raw.get("eagle_config") or {}
        ids = _first(raw.get("eagle_aux_hidden_state_layer_ids"), eagle.get("eagle_aux_hidden_state_layer_ids"))
        norm_before_fc = _first(eagle.get("norm_before_fc"), raw.get("norm_before_fc"))
        ours = raw.get("eagle_hf") or {}
        convention = ours.get("aux_layer_convention") or guess_convention(ids or [], layout)
        if eagle.get("use_aux_hidden_state") is False:
            raise DrafterLoadError(f"{where}: drafters with `use_aux_hidden_state: false` (EAGLE-1 style) are not supported.")
    keys = ["hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "num_hidden_layers", "vocab_size", "draft_vocab_size", "target_hidden_size", "rms_norm_eps", "hidden_act",
            "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "attention_bias", "bias",
            "norm_before_residual", "norm_output", "draft_settings", "target_model", "torch_dtype", "dtype"]
    kwargs = {k: base[k] for k in keys if base.get(k) is not None}
    kwargs["fc_norm"] = bool(_first(base.get("fc_norm"), eagle.get("fc_norm"), base.get("use_aux_norm"), False))
    kwargs["norm_before_fc"] = bool(norm_before_fc or False)
    if ids is not None:
        kwargs["num_aux_hidden_states"] = len(ids)
    elif raw.get("num_aux_hidden_states"):
        kwargs["num_aux_hidden_states"] = raw["num_aux_hidden_states"]
    if kwargs.get("head_dim") is None and kwargs.get("hidden_size") and kwargs.get("num_attention_heads"):
        kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    return kwargs, (list(ids) if ids is not None else None), convention


# ---------------------------------------------------------------------------------------------- weights
def normalize_keys(state: dict[str, torch.Tensor], origins: dict[str, Path] | None = None,
                   where: Path | str = "the checkpoint") -> dict[str, torch.Tensor]:
    """Map ``model.`` prefixes and ``layers.0.`` onto our (= the EAGLE reference) names (`origins`, the file of each
    tensor, follows them)."""
    origins = {} if origins is None else origins
    out = {}
    for key, value in state.items():
        name = key.removeprefix("model.")
        if name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0.") :]
        elif name.startswith("layers."):
            raise DrafterLoadError(f"Tensor {key} in {origins.get(key, where)} belongs to a second decoder layer; "
                                   "multi-layer drafters are not supported.")
        if name.startswith(TRAINING_ONLY_PREFIXES):
            logger.info("Dropping training-only tensor %s", key)
            continue
        if name in out:
            raise DrafterLoadError(f"The checkpoint {where} holds {name} twice (as {key} and another spelling).")
        out[name] = value
        if key in origins:
            origins[name] = origins[key]
    return out


def validate_d2t(d2t: torch.Tensor, vocab_size: int, where: Path | str = "the checkpoint") -> None:
    target_ids = torch.arange(d2t.shape[0]) + d2t.long().cpu()
    if bool((target_ids < 0).any()) or bool((target_ids >= vocab_size).any()):
        raise DrafterLoadError(
            f"{where}: d2t maps draft ids outside the target vocabulary (0..{vocab_size - 1}); the checkpoint is corrupt or "
            "its config's vocab_size is wrong."
        )
    if d2t.shape[0] > 1 and not bool((target_ids[1:] > target_ids[:-1]).all()):
        raise DrafterLoadError(f"{where}: d2t does not map draft ids to strictly increasing target ids; the checkpoint "
                               "is corrupt.")


def load_drafter(
    cls,
    name_or_path,
    *,
    revision: str | None = None,
    aux_layer_ids: list[int] | None = None,
    aux_layer_convention: str | None = None,
    dtype: torch.dtype | None = None,
    config_overrides: dict[str, Any] | None = None,
    **hub_kwargs,
):
    folder = resolve_folder(name_or_path, revision=revision, **hub_kwargs)
    raw = read_config(folder)
    layout = detect_layout(raw, folder / "config.json")
    kwargs, raw_ids, convention = normalize_config(raw, layout, folder / "config.json")
    missing = [key for key in REQUIRED if key not in kwargs]
    if missing:
        raise DrafterLoadError(
            f"{folder / 'config.json'} does not set {', '.join(missing)}: a drafter's config.json names its sizes "
            "(the file may be incomplete: fetch the drafter again)."
        )
    if aux_layer_ids is not None:
        raw_ids = list(aux_layer_ids)
        convention = aux_layer_convention or "boundary"
        kwargs["num_aux_hidden_states"] = len(raw_ids)
    elif aux_layer_convention is not None:
        convention = aux_layer_convention
    if convention not in CONVENTIONS:
        raise DrafterLoadError(f"aux_layer_convention must be one of {CONVENTIONS}, got {convention!r} (drafter {folder}).")
    boundary_ids = None if raw_ids is None else [i + (1 if convention == "output" else 0) for i in raw_ids]
    logger.info(
        "Drafter %s: layout %s, aux layer ids %s (%s convention) -> target hidden_states indices %s",
        name_or_path, layout, raw_ids, convention, boundary_ids if boundary_ids is not None else "default [2, L//2, L-3]",
    )
    origins: dict[str, Path] = {}
    state = normalize_keys(load_weights(folder, origins), origins, folder)
    kwargs["own_embedding"] = "embed_tokens.weight" in state
    kwargs.update(config_overrides or {})
    ckpt_dtype = kwargs.pop("torch_dtype", None) or kwargs.pop("dtype", None)
    kwargs.pop("dtype", None)
    try:
        config = EagleConfig(aux_layer_ids=boundary_ids, **kwargs)
    except KeyError as err:  # transformers' RoPE validation: a scaled RoPE type without a field it needs
        raise _rope_error(folder / "config.json", kwargs, err) from err
    except (ValueError, NotImplementedError) as err:
        raise DrafterLoadError(f"Drafter {folder}: {err}") from err
    config.name_or_path = str(name_or_path)
    if config.draft_vocab_size == config.vocab_size:
        for name in ("d2t", "t2d"):
            if name in state and name == "d2t" and bool(state[name].any()):
                raise DrafterLoadError(f"{origins.get('d2t', folder)}: draft_vocab_size equals vocab_size but d2t is "
                                       "not the identity.")
            state.pop(name, None)
    elif "d2t" not in state:
        raise DrafterLoadError(
            f"The drafter's draft vocabulary ({config.draft_vocab_size}) is smaller than the target's "
            f"({config.vocab_size}) but the checkpoint has no d2t map ({folder})."
        )
    else:
        validate_d2t(state["d2t"], config.vocab_size, origins.get("d2t", folder))
        state.setdefault("t2d", _t2d_from_d2t(state["d2t"], config.vocab_size))
    try:
        model = cls(config)
    except KeyError as err:
        raise _rope_error(folder / "config.json", kwargs, err) from err
    model.eval()
    expected = set(model.state_dict().keys())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise DrafterLoadError(
            f"Drafter {folder} ({layout} layout) does not match its config: missing tensors "
            f"{sorted(missing)[:8]}, unexpected tensors {sorted(unexpected)[:8]}. Check that config.json belongs to "
            "these weights; if the checkpoint uses a variant eagle_hf does not know yet, please report it."
        )
    own = model.state_dict()
    for key, tensor in state.items():
        want, where = own[key], origins.get(key, folder)
        if tuple(tensor.shape) != tuple(want.shape):
            raise DrafterLoadError(
                f"Tensor {key} in {where} has shape {tuple(tensor.shape)} but the config implies {tuple(want.shape)}; "
                "config.json and the weights do not belong together."
            )
        if want.is_floating_point() and not tensor.is_floating_point():  # (never cast to a weight silently)
            raise DrafterLoadError(
                f"Tensor {key} in {where} is {tensor.dtype}, not a floating-point weight; the file is damaged or "
                "was written by a quantizer eagle_hf does not read. Fetch the drafter again."
            )
    model.load_state_dict({k: v for k, v in state.items()}, strict=True)
    target_dtype = dtype or _as_dtype(ckpt_dtype) or next(iter(v for v in state.values() if v.is_floating_point())).dtype
    model.to(target_dtype)
    model._eagle_layout = layout
    return model


def _rope_error(path: Path, kwargs: dict, err: KeyError) -> DrafterLoadError:
    """The error of RoPE settings that lack a field their type needs (transformers raises a KeyError)."""
    rope = kwargs.get("rope_parameters") or kwargs.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "?")) if isinstance(rope, dict) else "?"
    text = str(err.args[0]) if err.args else str(err)
    names = re.findall(r"'([A-Za-z_]+)'", text.rsplit(":", 1)[-1]) if ":" in text else []
    fields = ", ".join(f"`{n}`" for n in names) or text
    return DrafterLoadError(
        f"{path}: `rope_parameters` (or `rope_scaling`) of rope_type {kind!r} lacks {fields}, which that RoPE type "
        f"needs ({text}). Add it from the target model's config.json, or fetch the drafter again."
    )


def _t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.arange(d2t.shape[0]) + d2t.long()] = True
    return t2d


def _as_dtype(value) -> torch.dtype | None:
    """A floating-point dtype from a dtype or its name ("bfloat16", "torch.bfloat16"); None otherwise."""
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None
