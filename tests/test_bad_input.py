"""Bad drafters, bad checkpoints and bad generate() calls fail early with an error that names the problem.

Generation errors must be raised by our validation before transformers' generate() runs: the fixture
`no_generation` replaces the original generate with a function that fails the test.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from conftest import HIDDEN, VOCAB, tiny_drafter, tiny_target
from safetensors.torch import save_file
from test_loading import write_folder
from transformers import GenerationConfig, LlamaConfig

import eagle_hf
from eagle_hf import DrafterLoadError, EagleCompatibilityError, EagleDrafter
from eagle_hf.hf import hooks as hf_integration
from eagle_hf.hf.version import check_transformers_version

DRAFT_VOCAB = 48


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=6)


@pytest.fixture
def no_generation(monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("generation started before the bad input was rejected")

    monkeypatch.setattr(hf_integration, "_original_generate", started)


def prompt(n=5, batch=1):
    return torch.randint(1, VOCAB, (batch, n), generator=torch.Generator().manual_seed(0))


# ------------------------------------------------------------------------------------------ drafter vs target
def test_vocab_mismatch(target, no_generation):
    drafter = tiny_drafter(vocab=128)
    with pytest.raises(EagleCompatibilityError, match=r"Vocabulary mismatch.*128.*96"):
        target.generate(prompt(), assistant_model=drafter, max_new_tokens=5)


def test_target_hidden_size_mismatch(target, no_generation):
    drafter = tiny_drafter(target_hidden_size=32)
    with pytest.raises(EagleCompatibilityError, match=r"Hidden-size mismatch.*32.*64"):
        target.generate(prompt(), assistant_model=drafter, max_new_tokens=5)


def test_drafter_width_differs_without_own_embedding(target, no_generation):
    drafter = tiny_drafter(hidden_size=32, target_hidden_size=HIDDEN, intermediate_size=64)
    with pytest.raises(EagleCompatibilityError, match="ships no embedding"):
        target.generate(prompt(), assistant_model=drafter, max_new_tokens=5)


def test_aux_layer_ids_beyond_target_depth(no_generation):
    shallow = tiny_target("llama", layers=4)
    drafter = tiny_drafter(shallow, aux_layer_ids=[2, 9, 20])
    with pytest.raises(ValueError, match=r"boundary ids \[2, 9, 20\].*4 decoder layers"):
        shallow.generate(prompt(), assistant_model=drafter, max_new_tokens=5)


# ------------------------------------------------------------------------------------------ generate() calls
@pytest.fixture
def drafter(target):
    return tiny_drafter(target, draft_vocab=DRAFT_VOCAB)


@pytest.mark.parametrize("as_keyword", [False, True])
def test_padded_batch_without_attention_mask(target, drafter, no_generation, as_keyword):
    ids = prompt(batch=2)
    ids[0, :2] = 0  # left padding (pad_token_id 0) but no attention mask
    call = dict(input_ids=ids) if as_keyword else {}
    args = () if as_keyword else (ids,)
    with pytest.raises(EagleCompatibilityError, match="no attention_mask"):
        target.generate(*args, **call, assistant_model=drafter, max_new_tokens=5)


def test_batched_hidden_states_from_the_generation_config(target, drafter, no_generation):
    config = GenerationConfig(num_return_sequences=2, do_sample=True, max_new_tokens=5, pad_token_id=0,
                              output_hidden_states=True, return_dict_in_generate=True)
    with pytest.raises(EagleCompatibilityError, match="hidden states per step"):
        target.generate(prompt(), assistant_model=drafter, generation_config=config)


def test_beam_search(target, drafter, no_generation):
    with pytest.raises(EagleCompatibilityError, match="Beam search"):
        target.generate(prompt(), assistant_model=drafter, max_new_tokens=5, num_beams=2)


def test_empty_prompt(target, drafter, no_generation):
    with pytest.raises(EagleCompatibilityError, match="prompt is empty"):
        target.generate(torch.zeros(1, 0, dtype=torch.long), assistant_model=drafter, max_new_tokens=5)


def test_bad_draft_length(target, drafter, no_generation):
    with pytest.raises(EagleCompatibilityError, match="num_assistant_tokens must be in 1..32"):
        target.generate(prompt(), assistant_model=drafter, max_new_tokens=5, num_assistant_tokens=0)


def test_unsupported_transformers_version():
    with pytest.raises(EagleCompatibilityError, match=r"supports transformers >=5\.20\.0,<5\.25\.0; found 4\.50\.0"):
        check_transformers_version("4.50.0")
    with pytest.raises(EagleCompatibilityError, match="found 5.25.0"):
        check_transformers_version("5.25.0")
    check_transformers_version("5.23.0")
    check_transformers_version()  # the installed one


def test_the_cache_keyword_is_the_installed_transformers_one(target):
    """5.24 renamed `past_key_values` to `cache`: eagle_hf passes the name the installed forward declares."""
    import inspect

    from eagle_hf.hf.version import CACHE_KEY

    assert CACHE_KEY in inspect.signature(type(target).forward).parameters


def test_no_drafter_no_change(target):
    """Without an EAGLE drafter, generate() is transformers' own: same tokens, greedy, sampled and assisted."""
    installed = hf_integration.GenerationMixin.generate
    if getattr(installed, "_eagle_hf_test_shim", False):  # EAGLE_HF_TEST_DEVICE's shim wraps the hook (conftest.py)
        installed = installed.__wrapped__
    assert installed is hf_integration.generate  # the hook is installed
    ids = prompt(6).to(target.device)  # (transformers' own generate() is called bare: no test-device shim)
    greedy = dict(max_new_tokens=8, do_sample=False)
    assert torch.equal(target.generate(ids, **greedy).cpu(), hf_integration._original_generate(target, ids, **greedy).cpu())

    sampled = dict(max_new_tokens=8, do_sample=True, top_k=20)
    torch.manual_seed(3)
    a = target.generate(ids, **sampled)
    torch.manual_seed(3)
    b = hf_integration._original_generate(target, ids, **sampled)
    assert torch.equal(a.cpu(), b.cpu())

    helper = tiny_target("llama", layers=2, seed=5)  # classic (non-EAGLE) assisted decoding passes through too
    c = target.generate(ids, assistant_model=helper, **greedy)
    d = hf_integration._original_generate(target, ids, assistant_model=helper, **greedy)
    assert torch.equal(c.cpu(), d.cpu())
    assert torch.equal(c.cpu(), target.generate(ids, **greedy).cpu())


