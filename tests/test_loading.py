"""Loading every published drafter layout (eagle_spec.md §2-4) and saving the one vLLM / SGLang read.

Each test writes a small synthetic checkpoint with the real key names and config fields, loads it with
`EagleDrafter.from_pretrained`, and checks that it computes exactly what the same weights saved in our own layout
compute: step-0 logits and two `step` passes (hidden fed back, normed, logits), with the target's embedding bound.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, tiny_drafter, tiny_target
from safetensors.torch import load_file, save_file

from eagle_hf import DrafterLoadError, EagleDrafter

DRAFT_VOCAB = 48
LAYERS = 6  # tiny target depth: boundary ids 0..5


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=LAYERS)


# ------------------------------------------------------------------------------------------ helpers
def reference(target, dtype=torch.float32, **overrides) -> EagleDrafter:
    """A random drafter for `target` whose weights are exactly representable in `dtype` (kept in float32)."""
    drafter = tiny_drafter(target, draft_vocab=DRAFT_VOCAB, **overrides)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(p.to(dtype).float())
    return drafter


def eagle_tensors(drafter, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """The drafter's tensors under the EAGLE reference names, floats cast to `dtype`, d2t int64, t2d bool."""
    out = {}
    for name, tensor in drafter.state_dict().items():
        t = tensor.detach().clone().contiguous()
        out[name] = t.to(dtype) if t.is_floating_point() else t
    assert out["d2t"].dtype == torch.int64 and out["t2d"].dtype == torch.bool
    return out


def llama_fields(drafter) -> dict:
    c = drafter.config
    return {
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "max_position_embeddings": 2048,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": False,
        "vocab_size": c.vocab_size,
    }


def eagle_reference_config(drafter) -> dict:
    """Like yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's config.json: no rope_theta, no aux ids, fp16."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "initializer_range": 0.02,
        "model_type": "llama",
        "torch_dtype": "float16",
        "transformers_version": "4.28.1",
        "use_cache": True,
        **llama_fields(drafter),
        "draft_vocab_size": DRAFT_VOCAB,
    }


def specforge_config(drafter, ids, ids_where="eagle_config", dtype="bfloat16") -> dict:
    """Like SpecForge's configs/qwen3-30B-A3B-eagle3.1.json plus explicit aux ids in the output convention."""
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "fc_norm": True,
        "norm_output": True,
        **llama_fields(drafter),
        "head_dim": drafter.config.head_dim,
        "rope_theta": drafter.config.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": dtype,
        "draft_vocab_size": DRAFT_VOCAB,
    }
    if ids_where == "eagle_config":
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    else:
        cfg["eagle_aux_hidden_state_layer_ids"] = ids
    return cfg


def speculators_config(drafter, ids, norm_before_residual=False) -> dict:
    layer = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **llama_fields(drafter),
        "head_dim": drafter.config.head_dim,
        "rope_theta": drafter.config.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
    }
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": ids,
        "norm_before_residual": norm_before_residual,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "tiny/llama"},
        },
        "torch_dtype": "bfloat16",
    }


def write_folder(folder: Path, config: dict | str | None, tensors: dict | None = None, fmt: str = "safetensors") -> Path:
    """A checkpoint folder: config.json (a dict, or raw text for corrupt-file tests) and one weight file."""
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config, indent=2))
    if tensors is not None:
        if fmt == "safetensors":
            save_file(tensors, str(folder / "model.safetensors"))
        else:
            torch.save(tensors, str(folder / "pytorch_model.bin"))
    return folder


def ours(drafter, tmp_path) -> EagleDrafter:
    """The same weights saved with our save_pretrained and loaded back."""
    drafter.save_pretrained(tmp_path / "ours")
    return EagleDrafter.from_pretrained(tmp_path / "ours")


