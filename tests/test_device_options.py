"""Device options: `load_target`'s device / device_map / dtype / attn_implementation go straight into
`from_pretrained`; bad values fail with a clear error before anything loads; the CLI and the demo take
``--device``, ``--device-map``, ``--dtype`` and ``--attn-implementation``; `eagle-hf generate` runs end to end on
a saved tiny model."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_target
from test_training import tiny_tokenizer

from eagle_hf import EagleCompatibilityError
from eagle_hf.cli import build_parser, main
from eagle_hf.devices import check_load_options, input_device, load_options
from eagle_hf.drafter import default

LOADING_COMMANDS = ["generate", "bench", "diagnose", "train"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama saved as float16 with a chat tokenizer: a local 'Hub' folder."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_target("llama", layers=4).to(torch.float16).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture
def no_loading(monkeypatch):
    """Any model load fails the test: bad options must be refused before."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def loaded(*args, **kwargs):
        raise AssertionError("a model started loading before the bad option was refused")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", loaded)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", loaded)
    monkeypatch.setattr(default, "load_default_target", loaded)
    return loaded


@pytest.fixture
def no_cli_loading(no_loading, monkeypatch):
    monkeypatch.setattr(default, "load_target", no_loading)  # what the CLI calls (after its own check)


def _cli_args(command: str) -> list[str]:
    return [command, "--out", "x"] if command == "train" else [command]


# ------------------------------------------------------------------------------------------------ argparse
@pytest.mark.parametrize("command", LOADING_COMMANDS)
def test_every_loading_command_takes_the_device_options(command):
    parser = build_parser()
    args = parser.parse_args([*_cli_args(command), "--device", "cuda:1", "--attn-implementation", "sdpa"])
    assert (args.device, args.device_map, args.attn_implementation) == ("cuda:1", None, "sdpa")
    assert load_options(args) == {"dtype": "bfloat16", "attn_implementation": "sdpa", "device": "cuda:1"}
    args = parser.parse_args([*_cli_args(command), "--device-map", "auto", "--dtype", "float32"])
    assert load_options(args) == {"dtype": "float32", "attn_implementation": None, "device_map": "auto"}
    defaults = parser.parse_args(_cli_args(command))
    assert (defaults.device, defaults.device_map, defaults.dtype, defaults.attn_implementation) == \
        ("cpu", None, "bfloat16", None)


@pytest.mark.parametrize("command", ["generate", "bench", "diagnose"])
def test_dtype_auto_and_both_placements_refused(command, capsys):
    assert build_parser().parse_args([command, "--dtype", "auto"]).dtype == "auto"
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([command, "--device", "cuda", "--device-map", "auto"])
    assert e.value.code == 2
    assert "--device-map: not allowed with argument --device" in capsys.readouterr().err


def test_help_names_the_options():
    import argparse

    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    text = commands.choices["generate"].format_help()
    for option in ("--device", "--device-map", "--dtype", "--attn-implementation", "flash_attention_2", "auto"):
        assert option in text
    assert "(default: None)" not in text.split("--device DEVICE")[-1]  # the options, after the usage line


# ------------------------------------------------------------------------------------------------ bad values
BAD = [
    (dict(device="gpu"), r"Unknown device 'gpu'.*'cuda'"),
    (dict(device="cuda:7"), r"'cuda:7'.*(not available|does not exist)"),
    (dict(device="auto"), r"device_map='auto'"),
    (dict(device_map=[0, 1]), r"device_map=\[0, 1\] \(list\) is not a device map.*'auto'"),
    (dict(device_map="atuo"), r"device_map='atuo'.*strategy: 'auto'"),
    (dict(device_map={"model": "cuda:7"}), r"device_map\['model'\].*'cuda:7'"),
    (dict(device="cpu", device_map="auto"), r"Pass device= or device_map=, not both"),
    (dict(attn_implementation="flash"), r"Unknown attention implementation 'flash'.*sdpa"),
    (dict(dtype="float8"), r"Unknown dtype 'float8'.*'auto'"),
    (dict(dtype="int8"), r"Unknown dtype 'int8'"),
]


