"""Data parallel training: `eagle-hf train` under `torchrun --nproc_per_node 2` (gloo, two CPU processes) trains the
drafter one process trains, writes one set of outputs, resumes as if never stopped, and splits the capture."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, tiny_drafter, tiny_target
from safetensors.torch import load_file
from test_training import tiny_tokenizer, write_prompts

from eagle_hf.training.data import build_dataset, load_shards
from eagle_hf.training.pipeline import RunConfig, prepare_drafter_for_training
from eagle_hf.training.ttt import step_counts, ttt_loss

ROOT = Path(__file__).resolve().parents[1]
# float32 training, 3 unrolled steps, 6 steps of 256 tokens (each global batch holds 3-5 conversations)
TRAIN = ["--max-steps", "6", "--tokens-per-batch", "256", "--dtype", "float32", "--no-bf16", "--seed", "0",
         "--draft-vocab-size", "48", "--ttt-steps", "3", "--max-new-tokens", "12", "--batch-size", "8",
         "--eval-every", "3", "--save-every", "3", "--lr", "3e-3"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    target = tiny_target("llama").cpu()
    with torch.no_grad():
        target.lm_head.weight.mul_(40)  # confident next-token distributions: something to learn
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    write_prompts(root / "prompts.jsonl")
    with open(root / "answers.jsonl", "w") as f:  # 70 records: two capture shards of 64
        f.writelines(json.dumps({"prompt": f"w{i % 50} w{i % 7}", "response": f"w{i % 11} w{i % 13} w{i % 17}"}) + "\n"
                     for i in range(70))
    return root


def train(files, out, *args, processes=1):
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    cmd = (launch if processes > 1 else [sys.executable]) + [
        "-m", "eagle_hf.cli", "train", "--target", str(files / "target"), "--out", str(out), *TRAIN, *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def state(out):
    return torch.load(Path(out) / "train_state.pt", map_location="cpu", weights_only=False)


def log(out):
    return [json.loads(line) for line in (Path(out) / "training_log.jsonl").read_text().splitlines()]


def figures(out):
    """The training log without its timings."""
    return [{k: v for k, v in r.items() if not k.endswith("_per_s") and k != "eval_seconds"} for r in log(out)]


def test_two_processes_train_the_drafter_of_one_and_resume_as_if_never_stopped(files, tmp_path):
    data = ["--prompts", str(files / "prompts.jsonl"), "--data-dir", str(tmp_path / "data")]
    two = tmp_path / "two"
    # two processes, stopped after step 3: each regenerates its share of the data
    train(files, two, *data, "--stop-after", "3", processes=2)
    meta = json.loads((tmp_path / "data" / "data_meta.json").read_text())
    assert [s["process"] for s in meta["shards"].values()] == [0, 1, 0]
    assert state(two)["step"] == 3 and state(two)["processes"] == 2
    halfway = tmp_path / "halfway"
    halfway.mkdir()
    for name in ("train_state.pt", "train_run.json", "training_log.jsonl"):
        (halfway / name).write_bytes((two / name).read_bytes())
    (halfway / "best").mkdir()
    for name in os.listdir(two / "best"):
        (halfway / "best" / name).write_bytes((two / "best" / name).read_bytes())
    # the same command again: it resumes at step 3 and finishes
    proc = train(files, two, *data, "--stop-after", "3", processes=2)
    assert proc.stdout.count("Saved EAGLE-3.1 drafter") == 1  # one process reports, and writes
    assert [r["step"] for r in log(two)] == list(range(7))  # one log, every step once (0: the first evaluation)
    assert not list(two.glob("*.tmp")) and (two / "model.safetensors").is_file()

    # uninterrupted, two processes: equal to the resumed run, bit for bit
    straight = tmp_path / "straight"
    train(files, straight, *data, processes=2)
    a, b = state(two), state(straight)
    for k in a["drafter"]:
        assert torch.equal(a["drafter"][k], b["drafter"][k]), k
    for i, group in a["optimizer"]["state"].items():
        for name, value in group.items():
            assert torch.equal(value, b["optimizer"]["state"][i][name]), (i, name)
    assert figures(two) == figures(straight)

    # one process on the same data: the same drafter within float32 tolerance, from the same global batches
    one = tmp_path / "one"
    train(files, one, *data)
    c = state(one)
    for k in a["drafter"]:
        torch.testing.assert_close(c["drafter"][k], a["drafter"][k], atol=1e-4, rtol=1e-4, msg=k)
    for r1, r2 in zip(log(one), log(two)):
        assert r1["step"] == r2["step"]
        for key in ("loss", "eval_tau", "grad_norm"):
            if key in r1:
                assert r1[key] == pytest.approx(r2[key], rel=1e-4), (r1["step"], key)

    # the checkpoint two processes wrote at step 3, resumed by one
    train(files, halfway, *data)
    d = state(halfway)
    for k in a["drafter"]:
        torch.testing.assert_close(d["drafter"][k], a["drafter"][k], atol=1e-4, rtol=1e-4, msg=k)
    assert [r["step"] for r in log(halfway)] == list(range(7))


def test_two_processes_capture_their_shares_and_merge_the_manifest(files, tmp_path):
    out = tmp_path / "out"
    train(files, out, "--responses", str(files / "answers.jsonl"), "--max-steps", "1", processes=2)
    (folder,) = (out / "captures").glob("answers-*")
    manifest = json.loads((folder / "capture.json").read_text())
    assert manifest["complete"] and manifest["processes"] == 2 and manifest["num_records"] == 70
    assert sorted(manifest["shards"]) == ["shard_00000.safetensors", "shard_00001.safetensors"]
    assert not list(folder.glob("capture.part*"))
    # what the two processes captured is what one process captures (the states up to bf16 rounding: the
    # processes ran one thread each)
    from eagle_hf.drafter.default import load_target
    from eagle_hf.training.data import capture_records

    target, tok = load_target(str(files / "target"), dtype=torch.float32)
    records = [json.loads(line) for line in (files / "answers.jsonl").read_text().splitlines()]
    alone = capture_records(target, tok, records, tmp_path / "alone", manifest["aux_layer_ids"],
                            max_tokens=manifest["max_tokens"])
    assert json.loads((alone / "capture.json").read_text())["shards"] == manifest["shards"]
    for name in manifest["shards"]:
        x, y = load_file(str(folder / name)), load_file(str(alone / name))
        for key in ("input_ids", "loss_mask", "offsets"):
            assert torch.equal(x[key], y[key]), (name, key)
        for key in ("aux", "final"):
            torch.testing.assert_close(x[key].float(), y[key].float(), atol=1e-2, rtol=1e-2, msg=(name, key))
    assert len(load_shards(folder)) == 70


def test_sharded_launches_are_refused_before_any_compute(files, tmp_path, monkeypatch):
    from eagle_hf.training.pipeline import RunConfig, validate_run

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="does not support FSDP.*torchrun --nproc_per_node"):
        validate_run(RunConfig(prompts=str(files / "prompts.jsonl")))


def test_slices_divided_by_the_global_rows_sum_to_the_batch_loss_and_gradients():
    """What each process computes: its slice's loss over the global batch's rows per unrolled step."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target, draft_vocab=48)
    drafter.bind_target_embedding(target.get_input_embeddings())
    B, T = 3, 11
    g = torch.Generator().manual_seed(3)
    aux, final = torch.randn(B, T, 3 * 64, generator=g), torch.randn(B, T, 64, generator=g)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 3:], mask[1, 4:9], mask[2, 2:6] = True, True, True
    W = torch.randn(48, 64, generator=g)
    aux, final, ids, mask, W = (x.to(target.device) for x in (aux, final, ids, mask, W))
    in_vocab = drafter.t2d[ids]

    def run(rows, normalisers=None):
        drafter.zero_grad()
        out = ttt_loss(drafter, aux[rows], final[rows], W, ids[rows], mask[rows], in_vocab[rows], steps=3,
                       normalisers=normalisers)
        out.loss.backward()
        return out, {n: q.grad.clone() for n, q in drafter.named_parameters() if q.grad is not None}

    whole, whole_g = run([0, 1, 2])
    assert whole.step_counts == step_counts(mask, in_vocab, 3)
    rows = whole.step_counts  # the global batch's rows per step
    (a, a_g), (b, b_g) = run([0, 2], rows), run([1], rows)
    torch.testing.assert_close(a.loss + b.loss, whole.loss)
    for k in range(3):
        assert a.step_accuracy[k] + b.step_accuracy[k] == pytest.approx(whole.step_accuracy[k])
    for name in whole_g:
        torch.testing.assert_close(a_g[name] + b_g[name], whole_g[name], atol=1e-5, rtol=1e-4, msg=name)