@torch.no_grad()
def probe(drafter, target) -> dict[str, torch.Tensor]:
    """Everything a drafter computes on fixed random inputs, in float32."""
    drafter = drafter.float().eval().to(target.device)
    if drafter.embed_tokens is None:
        drafter.bind_target_embedding(target.get_input_embeddings())
    cfg = drafter.config
    gen = torch.Generator().manual_seed(123)
    aux = torch.randn(1, 7, cfg.num_aux_hidden_states * cfg.target_hidden_size, generator=gen).to(target.device)
    ids = torch.randint(0, VOCAB, (1, 7), generator=gen).to(target.device)
    pos = torch.arange(7, device=target.device)[None]
    logits = drafter(aux, ids)
    s0 = drafter.step(drafter.fuse(aux), ids, pos)
    s1 = drafter.step(s0.hidden[:, -1:], ids[:, -1:], pos[:, -1:] + 1, past=s0.kv)
    return {
        "logits": logits,
        "tokens": drafter.draft_to_target(logits.argmax(-1)),
        "hidden0": s0.hidden,
        "normed0": s0.normed,
        "logits1": s1.logits,
        "hidden1": s1.hidden,
    }


def assert_same(loaded, expected, target):
    """Identical tensors, identical config semantics, identical outputs."""
    a, b = loaded.state_dict(), expected.state_dict()
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype or a[k].is_floating_point(), k
        assert torch.equal(a[k].to(b[k].device, b[k].dtype), b[k]), k
    for field in (
        "hidden_size", "target_hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
        "draft_vocab_size", "num_aux_hidden_states", "rms_norm_eps", "rope_theta", "fc_norm", "norm_output",
        "norm_before_fc", "norm_before_residual", "own_embedding",
    ):
        assert getattr(loaded.config, field) == getattr(expected.config, field), field
    pa, pb = probe(loaded, target), probe(expected, target)
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


# ------------------------------------------------------------------------------------------ layouts
def test_eagle_reference_bin(target, tmp_path):
    """yuhuili/* layout: pytorch_model.bin (fp16), midlayer.*, no embed_tokens, config without rope_theta."""
    ref = reference(target, dtype=torch.float16, eagle31=False)
    tensors = eagle_tensors(ref, torch.float16)
    assert "embed_tokens.weight" not in tensors and not any(k.startswith("fc_norm") for k in tensors)
    folder = write_folder(tmp_path / "eagle", eagle_reference_config(ref), tensors, fmt="bin")

    drafter = EagleDrafter.from_pretrained(folder)
    assert drafter._eagle_layout == "eagle"
    assert drafter.config.rope_theta == 10000
    assert drafter.config.aux_layer_ids is None  # EAGLE-3 default triple, resolved against the target
    assert not drafter.config.own_embedding and drafter.embed_tokens is None
    assert not drafter.config.fc_norm and not drafter.config.norm_output
    assert drafter.fc.weight.dtype == torch.float16  # keeps the checkpoint dtype until generate() moves it
    assert drafter.rotary.inv_freq.dtype == torch.float32  # RoPE angles stay float32 (as EAGLE / vLLM)
    assert drafter.d2t.dtype == torch.int64 and drafter.t2d.dtype == torch.bool
    assert_same(drafter, ours(ref, tmp_path), target)
    assert_same(drafter, ref, target)


def test_eagle_reference_dtype_override(target, tmp_path):
    ref = reference(target, dtype=torch.float16, eagle31=False)
    folder = write_folder(tmp_path / "eagle", eagle_reference_config(ref), eagle_tensors(ref, torch.float16), fmt="bin")
    drafter = EagleDrafter.from_pretrained(folder, dtype=torch.float32)
    assert drafter.fc.weight.dtype == torch.float32 and drafter.d2t.dtype == torch.int64
    assert_same(drafter, ref, target)


@pytest.mark.parametrize("ids_where", ["eagle_config", "top_level"])
def test_specforge_eagle31_safetensors(target, tmp_path, ids_where):
    """SpecForge / TorchSpec export: model.safetensors, fc_norm + norm_output, aux ids [1, k, m] (output convention)."""
    k, m = 2, 3
    ref = reference(target, dtype=torch.bfloat16, rope_theta=1e6, aux_layer_ids=[2, k + 1, m + 1])
    tensors = eagle_tensors(ref, torch.bfloat16)
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(tensors)
    folder = write_folder(tmp_path / "sf", specforge_config(ref, [1, k, m], ids_where), tensors)

    drafter = EagleDrafter.from_pretrained(folder)
    assert drafter.config.aux_layer_ids == [2, k + 1, m + 1]
    assert drafter.config.fc_norm and drafter.config.norm_output and drafter.config.is_eagle31
    assert drafter.config.rope_theta == 1e6
    assert drafter.fc.weight.dtype == torch.bfloat16
    expected = ours(ref, tmp_path)
    assert expected.config.aux_layer_ids == [2, k + 1, m + 1]
    assert_same(drafter, expected, target)
    # norm_output on: the fed-back hidden state is the post-norm one
    out = probe(drafter, target)
    assert torch.equal(out["hidden0"], out["normed0"])