# ------------------------------------------------------------------------------------------ checkpoints
def eagle31_config(**extra) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "fc_norm": True, "norm_output": True,
        "hidden_size": HIDDEN, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 2048, "tie_word_embeddings": False, "torch_dtype": "float32",
        "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]},
    }
    cfg.update(extra)
    return cfg


def eagle31_tensors() -> dict[str, torch.Tensor]:
    drafter = tiny_drafter(draft_vocab=DRAFT_VOCAB)  # fc_norm + norm_output
    return {k: v.clone().contiguous() for k, v in drafter.state_dict().items()}


def write(folder, config=None, tensors=None, fmt="safetensors"):
    return write_folder(folder, config, tensors, fmt)


def test_valid_checkpoint_loads(tmp_path):
    """The baseline the corruptions below start from."""
    drafter = EagleDrafter.from_pretrained(write(tmp_path / "ok", eagle31_config(), eagle31_tensors()))
    assert drafter.config.is_eagle31 and drafter.config.aux_layer_ids == [2, 3, 4]


def test_missing_weight_file(tmp_path):
    folder = write(tmp_path / "d", eagle31_config())
    with pytest.raises(DrafterLoadError, match="No weights in .*model.safetensors, pytorch_model.bin"):
        EagleDrafter.from_pretrained(folder)


def test_missing_config(tmp_path):
    folder = write(tmp_path / "d", None, eagle31_tensors())
    with pytest.raises(DrafterLoadError, match="no config.json"):
        EagleDrafter.from_pretrained(folder)


