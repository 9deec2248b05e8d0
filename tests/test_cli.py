"""`eagle-hf`: a user's error is one line on stderr and exit status 2, found before any model loads (`-v` adds the
traceback); `bench` writes its results as each prompt set ends; `demo` passes its options on to demo/app.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle_hf import cli
from eagle_hf.cli import main
from eagle_hf.drafter import default


@pytest.fixture
def no_loading(monkeypatch):
    """Any target or drafter load fails the test: the error must come before."""
    def loads(*args, **kwargs):
        raise AssertionError("a model loaded before the error was found")

    monkeypatch.setattr(default, "load_target", loads)
    monkeypatch.setattr(cli, "_target", loads)


def one_line_error(capsys, command: str, argv: list[str], match: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"eagle-hf {command}: "), err
    assert "Traceback" not in err and match in err, err
    return err


@pytest.fixture
def files(tmp_path):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "empty").mkdir()
    return tmp_path


GENERATE = [(["--max-new-tokens", "0"], "--max-new-tokens 0: must be at least 1"),
            (["--num-draft-tokens", "0"], "--num-draft-tokens 0: must be at least 1"),
            (["--num-draft-tokens", "99"], "--num-draft-tokens 99: must be in 1..32"),
            (["--temperature", "-1"], "--temperature -1.0: must be 0"),
            (["--temperature", "nan"], "--temperature nan: must be 0"),
            (["--target", "{tmp}/absent"], "no such folder"),
            (["--target", "{tmp}/empty"], "not a model folder (no config.json)"),
            (["--drafter", "{tmp}/absent"], "absent"),
            (["--drafter", "{tmp}/empty"], "no config.json")]


@pytest.mark.parametrize("command", ["generate", "bench"])
@pytest.mark.parametrize("flags,match", GENERATE, ids=[" ".join(f) for f, _ in GENERATE])
def test_a_bad_generate_or_bench_flag_is_one_line_before_any_model_loads(files, capsys, no_loading, command, flags,
                                                                         match):
    if command == "bench" and flags[0] == "--num-draft-tokens":
        pytest.skip("generate's flag")
    flags = [f.replace("{tmp}", str(files)) for f in flags]
    out = ["--out", str(files / "out")] if command == "bench" else []
    one_line_error(capsys, command, [command, *flags, *out], match)


def test_verbose_shows_the_traceback(capsys, no_loading):
    assert main(["-v", "generate", "--max-new-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().endswith("--max-new-tokens 0: must be at least 1.")


BENCH = [(["--prompts", "{tmp}/absent.jsonl"], "No prompt set"),
         (["--prompts", "mt_bench,nonsense"], "No prompt set 'nonsense'"),
         (["--out", "{tmp}/a-file"], "a file, not a folder"),
         (["--out", "{tmp}/a-file/sub"], "cannot write there"),
         (["--modes", "eagle tree,eagle trees"], "unknown mode(s) ['eagle trees']"),
         (["--modes", "eagle chain 4"], "unknown mode(s) ['eagle chain 4']"),
         (["--modes", "early-exit"], "needs --early-exit-layer"),
         (["--batch-size", "0"], "--batch-size 0: must be at least 1"),
         (["--repeats", "0"], "--repeats 0: must be at least 1"),
         (["--limit", "0"], "--limit 0: must be at least 1")]


@pytest.mark.parametrize("flags,match", BENCH, ids=[" ".join(f) for f, _ in BENCH])
def test_a_bad_bench_flag_is_one_line_before_any_model_loads(files, capsys, no_loading, flags, match):
    flags = [f.replace("{tmp}", str(files)) for f in flags]
    out = [] if "--out" in flags else ["--out", str(files / "out")]
    one_line_error(capsys, "bench", ["bench", *flags, *out], match)


def test_bench_takes_the_chain_lengths_it_runs(no_loading, files):
    """--modes names the chains of --chain-lengths (the check passes: the run goes on to load the models)."""
    with pytest.raises(AssertionError, match="a model loaded"):
        main(["bench", "--modes", "eagle chain 4,eagle tree", "--chain-lengths", "4", "--out", str(files / "out")])


def test_bench_writes_each_prompt_set_as_it_ends(tmp_path, monkeypatch):
    """A failure in a later set leaves the finished sets' results on disk."""
    from test_bench import _parts

    from eagle_hf.tools import bench

    target, tok, drafter, prompts = _parts(tmp_path)
    second = tmp_path / "q.jsonl"
    second.write_text(Path(prompts).read_text())
    monkeypatch.setattr(cli, "_models", lambda args: (target, tok, (drafter, "tiny")))
    real = bench.load_prompt_set

    def load(name, limit=None):
        if name == str(second):
            raise RuntimeError("the second set fails")
        return real(name, limit=limit)

    monkeypatch.setattr(bench, "load_prompt_set", load)
    with pytest.raises(RuntimeError, match="second set"):
        main(["bench", "--prompts", f"{prompts},{second}", "--modes", "eagle tree", "--max-new-tokens", "4",
              "--limit", "1", "--out", str(tmp_path / "out")])
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(data["sets"]) == [prompts] and set(data["sets"][prompts]) == {"plain", "eagle tree"}
    assert data["drafter"] == "tiny" and (tmp_path / "out" / "results.md").is_file()


TRAIN = [(["--out", "{tmp}/a-file"], "a file, not a folder"),
         (["--init-from", "{tmp}/absent"], "--init-from"),
         (["--responses", "{tmp}/absent.jsonl"], "absent.jsonl"),
         (["--data-dir", "{tmp}/absent", "--data-dir", "{tmp}/empty"], "absent"),
         (["--feature-noise", "2"], "--feature-noise 2.0"),
         (["--temperature", "nan"], "--temperature nan"),
         (["--target", "{tmp}/absent"], "no such folder")]


@pytest.mark.parametrize("flags,match", TRAIN, ids=[" ".join(f) for f, _ in TRAIN])
def test_a_bad_train_flag_is_one_line_before_any_model_loads(files, capsys, no_loading, flags, match):
    flags = [f.replace("{tmp}", str(files)) for f in flags]
    out = [] if "--out" in flags else ["--out", str(files / "run")]
    one_line_error(capsys, "train", ["train", *flags, *out], match)


def test_demo_passes_its_options_on(monkeypatch):
    import runpy
    import sys

    seen = []
    monkeypatch.setattr(runpy, "run_path", lambda path, run_name: seen.append(list(sys.argv)))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    options = ["--target", "some/model", "--drafter", "x", "--device", "cpu", "--port", "7861"]
    assert main(["demo", *options]) == 0
    assert main(["demo", "--help"]) == 0  # demo/app.py's own help
    assert [argv[1:] for argv in seen] == [options, ["--help"]] and seen[0][0].endswith("app.py")


def test_an_unknown_flag_of_another_command_is_still_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--port", "1"])
    assert exit_.value.code == 2 and "unrecognized arguments: --port 1" in capsys.readouterr().err