@pytest.mark.parametrize("name", ["default", "some-org/some-model"])
@pytest.mark.parametrize("kwargs,match", BAD, ids=[m for _, m in BAD])
def test_bad_values_fail_before_loading(name, kwargs, match, no_loading):
    with pytest.raises(EagleCompatibilityError, match=match):
        default.load_target(name, **kwargs)


@pytest.mark.parametrize("options,match", [(["--device", "gpu"], "Unknown device 'gpu'"),
                                           (["--device", "cuda:7"], "'cuda:7'"),
                                           (["--attn-implementation", "flash"], "attention implementation"),
                                           (["--device-map", "[0]"], "device_map='\\[0\\]'")])
@pytest.mark.parametrize("command", LOADING_COMMANDS)
def test_cli_refuses_bad_options_before_loading(command, options, match, no_cli_loading, capsys):
    import re

    assert main([*_cli_args(command), *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"eagle-hf {command}: ") and re.search(match, err), err


def test_the_default_target_refuses_what_it_cannot_take(no_loading):
    with pytest.raises(EagleCompatibilityError, match="not revision.*load a Hub id or folder"):
        default.load_target("default", revision="main")
    with pytest.raises(EagleCompatibilityError, match="one device.*not a dict device_map"):
        default.load_target("default", device_map={"model": "cpu"})


# ------------------------------------------------------------------------------------------------ loading
def test_a_folder_loads_with_the_options(folder):
    model, tok = default.load_target(folder, device="cpu", dtype="float32", attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    assert model.dtype == torch.float32 and input_device(model) == torch.device("cpu") and not model.training
    assert tok.chat_template
    model, _ = default.load_target(folder, dtype="auto")  # the checkpoint's own dtype
    assert model.dtype == torch.float16
    model, _ = default.load_target(folder, torch.bfloat16, "cpu")  # the old positional API
    assert model.dtype == torch.bfloat16
    model, _ = default.load_target(folder, device_map="auto", dtype=torch.float32, attn_implementation="sdpa")
    auto = "cuda" if torch.cuda.is_available() else "cpu"  # accelerate's choice: the GPU where there is one
    assert model.config._attn_implementation == "sdpa" and input_device(model).type == auto


def test_keywords_go_straight_into_from_pretrained(monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    calls = {}

    class Model:
        def eval(self):
            return self

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda name, **kw: calls.update(model=(name, kw)) or Model())
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda name, **kw: calls.update(tok=(name, kw)) or "tok")
    quant = object()
    default.load_target("org/model", device="cpu", dtype="float16", attn_implementation="sdpa",
                        quantization_config=quant, revision="v2", low_cpu_mem_usage=True)
    assert calls["model"] == ("org/model", dict(dtype=torch.float16, device_map="cpu", attn_implementation="sdpa",
                                                quantization_config=quant, revision="v2", low_cpu_mem_usage=True))
    assert calls["tok"] == ("org/model", {"revision": "v2"})
    default.load_target("org/model", device_map="auto", dtype="auto")
    assert calls["model"] == ("org/model", {"dtype": "auto", "device_map": "auto"})
    default.load_target("org/model")  # no device: transformers' default (the CPU), no device_map
    assert calls["model"] == ("org/model", {"dtype": torch.bfloat16})


def test_the_default_target_is_loaded_then_placed(monkeypatch):
    calls = []
    monkeypatch.setattr(default, "load_default_target", lambda **kw: calls.append(kw) or ("model", "tok"))
    default.load_target("default", device="cpu", dtype="auto", attn_implementation="eager")
    default.load_target("default", torch.float32)
    default.load_target("default", device_map="auto")  # this machine's accelerator, else the CPU
    accelerator = torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")
    from eagle_hf.devices import native_bf16

    def auto(device):  # "auto": bf16 where the device computes it natively, else float32
        return torch.bfloat16 if native_bf16(device) else torch.float32

    assert calls == [dict(dtype=auto("cpu"), device=torch.device("cpu"), attn_implementation="eager"),
                     dict(dtype=torch.float32, device=torch.device("cpu"), attn_implementation=None),
                     dict(dtype=torch.bfloat16, device=accelerator, attn_implementation=None)]  # (default dtype)


def test_load_default_target_sets_the_attention(monkeypatch):
    """The real load_default_target, with a tiny model in place of the GGUF."""
    monkeypatch.setattr(default, "default_target_gguf", lambda: ("/nowhere", "model.gguf"))
    monkeypatch.setattr(default, "load_gguf_target", lambda path, dtype, cache_dir: (tiny_target(), tiny_tokenizer()))
    model, _ = default.load_default_target(dtype=torch.float32, device="cpu", attn_implementation="eager")
    assert model.config._attn_implementation == "eager" and model.name_or_path == default.DEFAULT_TARGET_NAME


def test_check_load_options_accepts_what_transformers_takes():
    assert check_load_options(dtype="torch.float16", device="cpu:0") == {"dtype": torch.float16, "device_map": "cpu:0"}
    assert check_load_options(torch_dtype="float32")["dtype"] == torch.float32  # transformers' older name
    assert check_load_options(device_map={"model": "cpu", "lm_head": "disk"})["device_map"]["lm_head"] == "disk"
    assert check_load_options(attn_implementation="kernels-community/flash-attn")["attn_implementation"]
    assert check_load_options(attn_implementation="paged|eager")["attn_implementation"] == "paged|eager"


# ------------------------------------------------------------------------------------------------ end to end
def test_generate_runs_on_the_chosen_device(folder, capsys, one_thread):
    rc = main(["generate", "--target", folder, "--drafter", "random", "--device", "cpu", "--dtype", "float32",
               "--attn-implementation", "eager", "--prompt", "w1 w2 w3", "--max-new-tokens", "8"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "[drafter: RANDOM drafter" in out and "cycles" in out


def test_generate_puts_its_inputs_on_the_target_input_device(folder, monkeypatch, capsys, one_thread):
    """The inputs follow the embedding's device (under a device_map, `model.device` may be another)."""
    from eagle_hf import devices

    seen = []
    monkeypatch.setattr(devices, "input_device", lambda model: seen.append(model) or torch.device("cpu"))
    assert main(["generate", "--target", folder, "--drafter", "random", "--dtype", "float32",
                 "--max-new-tokens", "4"]) == 0
    assert seen and all(hasattr(m, "get_input_embeddings") for m in seen)


def test_bench_records_how_a_spread_target_lies():
    from types import SimpleNamespace

    from eagle_hf.tools.bench import _placement

    spread = SimpleNamespace(hf_device_map={"model.embed_tokens": 0, "model.layers.0": 0, "lm_head": "cpu"})
    assert _placement(spread) == {"0": 2, "cpu": 1}
    assert _placement(SimpleNamespace(hf_device_map={"": "cpu"})) is None and _placement(object()) is None


# ------------------------------------------------------------------------------------------------ demo
@pytest.fixture
def demo_app(monkeypatch):
    import logging
    from pathlib import Path

    pytest.importorskip("gradio")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "demo"))
    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    import app  # demo/app.py

    level = logging.getLogger("eagle_hf").level
    yield app
    logging.getLogger("eagle_hf").setLevel(level)  # app.main turns eagle_hf's log up


def test_demo_takes_the_device_options(demo_app, folder, monkeypatch, capsys):
    class Loaded(Exception):
        pass

    seen = {}

    def load_everything(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)
        raise Loaded

    real = demo_app.load_everything
    monkeypatch.setattr(demo_app, "load_everything", load_everything)
    with pytest.raises(Loaded):
        demo_app.main(["--target", folder, "--device", "cpu", "--dtype", "auto", "--attn-implementation", "eager"])
    assert seen["kwargs"] == {"dtype": "auto", "attn_implementation": "eager", "device": "cpu"}
    seen.clear()
    with pytest.raises(SystemExit):
        demo_app.main(["--device", "gpu"])
    assert not seen and "Unknown device 'gpu'" in capsys.readouterr().err
    target, _, drafters = real(folder, "random", None, dtype="float32", device="cpu", attn_implementation="eager")
    assert target.config._attn_implementation == "eager" and target.dtype == torch.float32 and len(drafters) == 1