def test_specforge_ids_not_starting_at_one_are_boundary(target, tmp_path):
    ref = reference(target, aux_layer_ids=[2, 3, 4])
    folder = write_folder(tmp_path / "sf", specforge_config(ref, [2, 3, 4], dtype="float32"), eagle_tensors(ref))
    assert EagleDrafter.from_pretrained(folder).config.aux_layer_ids == [2, 3, 4]


def test_export_without_t2d(target, tmp_path):
    """t2d is training-only (vLLM drops it); it is rebuilt from d2t."""
    ref = reference(target)
    tensors = eagle_tensors(ref)
    del tensors["t2d"]
    folder = write_folder(tmp_path / "sf", specforge_config(ref, [1, 2, 3], dtype="float32"), tensors)
    assert_same(EagleDrafter.from_pretrained(folder), ours(ref, tmp_path), target)


@pytest.mark.parametrize(
    "ids, norm_before_residual", [([2, 3, 4], False), ([1, 2, 3, 4], False), ([2, 3, 4], True)]
)
def test_speculators(target, tmp_path, ids, norm_before_residual):
    """vllm-project/speculators: Eagle3DraftModel, transformer_layer_config, layers.0.*, own embed_tokens."""
    ref = reference(
        target, dtype=torch.bfloat16, eagle31=False, own_embedding=True, aux_layer_ids=ids,
        norm_before_residual=norm_before_residual,
    )
    tensors = {}
    for name, t in eagle_tensors(ref, torch.bfloat16).items():
        tensors["layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name] = t
    assert "embed_tokens.weight" in tensors and not any(k.startswith("midlayer.") for k in tensors)
    tensors["verifier_lm_head.weight"] = torch.zeros(VOCAB, 64, dtype=torch.bfloat16)  # training only
    tensors["verifier_norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    folder = write_folder(tmp_path / "spec", speculators_config(ref, ids, norm_before_residual), tensors)

    drafter = EagleDrafter.from_pretrained(folder)
    assert drafter._eagle_layout == "speculators"
    assert drafter.config.own_embedding and drafter.embed_tokens is not None
    assert drafter.config.aux_layer_ids == ids  # boundary convention, even when the first id is 1
    assert drafter.config.num_aux_hidden_states == len(ids)
    assert drafter.config.norm_before_residual == norm_before_residual
    assert_same(drafter, ours(ref, tmp_path), target)


def test_model_prefixed_keys(target, tmp_path):
    """vLLM-internal / NeMo spelling: every tensor but lm_head under `model.`."""
    ref = reference(target, aux_layer_ids=[2, 3, 4])
    tensors = {(k if k == "lm_head.weight" else "model." + k): v for k, v in eagle_tensors(ref).items()}
    assert "model.fc_norm.0.weight" in tensors and "model.midlayer.self_attn.q_proj.weight" in tensors
    folder = write_folder(tmp_path / "prefixed", specforge_config(ref, [1, 2, 3], dtype="float32"), tensors)
    assert_same(EagleDrafter.from_pretrained(folder), ours(ref, tmp_path), target)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_sharded(target, tmp_path, fmt):
    ref = reference(target, aux_layer_ids=[2, 3, 4])
    tensors = eagle_tensors(ref)
    names = sorted(tensors)
    folder = write_folder(tmp_path / "sharded", specforge_config(ref, [1, 2, 3], dtype="float32"))
    prefix, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :]), start=1):
        shard = f"{prefix}-{i:05d}-of-00002.{ext}"
        chunk = {n: tensors[n] for n in part}
        save_file(chunk, str(folder / shard)) if fmt == "safetensors" else torch.save(chunk, str(folder / shard))
        weight_map.update({n: shard for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / f"{prefix}.{ext}.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    assert_same(EagleDrafter.from_pretrained(folder), ours(ref, tmp_path), target)


# ------------------------------------------------------------------------------------------ Hub cache
def _hub_cache_snapshot(cache: Path, repo: str, config: dict, tensors: dict, seed: int) -> str:
    """One snapshot laid out as huggingface_hub does: blobs/<hash>, snapshots/<sha>/<file> -> ../../blobs/<hash>."""
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    sha = hashlib.sha1(f"{repo}-{seed}".encode()).hexdigest()
    snap = repo_dir / "snapshots" / sha
    snap.mkdir(parents=True)
    (repo_dir / "blobs").mkdir(exist_ok=True)
    staging = cache / f"staging-{seed}"
    write_folder(staging, config, tensors)
    for name in ("config.json", "model.safetensors"):
        data = (staging / name).read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / name)
    return sha


@pytest.fixture
def offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_hub_cache_offline(target, tmp_path, offline):
    cache = tmp_path / "hub"
    repo = "org/tiny-eagle3"
    ref_main = reference(target, aux_layer_ids=[2, 3, 4], seed=1)
    ref_old = reference(target, aux_layer_ids=[2, 3, 4], seed=7)
    sha_main = _hub_cache_snapshot(cache, repo, specforge_config(ref_main, [1, 2, 3], dtype="float32"),
                                   eagle_tensors(ref_main), seed=1)
    sha_old = _hub_cache_snapshot(cache, repo, specforge_config(ref_old, [1, 2, 3], dtype="float32"),
                                  eagle_tensors(ref_old), seed=7)
    refs = cache / "models--org--tiny-eagle3" / "refs"
    refs.mkdir()
    (refs / "main").write_text(sha_main)

    drafter = EagleDrafter.from_pretrained(repo, cache_dir=cache)
    assert drafter.config.aux_layer_ids == [2, 3, 4]
    assert drafter.config.name_or_path == repo
    assert_same(drafter, ours(ref_main, tmp_path / "a"), target)

    assert_same(EagleDrafter.from_pretrained(repo, cache_dir=cache, revision=sha_main), drafter, target)
    old = EagleDrafter.from_pretrained(repo, cache_dir=cache, revision=sha_old)
    assert_same(old, ours(ref_old, tmp_path / "b"), target)
    assert not torch.equal(old.fc.weight, drafter.fc.weight)


@pytest.mark.parametrize("error", ["OfflineModeIsEnabled", "LocalEntryNotFoundError"])
def test_hub_cache_offline_when_the_hub_client_asks_the_hub(target, tmp_path, offline, monkeypatch, error):
    """huggingface_hub 1.x raises offline for a pinned revision whose snapshot is cached (2.x reads the cache, so CI
    never sees it): the cached snapshot is loaded either way. Simulated here so any hub version runs this path."""
    import huggingface_hub
    import huggingface_hub.errors

    cache = tmp_path / "hub"
    repo = "org/tiny-eagle3"
    ref = reference(target, aux_layer_ids=[2, 3, 4], seed=3)
    sha = _hub_cache_snapshot(cache, repo, specforge_config(ref, [1, 2, 3], dtype="float32"), eagle_tensors(ref), 3)
    raised = getattr(huggingface_hub.errors, error)

    def asks_the_hub(*args, **kwargs):
        raise raised("Cannot reach the Hub: offline mode is enabled.")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", asks_the_hub)
    drafter = EagleDrafter.from_pretrained(repo, cache_dir=cache, revision=sha)
    assert_same(drafter, ours(ref, tmp_path / "a"), target)
    with pytest.raises(DrafterLoadError, match="neither a local folder nor in the Hugging Face cache"):
        EagleDrafter.from_pretrained(repo, cache_dir=cache, revision="0" * 40)


# ------------------------------------------------------------------------------------------ overrides
@pytest.fixture
def specforge_folder(target, tmp_path):
    ref = reference(target, aux_layer_ids=[2, 3, 4])
    return write_folder(tmp_path / "sf", specforge_config(ref, [1, 2, 3], dtype="float32"), eagle_tensors(ref))


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({}, [2, 3, 4]),
        ({"aux_layer_convention": "boundary"}, [1, 2, 3]),
        ({"aux_layer_ids": [0, 2, 4]}, [0, 2, 4]),
        ({"aux_layer_ids": [1, 2, 4]}, [1, 2, 4]),  # explicit ids default to boundary, even from 1
        ({"aux_layer_ids": [0, 2, 4], "aux_layer_convention": "output"}, [1, 3, 5]),
    ],
)
def test_aux_overrides(specforge_folder, kwargs, expected):
    assert EagleDrafter.from_pretrained(specforge_folder, **kwargs).config.aux_layer_ids == expected