def test_the_drafters_random_start_follows_the_seed(tmp_path):
    """Every process (and every rerun) starts from the same drafter: its layer's random init is seeded."""
    target, tok = tiny_target("llama"), tiny_tokenizer()
    prompts = [json.loads(line)["turns"][0] for line in write_prompts(tmp_path / "p.jsonl", n=8).read_text().splitlines()]
    build_dataset(target, tok, prompts, tmp_path / "data", [1, 2, 3], batch_size=8, max_new_tokens=6)
    weights = []
    for noise in (1, 2):
        torch.manual_seed(noise)  # whatever the global random state before
        drafter, *_ = prepare_drafter_for_training(target, tmp_path / "data", RunConfig(draft_vocab_size=48), [1, 2, 3])
        weights.append(drafter.state_dict())
    for name, value in weights[0].items():
        assert torch.equal(value, weights[1][name]), name


def test_a_rerun_skips_the_shards_any_process_of_an_interrupted_capture_finished(tmp_path):
    from eagle_hf.training.data import CAPTURE_FILE, capture_records

    target, tok = tiny_target("llama"), tiny_tokenizer()
    records = [{"prompt": f"w{i}", "response": f"w{i % 11} w{i % 13}"} for i in range(8)]
    folder = capture_records(target, tok, records, tmp_path / "c", [1, 2, 3], shard_size=4)
    manifest = json.loads((folder / CAPTURE_FILE).read_text())
    # as a crash leaves it: process 1 finished shard 1 (its part file says so), the merged manifest was not written
    part = {**manifest, "shards": {"shard_00001.safetensors": manifest["shards"]["shard_00001.safetensors"]}}
    (folder / "capture.part1.json").write_text(json.dumps(part))
    (folder / CAPTURE_FILE).write_text(json.dumps({**manifest, "shards": {}, "complete": False}))
    (folder / "shard_00000.safetensors").unlink()
    kept = (folder / "shard_00001.safetensors").stat().st_mtime_ns
    capture_records(target, tok, records, folder, [1, 2, 3], shard_size=4)
    assert (folder / "shard_00001.safetensors").stat().st_mtime_ns == kept  # not captured again
    assert json.loads((folder / CAPTURE_FILE).read_text()) == manifest
    assert (folder / "shard_00000.safetensors").is_file() and not list(folder.glob("capture.part*"))
