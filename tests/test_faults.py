"""Faults a user meets: a full disk under every write, files that are not regular files, a cut training log, an
unreadable best.json, and a drafter shared by calls on targets of two dtypes at once."""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import threading

import pytest
import torch
from conftest import tiny_drafter, tiny_target
from full_disk import FullDisk

from eagle_hf import EagleDrafter
from eagle_hf.drafter.checkpoint import DrafterLoadError
from eagle_hf.files import WriteError


@pytest.fixture(params=["simulated", "tmpfs"])
def disk(request, tmp_path, monkeypatch):
    """A folder on a full disk: writers patched to fail as on a full disk, and a real full tmpfs where the test
    may mount one."""
    full = FullDisk(tmp_path / "disk", monkeypatch, real=request.param == "tmpfs")
    if request.param == "tmpfs" and not full.real:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield full
    full.close()


@pytest.fixture
def some_full_disk(tmp_path, monkeypatch):
    """One full disk: a real tmpfs where the test may mount one, else simulated."""
    full = FullDisk(tmp_path / "disk", monkeypatch)
    yield full
    full.close()


def leftovers(folder) -> list[str]:
    """Temporary files or folders a failed write left behind."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if ".tmp" in p.name or p.name.endswith(".old"))


# ------------------------------------------------------------------------------ the default target's converted copy
def test_a_full_disk_under_the_converted_copy_warns_once_and_loads_from_memory(disk, tmp_path, caplog):
    from test_loading import write_tiny_gguf

    from eagle_hf.drafter.default import converted_copy_dir, load_gguf_target

    gguf_path = write_tiny_gguf(tmp_path / "tiny.Q4_1.gguf")
    load_gguf_target(gguf_path, torch.bfloat16, cache_dir=disk.folder)  # an earlier wheel's copy, whole
    previous = converted_copy_dir(gguf_path, torch.bfloat16, disk.folder)
    os.utime(gguf_path, ns=(1, 1))  # a new wheel: a new copy to write
    disk.fill()
    with caplog.at_level(logging.WARNING, logger="eagle_hf.drafter.default"):
        model, tok = load_gguf_target(gguf_path, torch.bfloat16, cache_dir=disk.folder)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    new = converted_copy_dir(gguf_path, torch.bfloat16, disk.folder)
    assert str(new) in warnings[0] and "no space left" in warnings[0] and "needed" in warnings[0], warnings[0]
    assert not new.exists() and (previous / "model.safetensors").is_file()  # the previous copy is kept
    assert [p.name for p in disk.folder.iterdir() if p.name != "filler"] == [previous.name]  # no temporary folder
    ids = torch.tensor([tok("the hint")["input_ids"]])
    with torch.no_grad():
        assert model.dtype == torch.bfloat16 and torch.isfinite(model(ids).logits.float()).all()


# ------------------------------------------------------------------------------ training
def test_training_on_a_full_disk_is_one_line_and_keeps_the_previous_state(some_full_disk, tmp_path, monkeypatch,
                                                                           capsys):
    from test_training import _run, tiny_tokenizer, write_prompts

    from eagle_hf import cli
    from eagle_hf.drafter import default
    from eagle_hf.training.trainer import load_state

    disk = some_full_disk
    target, tok = tiny_target("llama"), tiny_tokenizer()
    out = disk.folder / "out"
    _run(tmp_path, target, tok, max_steps=10)  # (its data folder: tmp_path / "data", off the full disk)
    shutil.move(tmp_path / "out", out)
    log_before = (out / "training_log.jsonl").read_text()
    disk.fill()
    monkeypatch.setattr(default, "load_target", lambda *a, **k: (target, tok))
    argv = ["train", "--target", "default", "--prompts", str(write_prompts(tmp_path / "prompts.jsonl")),
            "--data-dir", str(tmp_path / "data"), "--out", str(out), "--draft-vocab-size", "48", "--batch-size", "8",
            "--max-new-tokens", "12", "--max-prompt-tokens", "64", "--ttt-steps", "3", "--lr", "3e-3",
            "--max-steps", "20", "--tokens-per-batch", "256", "--eval-every", "20", "--save-every", "5",
            "--no-bf16"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("eagle-hf train: Could not write ") and str(out) in err, err
    assert "no space left" in err and "free there" in err and "Traceback" not in err, err
    assert leftovers(out) == []
    assert load_state(out / "train_state.pt")["step"] == 10
    assert (out / "training_log.jsonl").read_text() == log_before  # whole lines only: a cut line is taken back


def test_a_training_state_that_does_not_fit_leaves_the_previous_one(disk):
    from eagle_hf.training.trainer import load_state, save_state

    drafter = tiny_drafter()
    opt = torch.optim.AdamW(drafter.parameters())
    path = disk.folder / "train_state.pt"
    save_state(path, drafter, opt, 10)
    disk.fill()
    with pytest.raises(WriteError, match=r"train_state\.pt: no space left on its disk \(.* free there, about .* "
                                         r"needed\).* The previous train_state\.pt is unchanged\."):
        save_state(path, drafter, opt, 20)
    assert leftovers(disk.folder) == [] and load_state(path)["step"] == 10


def test_a_log_line_that_does_not_fit_is_taken_back(disk):
    from eagle_hf.files import append_line

    path = disk.folder / "log.jsonl"
    path.write_text('{"step": 1}\n')
    disk.fill()
    with pytest.raises(WriteError, match="log.jsonl: no space left"):
        append_line(path, json.dumps({"step": 2, "note": "x" * 20000}))  # (past the page the file has begun)
    assert path.read_text() == '{"step": 1}\n'


def test_resume_drops_a_cut_last_log_line_and_rescores_a_lost_best(tmp_path, caplog):
    from test_training import _run, tiny_tokenizer

    target, tok = tiny_target("llama"), tiny_tokenizer()
    _run(tmp_path, target, tok, max_steps=10, eval_every=5)
    out = tmp_path / "out"
    log = out / "training_log.jsonl"
    log.write_text(log.read_text() + '{"step": 11, "loss": 0.4')  # what a full disk leaves mid-append
    (out / "best" / "best.json").write_text("")  # and mid-write
    with caplog.at_level(logging.WARNING):
        _run(tmp_path, target, tok, max_steps=20, eval_every=5)
    text = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum("cut short" in t for t in text) == 1 and sum("best.json is empty or unreadable" in t for t in text) == 1
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(21))
    best = json.loads((out / "best" / "best.json").read_text())
    assert best["eval_tau"] == max(r["eval_tau"] for r in rows if "eval_tau" in r)


def test_a_damaged_log_line_before_the_last_names_the_file_and_line(tmp_path):
    from eagle_hf.training.report import read_log

    path = tmp_path / "training_log.jsonl"
    path.write_text('{"step": 0}\n{"step": 1\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"training_log.jsonl, line 2: not a row of a training log"):
        read_log(path)


def test_settings_compare_prompt_files_by_where_they_are(tmp_path, monkeypatch):
    from eagle_hf.training.pipeline import RUN_FILE, RunConfig, check_output_dir, run_record

    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.jsonl").write_text("{}\n")
    (tmp_path / "out").mkdir()
    old = run_record(RunConfig(prompts="x.jsonl", draft_vocab_size=48, eagle31=True))
    old["prompts"] = "x.jsonl"  # as an earlier version wrote it: spelt as given
    (tmp_path / "out" / RUN_FILE).write_text(json.dumps(old))
    check_output_dir(tmp_path / "out", RunConfig(prompts="./x.jsonl", draft_vocab_size=48, eagle31=True))
    check_output_dir(tmp_path / "out", RunConfig(prompts=str(tmp_path / "x.jsonl"), draft_vocab_size=48, eagle31=True))
    with pytest.raises(ValueError, match="other settings"):
        check_output_dir(tmp_path / "out", RunConfig(prompts="mt_bench", draft_vocab_size=48, eagle31=True))


# ------------------------------------------------------------------------------ bench results
def test_bench_results_on_a_full_disk_name_the_file_and_leave_no_empty_one(disk):
    from eagle_hf.tools.bench import plot_results, write_results

    results = {"settings": {"modes": ["plain", "eagle default"]},
               "sets": {"mt_bench": {"eagle default": {"speedup_median": 1.2, "acceptance_per_position": [0.5]}}}}
    disk.fill()
    with pytest.raises(WriteError, match=r"results\.json: no space left on its disk \(.* free there, about"):
        write_results(results, disk.folder)
    with pytest.raises(WriteError, match=r"speedup\.png: no space left on its disk"):
        plot_results(results, disk.folder / "speedup.png")
    assert [p.name for p in disk.folder.iterdir() if p.name != "filler"] == []


# ------------------------------------------------------------------------------ drafter files
def _fifo_in(folder, name):
    path = folder / name
    if path.exists():
        path.unlink()
    os.mkfifo(path)
    return path


def _load_in_time(folder, seconds: float = 60.0):
    """What `from_pretrained(folder)` raises, run in a forked process: a load that hangs (a FIFO blocks its reader,
    holding the GIL) fails the test instead of stopping it."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the outcome as one line on the pipe
        try:
            EagleDrafter.from_pretrained(folder)
            line = "loaded"
        except Exception as err:  # noqa: BLE001
            line = f"{type(err).__name__}: {err}"
        os.write(write, " ".join(line.split()).encode()[:8000])
        os._exit(0)
    os.close(write)
    ready, _, _ = select.select([read], [], [], seconds)
    if not ready:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    text = os.read(read, 8192).decode() if ready else None
    os.close(read)
    if text is None:
        pytest.fail(f"loading {folder} hangs")
    return text


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not hasattr(os, "fork"), reason="needs FIFOs and fork")
@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin", "config.json", "other.safetensors"])
def test_a_fifo_among_a_drafters_files_is_refused_by_name_without_reading_it(tmp_path, name):
    folder = tmp_path / "drafter"
    tiny_drafter().save_pretrained(folder)
    if name in ("pytorch_model.bin", "other.safetensors"):
        (folder / "model.safetensors").unlink()
    fifo = _fifo_in(folder, name)
    err = _load_in_time(folder)
    assert err.startswith("DrafterLoadError: ") and str(fifo) in err and "not a regular file" in err, err