def test_norm_output_override(specforge_folder, target):
    default = EagleDrafter.from_pretrained(specforge_folder)
    legacy = EagleDrafter.from_pretrained(specforge_folder, norm_output=False)
    assert default.config.norm_output and not legacy.config.norm_output
    assert legacy.config.fc_norm  # only the flag asked for changes
    a, b = probe(default, target), probe(legacy, target)
    assert torch.equal(a["logits"], b["logits"])  # step 0 does not depend on the feedback
    assert torch.equal(a["hidden0"], a["normed0"])
    assert not torch.allclose(b["hidden0"], b["normed0"])  # pre-norm state fed back
    assert not torch.allclose(a["logits1"], b["logits1"])


# ------------------------------------------------------------------------------------------ round trip
def test_save_pretrained_layout(target, tmp_path):
    """What vLLM / SGLang read: flat Llama config and EAGLE tensor names."""
    ref = reference(target, aux_layer_ids=[2, 3, 4])
    ref.save_pretrained(tmp_path / "out")
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["config.json", "model.safetensors"]
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama"
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True
    assert cfg["rope_theta"] == 10000.0
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["vocab_size"] == VOCAB
    assert cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    assert cfg["eagle_hf"]["aux_layer_convention"] == "boundary"

    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    layer = [
        "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
        "midlayer.mlp.down_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
        "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.self_attn.q_proj.weight",
        "midlayer.self_attn.v_proj.weight",
    ]
    expected = {"fc.weight", "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight", "norm.weight",
                "lm_head.weight", "d2t", "t2d", *layer}
    assert set(tensors) == expected
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["fc.weight"].shape == (64, 3 * 64) and tensors["lm_head.weight"].shape == (DRAFT_VOCAB, 64)

    back = EagleDrafter.from_pretrained(tmp_path / "out")
    assert back.config.aux_layer_ids == [2, 3, 4]
    assert_same(back, ref, target)