def test_path_is_a_file(tmp_path):
    folder = write(tmp_path / "d", eagle31_config(), eagle31_tensors())
    with pytest.raises(DrafterLoadError, match="is a file; pass the folder"):
        EagleDrafter.from_pretrained(folder / "model.safetensors")


def test_missing_shard(tmp_path):
    folder = write(tmp_path / "d", eagle31_config())
    tensors = eagle31_tensors()
    save_file(tensors, str(folder / "model-00001-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in tensors}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(DrafterLoadError, match="lists shard model-00002-of-00002.safetensors, which is missing"):
        EagleDrafter.from_pretrained(folder)


def test_truncated_safetensors(tmp_path):
    folder = write(tmp_path / "d", eagle31_config(), eagle31_tensors())
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    message = r"(?s)Cannot read weight file .*model\.safetensors.*truncated or corrupt"
    with pytest.raises(DrafterLoadError, match=message):
        EagleDrafter.from_pretrained(folder)


def test_html_saved_as_safetensors(tmp_path):
    folder = write(tmp_path / "d", eagle31_config())
    (folder / "model.safetensors").write_text("<!DOCTYPE html><html><body>Rate limited</body></html>")
    with pytest.raises(DrafterLoadError, match="truncated or corrupt"):
        EagleDrafter.from_pretrained(folder)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_pytorch_bin(tmp_path, damage):
    folder = write(tmp_path / "d", eagle31_config(), eagle31_tensors(), fmt="bin")
    path = folder / "pytorch_model.bin"
    data = path.read_bytes()
    path.write_bytes(b"\x80\x02not a checkpoint" * 64 if damage == "garbage" else data[: len(data) // 2])
    message = r"(?s)Cannot read weight file .*pytorch_model\.bin.*truncated or corrupt"
    with pytest.raises(DrafterLoadError, match=message):
        EagleDrafter.from_pretrained(folder)


def test_config_invalid_json(tmp_path):
    text = json.dumps(eagle31_config())[:80]
    folder = write(tmp_path / "d", text, eagle31_tensors())
    with pytest.raises(DrafterLoadError, match=r"config\.json is not valid JSON"):
        EagleDrafter.from_pretrained(folder)


@pytest.mark.parametrize("content", ["[]", "null", "42", '"a drafter"'])
def test_config_that_is_not_an_object(tmp_path, content):
    folder = write(tmp_path / "d", content, eagle31_tensors())
    with pytest.raises(DrafterLoadError, match=r"config\.json holds .*, not a JSON object of config fields"):
        EagleDrafter.from_pretrained(folder)


@pytest.mark.parametrize("field,value", [
    ("hidden_act", "swishy"), ("rms_norm_eps", "x"), ("rms_norm_eps", -1.0), ("rms_norm_eps", math.nan),
    ("hidden_size", "64"), ("intermediate_size", 1.5), ("num_attention_heads", 0),
    ("draft_vocab_size", "48"), ("max_position_embeddings", "x"), ("rope_theta", "x"), ("rope_scaling", 3),
    ("rope_scaling.rope_type", "warp"), ("rope_scaling.factor", "8"), ("fc_norm", "false"), ("attention_bias", "yes"),
    ("architectures", "LlamaForCausalLMEagle3"), ("eagle_config", []),
    ("eagle_config.eagle_aux_hidden_state_layer_ids", "1,2,3"),
    ("eagle_config.eagle_aux_hidden_state_layer_ids", [1, "2", 3]), ("torch_dtype", "int8"), ("target_model", 3),
    ("draft_settings", "tree"), ("vocab_size", None),
])
def test_malformed_config_field_is_named(tmp_path, field, value):
    """Every field eagle_hf reads: a DrafterLoadError naming it and the file, not a failure deep in loading or
    inside generate() (a null field is not set: the required sizes are named as missing)."""
    cfg = eagle31_config(rope_scaling={"rope_type": "linear", "factor": 2.0})
    block, _, key = field.rpartition(".")
    (cfg[block] if block else cfg)[key] = value
    folder = write(tmp_path / "d", cfg, eagle31_tensors())
    name = re.escape(field if value is not None else "")
    with pytest.raises(DrafterLoadError, match=rf"{re.escape(str(folder / 'config.json'))}.*{name}"):
        EagleDrafter.from_pretrained(folder)


def test_a_bad_draft_setting_in_config_is_named_before_compute(tmp_path, target, one_thread):
    """A value of the drafter's `draft_settings` is checked where the settings are resolved, at the call, before
    any compute: an error naming the setting and where it came from (the drafter's config.json)."""
    from eagle_hf.speculation.settings import DraftSettingsError

    drafter = tiny_drafter(target)
    drafter.config.draft_settings = {"mode": "wide"}
    with pytest.raises(DraftSettingsError, match=r"config\.json `draft_settings`"):
        target.generate(prompt(), assistant_model=drafter, max_new_tokens=2, do_sample=False)


def test_drafter_declared_for_another_target_warns(tmp_path, target, caplog, one_thread):
    from eagle_hf.hf.call import warn_other_target

    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path / "d", target_model="org/Other-Model-1B")
    drafter = EagleDrafter.from_pretrained(tmp_path / "d")
    named = tiny_target("llama", layers=6)
    with caplog.at_level("WARNING", logger="eagle_hf"):
        for name in ["org/Other-Model-1B", "/data/copies/other-model-1b/", "/hf/models--org--Other-Model-1B/snapshots/0a1"]:
            named.name_or_path = name  # the declared target, wherever it lies
            warn_other_target(named, drafter)
        assert not caplog.records
        named.name_or_path = "org/Mine-7B"
        for _ in range(2):  # once per drafter and target
            named.generate(prompt(), assistant_model=drafter, max_new_tokens=2, do_sample=False)
    (said,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "declares the target org/Other-Model-1B" in said and "not org/Mine-7B" in said


def test_target_model_config_is_not_a_drafter(tmp_path):
    folder = tmp_path / "llama"
    config = LlamaConfig(num_hidden_layers=30, hidden_size=HIDDEN, num_attention_heads=4, vocab_size=VOCAB)
    config.architectures = ["LlamaForCausalLM"]  # as a target model's config.json has
    config.save_pretrained(folder)
    assert "draft_vocab_size" not in json.loads((folder / "config.json").read_text())
    with pytest.raises(DrafterLoadError, match=r"not an EAGLE-3 drafter \(architectures=\['LlamaForCausalLM'\]"):
        EagleDrafter.from_pretrained(folder)


def test_mla_drafter_is_named(tmp_path):
    folder = write(tmp_path / "d", {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"})
    with pytest.raises(DrafterLoadError, match="multi-head latent attention"):
        EagleDrafter.from_pretrained(folder)


@pytest.mark.parametrize("where", ["top_level", "eagle_config"])
def test_fc_norm_with_norm_before_fc(tmp_path, where):
    cfg = eagle31_config()
    if where == "top_level":
        cfg["norm_before_fc"] = True
    else:
        cfg["eagle_config"]["norm_before_fc"] = True
    folder = write(tmp_path / "d", cfg, eagle31_tensors())
    with pytest.raises(DrafterLoadError, match="`fc_norm`.*`norm_before_fc`.*mutually exclusive"):
        EagleDrafter.from_pretrained(folder)


def test_config_says_fc_norm_but_tensors_missing(tmp_path):
    """An EAGLE-3 checkpoint under an EAGLE-3.1 config must not load with identity fc_norm weights."""
    tensors = {k: v for k, v in eagle31_tensors().items() if not k.startswith("fc_norm.")}
    folder = write(tmp_path / "d", eagle31_config(), tensors)
    with pytest.raises(DrafterLoadError, match=r"missing tensors \['fc_norm\.0\.weight', 'fc_norm\.1\.weight'"):
        EagleDrafter.from_pretrained(folder)


def test_unexpected_tensors(tmp_path):
    """fc_norm tensors under a config without fc_norm are not dropped silently either."""
    folder = write(tmp_path / "d", eagle31_config(fc_norm=False, norm_output=False), eagle31_tensors())
    with pytest.raises(DrafterLoadError, match=r"unexpected tensors \['fc_norm\.0\.weight'"):
        EagleDrafter.from_pretrained(folder)


def test_wrong_shape(tmp_path):
    tensors = eagle31_tensors()
    tensors["midlayer.mlp.gate_proj.weight"] = torch.zeros(100, HIDDEN)
    folder = write(tmp_path / "d", eagle31_config(), tensors)
    with pytest.raises(DrafterLoadError, match=r"midlayer\.mlp\.gate_proj\.weight in \S*model\.safetensors has shape \(100, 64\).*\(128, 64\)"):
        EagleDrafter.from_pretrained(folder)


def test_fc_width_disagrees_with_aux_count(tmp_path):
    tensors = eagle31_tensors()
    folder = write(tmp_path / "d", eagle31_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2]}), tensors)
    with pytest.raises(DrafterLoadError, match="does not match its config"):
        EagleDrafter.from_pretrained(folder)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda d2t: d2t.__setitem__(-1, d2t[-1] + VOCAB), "d2t maps draft ids outside the target vocabulary"),
        (lambda d2t: d2t.__setitem__(0, -5), "d2t maps draft ids outside the target vocabulary"),
        (lambda d2t: d2t.__setitem__(1, d2t[0] - 1), "strictly increasing"),  # draft ids 0 and 1 -> same target id
    ],
)
def test_bad_d2t(tmp_path, corrupt, message):
    tensors = eagle31_tensors()
    d2t = tensors["d2t"]
    corrupt(d2t)
    folder = write(tmp_path / "d", eagle31_config(), tensors)
    with pytest.raises(DrafterLoadError, match=message):
        EagleDrafter.from_pretrained(folder)