def test_a_link_to_nothing_is_named(tmp_path):
    folder = tmp_path / "drafter"
    tiny_drafter().save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(tmp_path / "gone.safetensors")
    with pytest.raises(DrafterLoadError, match=r"model\.safetensors is a link to .*gone\.safetensors, which does not"):
        EagleDrafter.from_pretrained(folder)


def test_yarn_without_its_factor_names_the_field(tmp_path):
    folder = tmp_path / "drafter"
    tiny_drafter().save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0}
    cfg.pop("rope_scaling", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterLoadError, match=r"config\.json: .*`factor`.*yarn") as info:
        EagleDrafter.from_pretrained(folder)
    assert str(folder) in str(info.value)


def test_a_tensor_of_the_wrong_shape_names_its_file(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "drafter-b"
    tiny_drafter().save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    state["fc.weight"] = state["fc.weight"][:, :-1].contiguous()
    save_file(state, folder / "model.safetensors")
    with pytest.raises(DrafterLoadError, match=r"Tensor fc\.weight in .*drafter-b/model\.safetensors has shape"):
        EagleDrafter.from_pretrained(folder)


def test_an_integer_weight_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "drafter"
    tiny_drafter().save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    state["fc.weight"] = state["fc.weight"].to(torch.int32)
    save_file(state, folder / "model.safetensors")
    with pytest.raises(DrafterLoadError, match=r"Tensor fc\.weight in .*model\.safetensors is torch\.int32"):
        EagleDrafter.from_pretrained(folder)


# ------------------------------------------------------------------------------ one drafter, two dtypes at once
def test_one_drafter_shared_by_a_float32_and_a_bf16_target_at_once(one_thread):
    """Calls on two targets of two dtypes, in two threads, share one drafter: each drafts with the drafter in its
    target's dtype (a copy where it differs), and the drafter passed in is never changed."""
    fp32 = tiny_target("llama")
    bf16 = tiny_target("llama").to(torch.bfloat16)
    drafter = tiny_drafter(fp32)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    prompts = [torch.randint(1, 96, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 13)]
    kw = dict(max_new_tokens=12, do_sample=False, num_assistant_tokens=3)  # (rounds that do not follow the clock)
    plain = {(id(t), i): t.generate(p, max_new_tokens=12, do_sample=False) for t in (fp32, bf16)
             for i, p in enumerate(prompts)}
    # what each target's calls give alone, with a drafter of their own (bf16 may differ from plain near ties)
    alone = {(id(t), i): t.generate(p, assistant_model=tiny_drafter(fp32), **kw)
             for t in (fp32, bf16) for i, p in enumerate(prompts)}
    results, errors = {}, []
    barrier = threading.Barrier(2)

    def calls(target):
        barrier.wait()
        for _ in range(2):
            for i, p in enumerate(prompts):
                try:
                    results.setdefault((id(target), i), []).append(target.generate(p, assistant_model=drafter, **kw))
                except Exception as err:  # noqa: BLE001
                    errors.append(err)

    threads = [threading.Thread(target=calls, args=(t,)) for t in (fp32, bf16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    outputs = [(key, out) for key, outs in results.items() for out in outs]
    assert len(outputs) == 12
    for key, out in outputs:
        assert torch.equal(out, alone[key]), key
    for key, out in alone.items():  # equal to plain decoding (in bf16 too, for these prompts: no near tie)
        assert torch.equal(out, plain[key]), key
    assert all(torch.equal(v, before[k]) for k, v in drafter.state_dict().items())
    assert drafter.fc.weight.dtype == torch.float32


def test_a_drafter_without_an_embedding_reads_each_targets_own(one_thread):
    """An embedding-less drafter stays bound to its first target; a call on another target drafts with a view
    bound to that target's embedding (the weights shared), so neither call changes what the other reads."""
    first, second = tiny_target("llama", seed=0), tiny_target("llama", seed=3)
    drafter = tiny_drafter(first)
    prompt = torch.randint(1, 96, (1, 7), generator=torch.Generator().manual_seed(7))
    kw = dict(max_new_tokens=10, do_sample=False, num_assistant_tokens=3)
    first.generate(prompt, assistant_model=drafter, **kw)
    out = second.generate(prompt, assistant_model=drafter, **kw)
    assert torch.equal(out, second.generate(prompt, max_new_tokens=10, do_sample=False))
    assert drafter._target_embedding is first.get_input_embeddings()
    from eagle_hf.hf.call import prepare_drafter

    view = prepare_drafter(second, drafter)
    assert view is not drafter and view.fc.weight is drafter.fc.weight
    assert view._target_embedding.weight is second.get_input_embeddings().weight
    assert prepare_drafter(second, drafter) is view and prepare_drafter(first, drafter) is drafter