def test_round_trip_of_loaded_specforge_keeps_boundary_ids(specforge_folder, target, tmp_path):
    """Ids converted from the output convention are saved as boundary ids and not shifted a second time."""
    loaded = EagleDrafter.from_pretrained(specforge_folder)
    loaded.save_pretrained(tmp_path / "again")
    again = EagleDrafter.from_pretrained(tmp_path / "again")
    assert again.config.aux_layer_ids == [2, 3, 4]
    assert_same(again, loaded, target)


def test_round_trip_eagle3_no_draft_vocab(target, tmp_path):
    """Full-vocabulary drafter (no d2t / t2d) with its own embedding."""
    ref = tiny_drafter(target, eagle31=False, own_embedding=True)
    assert ref.d2t is None
    ref.save_pretrained(tmp_path / "out")
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "d2t" not in tensors and "embed_tokens.weight" in tensors
    assert not any(k.startswith("fc_norm") for k in tensors)
    assert_same(EagleDrafter.from_pretrained(tmp_path / "out"), ref, target)


# ------------------------------------------------------------------------------------------ GGUF -> bf16 copy
def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet (the 256 characters a byte-level BPE vocabulary starts from)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A one-layer Llama GGUF shaped like the embedded SmolLM2 file: Q8_0 embedding, Q4_1 matrices, F32 norms,
    a byte-level BPE tokenizer with SmolLM2's special tokens and chat template; about 100 kB."""
    gguf = pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _byte_chars() + [m.replace(" ", "") for m in merges]
    tokens += [f"<extra_{i}>" for i in range(-len(tokens) % 32)]  # a round vocabulary size
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    hidden, ffn, heads, kv_heads = 64, 128, 2, 1
    head_dim = hidden // heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return (torch.randn(*shape, generator=g) * scale).numpy()

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(head_dim)
    w.add_file_type(3)  # MOSTLY_Q4_1, as the embedded file
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    w.add_tensor("token_embd.weight", quantize(rand(len(tokens), hidden), Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("output_norm.weight", 1 + rand(hidden, scale=0.1))
    for name, shape in [("attn_q", (hidden, hidden)), ("attn_k", (kv_heads * head_dim, hidden)),
                        ("attn_v", (kv_heads * head_dim, hidden)), ("attn_output", (hidden, hidden)),
                        ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))]:
        w.add_tensor(f"blk.0.{name}.weight", quantize(rand(*shape), Q.Q4_1), raw_dtype=Q.Q4_1)
    w.add_tensor("blk.0.attn_norm.weight", 1 + rand(hidden, scale=0.1))
    w.add_tensor("blk.0.ffn_norm.weight", 1 + rand(hidden, scale=0.1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bf16_copy_of_a_gguf_equals_the_gguf_in_bf16(tmp_path, caplog):
    """The converted copy holds exactly the weights `from_pretrained(gguf_file=..., dtype=bfloat16)` gives, and the
    same tokenizer; it is written once (atomically, no temporary folder left), read afterwards, and keyed by the
    GGUF file: a changed file gets a new copy and the stale one is removed. A float32 copy holds the float32
    de-quantization exactly, beside the bf16 one."""
    import logging

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_hf.drafter.default import converted_copy_dir, load_gguf_target

    gguf_path = write_tiny_gguf(tmp_path / "tiny.Q4_1.gguf")
    cache = tmp_path / "cache"
    direct = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf_path.name, dtype=torch.bfloat16)
    direct_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf_path.name)

    with caplog.at_level(logging.INFO, logger="eagle_hf.drafter.default"):
        first, _ = load_gguf_target(gguf_path, torch.bfloat16, cache_dir=cache)
        second, tok = load_gguf_target(gguf_path, torch.bfloat16, cache_dir=cache)
    assert "Converting tiny.Q4_1.gguf once" in caplog.text and "Loading the torch.bfloat16 copy" in caplog.text
    copy = converted_copy_dir(gguf_path, torch.bfloat16, cache)
    assert sorted(p.name for p in cache.iterdir()) == [copy.name]  # no temporary folder left behind
    assert (copy / "model.safetensors").stat().st_mode & 0o777 == 0o644 and copy.stat().st_mode & 0o777 == 0o755
    assert "quantization_config" not in json.loads((copy / "config.json").read_text())

    expected = direct.state_dict()
    for model in (first, second):
        got = model.state_dict()
        assert got.keys() == expected.keys()
        for k, v in expected.items():
            assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v), k
    text = tok.apply_chat_template([{"role": "user", "content": "the hint"}], add_generation_prompt=True, tokenize=False)
    assert text == direct_tok.apply_chat_template([{"role": "user", "content": "the hint"}], add_generation_prompt=True, tokenize=False)
    assert tok(text)["input_ids"] == direct_tok(text)["input_ids"]
    assert tok.all_special_ids == direct_tok.all_special_ids and tok.eos_token == direct_tok.eos_token
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(second(ids).logits, direct(ids).logits)

    os.utime(gguf_path, ns=(1, 1))  # a new wheel: another file version
    new_copy = converted_copy_dir(gguf_path, torch.bfloat16, cache)
    assert new_copy != copy
    load_gguf_target(gguf_path, torch.bfloat16, cache_dir=cache)
    assert sorted(p.name for p in cache.iterdir()) == [new_copy.name]  # the stale copy is gone

    direct32 = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf_path.name, dtype=torch.float32)
    for _ in range(2):  # (converted, then read from the copy)
        fp32, _ = load_gguf_target(gguf_path, torch.float32, cache_dir=cache)
        got = fp32.state_dict()
        assert all(got[k].dtype == torch.float32 and torch.equal(got[k], v) for k, v in direct32.state_dict().items())
    assert sorted(p.name for p in cache.iterdir()) == sorted([new_copy.name,
                                                              converted_copy_dir(gguf_path, torch.float32, cache).name])
    off, _ = load_gguf_target(gguf_path, torch.bfloat16, cache_dir="off")
    assert off.dtype == torch.bfloat16