def test_missing_d2t(tmp_path):
    tensors = {k: v for k, v in eagle31_tensors().items() if k not in ("d2t", "t2d")}
    folder = write(tmp_path / "d", eagle31_config(), tensors)
    with pytest.raises(DrafterLoadError, match=r"draft vocabulary \(48\) is smaller .*\(96\).*no d2t"):
        EagleDrafter.from_pretrained(folder)


def test_draft_vocab_larger_than_vocab(tmp_path):
    folder = write(tmp_path / "d", eagle31_config(draft_vocab_size=200), eagle31_tensors())
    with pytest.raises(DrafterLoadError, match=r"draft_vocab_size \(200\) is larger"):
        EagleDrafter.from_pretrained(folder)


def test_two_layer_drafter(tmp_path):
    tensors = eagle31_tensors()
    tensors["layers.1.mlp.gate_proj.weight"] = torch.zeros(128, HIDDEN)
    folder = write(tmp_path / "d", eagle31_config(), tensors)
    with pytest.raises(DrafterLoadError, match="second decoder layer"):
        EagleDrafter.from_pretrained(folder)
    folder = write(tmp_path / "e", eagle31_config(num_hidden_layers=2), eagle31_tensors())
    with pytest.raises(DrafterLoadError, match="2 decoder layers are not supported"):
        EagleDrafter.from_pretrained(folder)


def test_eagle1_style_config(tmp_path):
    cfg = eagle31_config(eagle_config={"use_aux_hidden_state": False})
    with pytest.raises(DrafterLoadError, match="use_aux_hidden_state: false"):
        EagleDrafter.from_pretrained(write(tmp_path / "d", cfg, eagle31_tensors()))


def test_bad_convention_override(tmp_path):
    folder = write(tmp_path / "d", eagle31_config(), eagle31_tensors())
    with pytest.raises(DrafterLoadError, match="aux_layer_convention must be one of"):
        EagleDrafter.from_pretrained(folder, aux_layer_convention="input")


def test_repo_not_in_offline_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    message = r"'org/absent-eagle3'.*neither a local folder nor in the Hugging Face cache"
    with pytest.raises(DrafterLoadError, match=message):
        EagleDrafter.from_pretrained("org/absent-eagle3", cache_dir=tmp_path / "hub")


def test_errors_are_value_errors():
    assert issubclass(DrafterLoadError, ValueError) and issubclass(EagleCompatibilityError, ValueError)
    assert eagle_hf.DrafterLoadError is DrafterLoadError
