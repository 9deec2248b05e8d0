"""Training pipeline: data formatting, loss masks, vocab mapping, TTT loss, tiny end-to-end run, resume."""

import json
from pathlib import Path

import pytest
import torch
from conftest import CHAT_TEMPLATE, VOCAB, tiny_drafter, tiny_target

from eagle_hf import EagleDrafter
from eagle_hf.training.data import generate_with_capture, load_shards
from eagle_hf.training.pipeline import RunConfig, run_training
from eagle_hf.training.prompts import PromptFormatError, first_user_turn, load_prompts, render_chat
from eagle_hf.training.trainer import TrainConfig, load_state
from eagle_hf.training.ttt import ttt_loss, ttt_mask
from eagle_hf.training.vocab import build_draft_vocab


def tiny_tokenizer(vocab=VOCAB, chat_template=CHAT_TEMPLATE):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<|im_start|>", "<|im_end|>", "user", "assistant"] + [f"w{i}" for i in range(vocab - 5)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"<\|im_start\|>|<\|im_end\|>"), behavior="isolated"), pre_tokenizers.WhitespaceSplit()]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>")
    fast.chat_template = chat_template
    return fast


def write_prompts(path, n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for i in range(n):
            words = " ".join(f"w{int(x)}" for x in torch.randint(0, 20, (5,), generator=g))
            f.write(json.dumps({"question_id": i, "turns": [words, "second turn"]}) + "\n")
    return path


# ------------------------------------------------------------------------------------------ prompts
def test_prompt_formats(tmp_path):
    assert first_user_turn({"turns": ["a", "b"]}) == "a"
    assert first_user_turn({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "hi"}]}) == "hi"
    assert first_user_turn({"messages": [{"role": "user", "content": "yo"}, {"role": "assistant", "content": "x"}]}) == "yo"
    with pytest.raises(PromptFormatError, match="Unknown prompt record layout"):
        first_user_turn({"foo": 1})
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(PromptFormatError, match="empty"):
        load_prompts(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(PromptFormatError, match="not JSON"):
        load_prompts(bad)
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(PromptFormatError, match="Unknown prompt record layout"):
        load_prompts(unknown)
    truncated = tmp_path / "trunc.json"
    truncated.write_text('[{"turns": ["a"]}, {"turns": ["b"]}, {"turns": ["c')
    assert sorted(load_prompts(truncated, shuffle=False)) == ["a", "b"]
    with pytest.raises(PromptFormatError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")


def test_render_chat_with_and_without_a_template():
    tok = tiny_tokenizer()
    ids = render_chat(tok, "w1 w2")
    assert ids[0] == 1 and ids[-1] == 4  # <|im_start|> ... assistant
    plain = tiny_tokenizer(chat_template=None)  # a pretrained model's: the text, then a blank line
    context = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]
    assert render_chat(plain, "w3", context) == plain("w1\n\nw2\n\nw3\n\n")["input_ids"]


# ------------------------------------------------------------------------------------------ data
def test_capture_and_loss_mask_match_a_plain_forward():
    target = tiny_target("llama")
    prompts = [[1, 5, 6, 7, 4], [1, 9, 4]]
    aux_ids = [2, 3, 4]
    samples = generate_with_capture(target, prompts, aux_ids, max_new_tokens=6, eos_token_ids=[2], pad_token_id=0)
    for p, s in zip(prompts, samples):
        ids = s["input_ids"].long().to(target.device)
        assert ids[: len(p)].tolist() == p
        assert s["loss_mask"][: len(p)].sum() == 0 and s["loss_mask"][len(p) :].all()
        out = target(ids[None], output_hidden_states=aux_ids + [-1])
        ref_aux = torch.cat([out.hidden_states[i] for i in aux_ids], -1)[0]
        t = ids.shape[0]
        assert torch.allclose(s["aux"][: t - 1].float().to(ids.device), ref_aux[: t - 1], atol=0.05, rtol=0.02)
        assert torch.allclose(s["final"][: t - 1].float().to(ids.device), out.hidden_states[-1][0, : t - 1],
                              atol=0.05, rtol=0.02)
        # the response is the target's own greedy continuation
        assert ids[len(p) :].tolist() == target.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p) :].tolist()


# ------------------------------------------------------------------------------------------ vocab
def test_draft_vocab_mapping():
    counts = torch.zeros(20, dtype=torch.long)
    counts[[3, 7, 11, 12, 19]] = torch.tensor([5, 9, 1, 4, 8])
    v = build_draft_vocab(counts, 4)
    assert v.target_ids.tolist() == [3, 7, 12, 19]  # the 4 most frequent, ascending
    assert (v.d2t == v.target_ids - torch.arange(4)).all() and (v.d2t >= 0).all()
    assert v.t2d.nonzero().flatten().tolist() == [3, 7, 12, 19]
    assert v.coverage == pytest.approx(26 / 27)
    padded = build_draft_vocab(counts, 8)  # more slots than seen tokens: padded with unseen ids
    assert padded.t2d.sum() == 8 and padded.coverage == 1.0
    with pytest.raises(ValueError, match="larger than the target vocabulary"):
        build_draft_vocab(counts, 21)


# ------------------------------------------------------------------------------------------ TTT
def test_ttt_mask_shape():
    m = ttt_mask(3, 2, "cpu")[0, 0].int()
    assert m.tolist() == [[1, 0, 0, 1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1, 0, 0, 1]]


def test_ttt_step0_matches_inference_and_chain_step_matches_drafting():
    """Step 0 of TTT is the drafter's real-row pass; step k of row t equals a k-long chain after row t."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    drafter.bind_target_embedding(target.get_input_embeddings())
    T, A = 9, 3 * 64
    dev = target.device
    aux = torch.randn(1, T, A).to(dev)
    ids = torch.randint(1, VOCAB, (1, T)).to(dev)
    W = (torch.randn(VOCAB, 64) * 0.1).to(dev)
    final = torch.randn(1, T, 64).to(dev)
    ones = torch.ones(1, T, dtype=torch.bool, device=dev)
    out = ttt_loss(drafter, aux, final, W, ids, ones, ones, steps=3)
    assert len(out.step_losses) == 3 and out.loss.requires_grad
    # reproduce step 2 of row 4 with explicit chain drafting
    t = 4
    with torch.no_grad():
        real = drafter.step(drafter.fuse(aux[:, : t + 1]), ids[:, 1 : t + 2], torch.arange(t + 1, device=dev)[None])
        past, hidden = real.kv, real.hidden[:, -1:]
        for k in (1, 2):
            o = drafter.step(hidden, ids[:, t + k + 1 : t + k + 2], torch.tensor([[t + k]], device=dev), past=past)
            past, hidden = past.append(o.kv), o.hidden
        # same row through the TTT unroll
        from eagle_hf.training.ttt import ttt_mask as mk

        h = drafter.fuse(aux)
        pos = torch.arange(T, device=dev)[None]
        s0 = drafter.step(h, torch.nn.functional.pad(ids[:, 1:], (0, 1)), pos)
        kv = s0.kv
        s1 = drafter.step(s0.hidden, torch.nn.functional.pad(ids[:, 2:], (0, 2)), pos + 1, past=kv, mask=mk(T, 1, dev))
        kv = kv.append(s1.kv)
        s2 = drafter.step(s1.hidden, torch.nn.functional.pad(ids[:, 3:], (0, 3)), pos + 2, past=kv, mask=mk(T, 2, dev))
    assert torch.allclose(s2.logits[0, t], o.logits[0, -1], atol=1e-5)


def test_fast_ttt_loss_equals_the_reference():
    """Target distribution once per batch + fused soft cross-entropy: same loss, accuracy and gradients."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target, draft_vocab=48)
    drafter.bind_target_embedding(target.get_input_embeddings())
    B, T = 2, 11
    g = torch.Generator().manual_seed(3)
    aux, final = torch.randn(B, T, 3 * 64, generator=g), torch.randn(B, T, 64, generator=g)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 3:], mask[1, 4:9] = True, True  # prompts, and padding after row 1's answer
    W = torch.randn(48, 64, generator=g)
    aux, final, ids, mask, W = (x.to(target.device) for x in (aux, final, ids, mask, W))
    results = []
    for fast in (False, True):
        drafter.zero_grad()
        out = ttt_loss(drafter, aux, final, W, ids, mask, drafter.t2d[ids], steps=3, fast=fast)
        out.loss.backward()
        results.append((out, {n: q.grad.clone() for n, q in drafter.named_parameters() if q.grad is not None}))
    (ref, ref_g), (new, new_g) = results
    assert torch.allclose(ref.loss, new.loss, atol=1e-5) and ref.step_accuracy == new.step_accuracy
    assert ref.step_counts == new.step_counts and ref_g.keys() == new_g.keys()
    for name in ref_g:
        assert torch.allclose(ref_g[name], new_g[name], atol=1e-5, rtol=1e-4), name


def test_feature_noise_is_relative_to_each_captured_state():
    """Half-width `scale` x the RMS of each captured layer's state, per token: a state 1000x larger gets 1000x the
    noise; scale 0 leaves the states alone (the `--feature-noise` default)."""
    from eagle_hf.training.ttt import add_feature_noise

    g = torch.Generator().manual_seed(0)
    states = torch.randn(2, 5, 3, 64, generator=g) * torch.tensor([1.0, 10.0, 1000.0])[:, None]  # [B, T, A, H]
    aux = states.reshape(2, 5, 192)
    noisy = add_feature_noise(aux, 0.1, 3, generator=g).view(2, 5, 3, 64)
    rms = states.pow(2).mean(-1, keepdim=True).sqrt()
    rel = (noisy - states).abs() / rms  # [B, T, A, H], uniform on [0, 0.1]
    assert rel.max() <= 0.1 + 1e-5 and rel.mean() == pytest.approx(0.05, abs=0.01)
    assert torch.equal(add_feature_noise(aux, 0.0, 3), aux)


# ------------------------------------------------------------------------------------------ end to end
def peaky_target():
    """A tiny target with confident next-token distributions (random init is near uniform: nothing to learn)."""
    target = tiny_target("llama")
    with torch.no_grad():
        target.lm_head.weight.mul_(40)
    return target


def _run(tmp_path, target, tok, **train_kw):
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    kw = dict(ttt_steps=3, lr=3e-3, max_steps=40, tokens_per_batch=256, eval_every=20, save_every=10, bf16=False)
    kw.update(train_kw)
    run = RunConfig(
        prompts=str(prompts), draft_vocab_size=48, batch_size=8, max_new_tokens=12, max_prompt_tokens=64,
        data_dir=str(tmp_path / "data"), train=TrainConfig(**kw),
    )
    return run_training(target, tok, tmp_path / "out", run), run


def test_end_to_end_tiny_training_overfits_and_reloads(tmp_path):
    target, tok = peaky_target(), tiny_tokenizer()
    target.name_or_path = "tiny-llama"
    drafter, _ = _run(tmp_path, target, tok)
    log = [json.loads(line) for line in (tmp_path / "out" / "training_log.jsonl").read_text().splitlines()]
    first, last = log[1], log[-1]  # log[0]: the evaluation at step 0
    assert log[0]["step"] == 0 and "eval_tau" in log[0]
    assert last["loss"] < 0.7 * first["loss"]
    assert last["step_accuracy"][0] > first["step_accuracy"][0]
    for name in ("config.json", "model.safetensors", "README.md", "training_curve.png"):
        assert (tmp_path / "out" / name).exists(), name
    card = (tmp_path / "out" / "README.md").read_text()
    assert "base_model: tiny-llama" in card and "library_name: eagle-hf" in card
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["fc_norm"] and cfg["norm_output"] and cfg["draft_vocab_size"] == 48

    reloaded = EagleDrafter.from_pretrained(tmp_path / "out", dtype=torch.float32)
    drafter = drafter.float()
    for d in (drafter, reloaded):
        d.bind_target_embedding(target.get_input_embeddings())
    reloaded = reloaded.to(target.device)
    aux, ids = torch.randn(1, 6, 192).to(target.device), torch.randint(0, VOCAB, (1, 6)).to(target.device)
    with torch.no_grad():
        assert torch.allclose(drafter(aux, ids), reloaded(aux, ids), atol=1e-5)

    # the trained drafter drafts and generation stays exact; it accepts more than a random one
    samples = load_shards(tmp_path / "data")
    prompt = samples[0]["input_ids"][samples[0]["loss_mask"] == 0].long()[None]
    ref = target.generate(prompt, max_new_tokens=12, do_sample=False)
    import eagle_hf

    out = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=reloaded, num_assistant_tokens=3)
    assert torch.equal(out, ref)
    trained_tau = eagle_hf.last_stats().mean_acceptance_length
    target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=tiny_drafter(target, draft_vocab=48),
                    num_assistant_tokens=3)
    assert trained_tau > eagle_hf.last_stats().mean_acceptance_length


def test_resume_after_interruption(tmp_path):
    target, tok = tiny_target("llama"), tiny_tokenizer()
    _run(tmp_path, target, tok, max_steps=10)
    state = torch.load(tmp_path / "out" / "train_state.pt", weights_only=True)
    assert state["step"] == 10
    shards = sorted((tmp_path / "data").glob("shard_*"))
    mtimes = [p.stat().st_mtime for p in shards]
    _run(tmp_path, target, tok, max_steps=20)  # same run, longer: resumes at step 10, reuses the data
    log = [json.loads(line) for line in (tmp_path / "out" / "training_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(21))  # step 0: the evaluation before training
    assert [p.stat().st_mtime for p in shards] == mtimes


class _Payload:
    """What a crafted pickle holds: loading it calls `exec`, which writes `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_a_crafted_training_state_is_refused_before_any_of_it_runs(tmp_path, monkeypatch):
    """Resuming training, or evaluating a run's latest weights, reads tensors and plain values only."""
    import runpy
    import sys

    target, tok = tiny_target("llama"), tiny_tokenizer()
    marker = tmp_path / "ran"
    (tmp_path / "out").mkdir()
    crafted = tmp_path / "out" / "train_state.pt"
    torch.save({"drafter": {}, "optimizer": _Payload(marker), "step": 1, "torch_rng": torch.get_rng_state()}, crafted)
    with pytest.raises(ValueError, match=r"train_state\.pt holds objects other than tensors and plain values"):
        _run(tmp_path, target, tok, max_steps=2)
    monkeypatch.setattr(sys, "argv", ["evaluate_drafter.py", "--train-state", str(crafted), "--out", str(tmp_path / "a.json")])
    with pytest.raises(SystemExit):  # refused before any model loads
        runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "evaluate_drafter.py"), run_name="__main__")
    assert not marker.exists()
    torch.load(crafted, weights_only=False)  # (the payload is live: a full unpickling runs it)
    assert marker.read_text() == "ran"


def test_a_damaged_training_state_is_named(tmp_path):
    path = tmp_path / "train_state.pt"
    path.write_bytes(b"PK\x03\x04 not a whole file")
    with pytest.raises(ValueError, match=r"Cannot read the training state .*truncated or corrupt"):
        load_state(path)
    torch.save({"step": 3}, path)
    with pytest.raises(ValueError, match=r"not a training state eagle_hf wrote: it lacks \['drafter', 'optimizer', 'torch_rng'\]"):
        load_state(path)


def test_bad_training_inputs(tmp_path):
    target, tok = tiny_target("llama"), tiny_tokenizer()
    for size in (VOCAB + 1, 0):  # refused before any compute
        with pytest.raises(ValueError, match="must be between 1 and the target vocabulary size"):
            run_training(target, tok, tmp_path / "a", RunConfig(prompts=str(write_prompts(tmp_path / "p.jsonl")),
                                                              draft_vocab_size=size))
    (tmp_path / "c").mkdir()
    tiny_drafter(target).save_pretrained(tmp_path / "c")
    with pytest.raises(ValueError, match="already holds a drafter"):
        run_training(target, tok, tmp_path / "c", RunConfig(prompts=str(tmp_path / "p.jsonl"), draft_vocab_size=48))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(PromptFormatError):
        run_training(target, tok, tmp_path / "d", RunConfig(prompts=str(empty), draft_vocab_size=48))


def test_training_on_responses_produced_elsewhere(tmp_path):
    target, tok = peaky_target(), tiny_tokenizer()
    path = tmp_path / "responses.jsonl"
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": f"w{i} w{i + 1}", "response": f"w{i + 2} w{i + 3} w{i + 4}"}) + "\n" for i in range(10))
        f.write(json.dumps({"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2 w3"}]}) + "\n")
    run = RunConfig(responses=str(path), draft_vocab_size=48, data_root=str(tmp_path / "captures"),
                    train=TrainConfig(ttt_steps=2, max_steps=4, tokens_per_batch=128, bf16=False, eval_every=4))
    run_training(target, tok, tmp_path / "out", run)
    (folder,) = (tmp_path / "captures").glob("responses-*")  # one capture folder per answer file
    samples = load_shards(folder)
    assert len(samples) == 11
    s = samples[0]
    resp = s["input_ids"][s["loss_mask"].bool()].tolist()
    assert tok.decode(resp[:-1]) == "w2 w3 w4" and resp[-1] == tok.eos_token_id
    out = target(s["input_ids"].long()[None].to(target.device), output_hidden_states=[2, 3, -1])
    n = s["input_ids"].shape[0]
    assert torch.allclose(s["aux"][: n - 1, :64].float().to(target.device), out.hidden_states[2][0, : n - 1],
                          atol=0.05, rtol=0.02)


def test_resume_from_a_checkpoint_before_the_interruption(tmp_path):
    """Interrupted between checkpoints: the log keeps only steps up to the checkpoint, then continues."""
    target, tok = tiny_target("llama"), tiny_tokenizer()
    _run(tmp_path, target, tok, max_steps=7, save_every=5)  # checkpoint at 5, then 6-7 logged, final save at 7
    state = torch.load(tmp_path / "out" / "train_state.pt", weights_only=True)
    state["step"] = 5  # pretend the process died after step 7 was logged but before it was saved
    torch.save(state, tmp_path / "out" / "train_state.pt")
    _run(tmp_path, target, tok, max_steps=9, save_every=5)
    log = [json.loads(line) for line in (tmp_path / "out" / "training_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(10))


# ------------------------------------------------------------------------------------------ held-out acceptance
def test_chain_lengths_and_heldout_tau_on_a_hand_built_case():
    from eagle_hf.training.ttt import chain_lengths, ttt_evaluate

    correct = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    assert chain_lengths(correct).tolist() == [2, 0, 5, 1]  # leading correct drafts only

    # A drafter whose lm_head is zero always drafts draft id 0 (= target id c); the target's argmax is c at the
    # marked positions, so row t (drafting the tokens at t+2, t+3, ...) accepts the run of c from position t+1.
    target = tiny_target("llama")
    drafter = tiny_drafter(target, draft_vocab=48)
    drafter.bind_target_embedding(target.get_input_embeddings())
    with torch.no_grad():
        drafter.lm_head.weight.zero_()
    c = int(drafter.draft_to_target(torch.tensor(0)))
    other = c + 1
    T = 12
    is_c = [0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 0]  # positions 0..11
    targ = torch.tensor([[c if m else other for m in is_c]])
    mask = torch.zeros(1, T, dtype=torch.bool)
    mask[0, 3:] = True  # prompt 0..2, answer 3..11
    ids = torch.randint(0, VOCAB, (1, T))
    aux, final = torch.randn(1, T, 3 * 64), torch.randn(1, T, 64)
    head = torch.randn(48, 64)
    aux, final, head, ids, mask, targ = (x.to(target.device) for x in (aux, final, head, ids, mask, targ))
    out = ttt_evaluate(drafter, aux, final, head, ids, mask, drafter.t2d[ids], targ, steps=2, chain=5)
    # counted rows 1..9 (the token at t+2 is an answer token); row t may draft up to position 11 (5 drafts at most)
    expected = [1, 0, 5, 5, 5, 4, 3, 2, 1]
    assert int(out.chain_rows.sum()) == 9 and int(out.chain_sum.sum()) == sum(expected)
    assert 1 + int(out.chain_sum.sum()) / int(out.chain_rows.sum()) == pytest.approx(1 + 26 / 9)


# ------------------------------------------------------------------------------------------ sources, warm start
def write_answers(path, n, start=0, finished=True, cut_tail=False):
    import gzip

    lines = [json.dumps({"idx": 4000 + start + i, "prompt": f"w{(start + i) % 40} w{(start + i + 1) % 40}",
                         "response": " ".join(f"w{(start + i + j) % 60}" for j in range(2, 7)), "finished": finished})
             for i in range(n)]
    text = "\n".join(lines) + "\n" + ('{"idx": 9999, "prompt": "w1", "resp' if cut_tail else "")
    if str(path).endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def test_several_answer_sources_and_captured_folders(tmp_path):
    from eagle_hf.training.sources import capture_sources, parse_answer_specs

    target, tok = peaky_target(), tiny_tokenizer()
    target.name_or_path = "tiny-llama"
    src = tmp_path / "answers"
    src.mkdir()
    write_answers(src / "a.jsonl", 10)
    write_answers(src / "b.jsonl.gz", 9, start=10, finished=False)
    write_answers(src / "c_000.jsonl.partial", 5, start=20, cut_tail=True)  # a chunk still being written
    old = tmp_path / "old_capture"  # an already-captured folder, used as it is
    from eagle_hf.training.data import build_dataset_from_responses

    build_dataset_from_responses(target, tok, [("w3 w4", "w5 w6 w7")] * 4, old, [2, 3, 4])
    run = RunConfig(responses=[str(src / "a.jsonl"), str(src / "*.gz"), str(src / "*.partial")], data_dir=[str(old)],
                    draft_vocab_size=48, data_root=str(tmp_path / "cap"),
                    train=TrainConfig(ttt_steps=2, max_steps=3, tokens_per_batch=256, bf16=False, eval_every=2,
                                      eval_fraction=0.3))
    run_training(target, tok, tmp_path / "out", run)
    folders = {p.name.rsplit("-", 1)[0]: p for p in (tmp_path / "cap").iterdir()}
    assert sorted(folders) == ["a", "b", "c_000"]
    assert [len(load_shards(folders[k])) for k in ("a", "b", "c_000")] == [10, 9, 5]  # the cut line is skipped
    s = load_shards(folders["b"])[0]  # finished=false: the answer was cut, no EOS appended
    assert s["input_ids"][-1] != tok.eos_token_id and load_shards(folders["a"])[0]["input_ids"][-1] == tok.eos_token_id
    log = [json.loads(line) for line in (tmp_path / "out" / "training_log.jsonl").read_text().splitlines()]
    assert log[0]["step"] == 0 and all("eval_tau" in r for r in log if r["step"] in (0, 2, 3))

    # the best checkpoint (by held-out tau) is a full drafter and the final output
    best = json.loads((tmp_path / "out" / "best" / "best.json").read_text())
    evals = [r for r in log if "eval_tau" in r]
    assert best["eval_tau"] == pytest.approx(max(r["eval_tau"] for r in evals))
    assert best["step"] == next(r["step"] for r in evals if r["eval_tau"] == max(e["eval_tau"] for e in evals))
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "out" / "best" / "model.safetensors").read_bytes()
    assert EagleDrafter.from_pretrained(tmp_path / "out" / "best").config.draft_vocab_size == 48

    # rerun: unchanged sources are reused; the grown .partial recaptures only its changed shard
    mtimes = {k: [p.stat().st_mtime_ns for p in sorted(f.glob("shard_*"))] for k, f in folders.items()}
    write_answers(src / "c_000.jsonl.partial", 7, start=20)
    sources = parse_answer_specs([str(src / "a.jsonl"), str(src / "*.gz"), str(src / "*.partial")])
    from eagle_hf.drafter.capture import default_aux_layer_ids

    again = capture_sources(target, tok, sources, tmp_path / "cap", default_aux_layer_ids(6))
    assert [f.path for f in again] == [folders[k] for k in ("a", "b", "c_000")]
    assert {k: [p.stat().st_mtime_ns for p in sorted(f.glob("shard_*"))] for k, f in folders.items()} == {
        k: v for k, v in mtimes.items() if k != "c_000"} | {"c_000": [p.stat().st_mtime_ns for p in sorted(folders["c_000"].glob("shard_*"))]}
    assert mtimes["c_000"] != [p.stat().st_mtime_ns for p in sorted(folders["c_000"].glob("shard_*"))]
    assert len(load_shards(folders["c_000"])) == 7


def test_multi_turn_records_train_on_the_last_answer_after_their_context(tmp_path):
    """A record with `context` (earlier turns: the target's own first answer, say) is captured as the whole chat,
    the loss on the last answer only; a malformed context is refused before compute, naming the layout."""
    from eagle_hf.training.data import capture_records
    from eagle_hf.training.sources import DataSourceError, parse_answer_specs

    target, tok = peaky_target(), tiny_tokenizer()
    context = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4 w5"}]
    path = tmp_path / "second_turns.jsonl"
    path.write_text(json.dumps({"idx": 1, "context": context, "prompt": "w6", "response": "w7 w8", "finished": True}) + "\n")
    (record,) = parse_answer_specs([str(path)])[0].records
    capture_records(target, tok, [record], tmp_path / "cap", [2, 3, 4])
    (s,) = load_shards(tmp_path / "cap")
    prompt = render_chat(tok, "w6", context)
    assert prompt[: len(render_chat(tok, "w1 w2"))] == render_chat(tok, "w1 w2")  # the first turn comes first
    answer = tok("w7 w8", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert s["input_ids"].tolist() == prompt + answer
    assert s["loss_mask"].tolist() == [0] * len(prompt) + [1] * len(answer)
    path.write_text(json.dumps({"prompt": "w6", "response": "w7", "context": [{"role": "assistant", "content": "w1"}]}) + "\n")
    with pytest.raises(DataSourceError, match="second_turns.jsonl:1: `context` must be a list of earlier turns"):
        parse_answer_specs([str(path)])


def test_sharegpt_original_answers_follow_the_prompt_order(tmp_path):
    from eagle_hf.training.sources import AnswerSource, original_exchanges, original_records, parse_answer_specs

    n = 3870
    recs = []
    for i in range(n):
        conv = [{"from": "human", "value": f"w{i % 50} w{i % 7}"}]
        if i % 5:
            conv.append({"from": "gpt", "value": f"w{i % 11} w{i % 13}"})
        recs.append({"id": str(i), "conversations": conv})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(recs))
    pairs = original_exchanges(path)
    assert [p for p, _ in pairs] == load_prompts(path, seed=0)  # same indices as load_prompts
    tok = tiny_tokenizer()
    (src,) = parse_answer_specs(["sharegpt-original:4"])
    skip = {n - 1}
    got = original_records(src, tok, pairs, skip)
    want = [i for i in range(n - 2, 3854, -1) if pairs[i][1] is not None][:4]
    assert [r["idx"] for r in got] == want and all(r["response"] == pairs[r["idx"]][1] for r in got)
    ranged = original_records(AnswerSource("x", "x", "original", index_range=(3855, 3865)), tok, pairs, set())
    assert [r["idx"] for r in ranged] == [i for i in range(3855, 3865) if pairs[i][1] is not None]
    for bad in ("sharegpt-original:abc", "sharegpt-original:100-200", "sharegpt-original:0"):
        with pytest.raises(ValueError, match="sharegpt-original"):
            parse_answer_specs([bad])


def test_the_target_start_keeps_every_unrolled_step_at_the_targets_scale():
    """A fresh drafter starts from the target's head. Where the target's final norm scales channels unevenly
    (Gemma 3: 0.19 to 301), the state an EAGLE-3.1 drafter feeds back must not be scaled again at each step: the
    warm-started drafter's steps 0 and 1 give the same logits, the target's head over `fc`'s output at the median
    RMS of the target's final states."""
    from conftest import HIDDEN

    from eagle_hf.training.trainer import initialise_from_target
    from eagle_hf.training.vocab import DraftVocab

    g = torch.Generator().manual_seed(0)
    drafter = tiny_drafter(draft_vocab=32)
    drafter.bind_target_embedding(torch.nn.Embedding(VOCAB, HIDDEN))
    head = torch.randn(32, HIDDEN, generator=g)  # [Vd, H]
    scale = torch.exp(torch.randn(HIDDEN, generator=g) * 2)  # [H]: spread over orders of magnitude
    samples = [{"input_ids": torch.zeros(40, dtype=torch.long), "aux": torch.randn(40, 3 * HIDDEN, generator=g),
                "final": torch.randn(40, HIDDEN, generator=g) * scale} for _ in range(4)]
    vocab = DraftVocab(d2t=torch.zeros(32, dtype=torch.long), t2d=torch.ones(VOCAB, dtype=torch.bool), coverage=1.0)
    initialise_from_target(drafter, samples, vocab, head)
    finals = torch.cat([s["final"][1:39] for s in samples])  # the states `fc` was fitted to
    median_rms = finals.pow(2).mean(-1).sqrt().median()
    torch.testing.assert_close(drafter.norm.weight, torch.full((HIDDEN,), median_rms.item()))
    tokens, positions = torch.tensor([[5, 6, 7]]), torch.arange(3)[None]
    fused = drafter.fuse(samples[0]["aux"][None, :3])  # [1, 3, H]
    first = drafter.step(fused, tokens, positions)
    second = drafter.step(first.hidden, tokens, positions + 1)
    unit = fused * torch.rsqrt(fused.pow(2).mean(-1, keepdim=True) + drafter.config.rms_norm_eps)
    torch.testing.assert_close(first.logits, median_rms * unit @ head.T, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(second.logits, first.logits, rtol=1e-4, atol=1e-4)


def _init_drafter(tmp_path, target):
    init = tiny_drafter(target, draft_vocab=48)
    init.save_pretrained(tmp_path / "init")
    return init


def test_warm_start_keeps_the_drafter_its_vocabulary_and_its_loss(tmp_path):
    from eagle_hf.training.trainer import collate, make_batches, split_heldout

    target, tok = peaky_target(), tiny_tokenizer()
    init = _init_drafter(tmp_path, target)
    path = write_answers(tmp_path / "r.jsonl", 12)
    cfg = TrainConfig(ttt_steps=2, max_steps=1, lr=0.0, tokens_per_batch=100000, bf16=False, eval_every=1,
                      eval_fraction=0.2)
    run = RunConfig(responses=str(path), init_from=str(tmp_path / "init"), data_root=str(tmp_path / "cap"), train=cfg)
    out = run_training(target, tok, tmp_path / "out", run)
    assert out.config.draft_vocab_size == 48 and out.config.fc_norm and out.config.norm_output
    init = init.to(target.device)  # the trained drafter is on the target's device
    assert torch.equal(out.d2t, init.d2t) and torch.equal(out.t2d, init.t2d)
    assert json.loads((tmp_path / "out" / "train_run.json").read_text())["draft_vocab_size"] == 48
    for k, v in init.state_dict().items():  # lr 0: no ridge init, no change (saved in bf16)
        assert torch.equal(out.state_dict()[k], v.to(out.state_dict()[k].dtype)), k
    # the first step's loss is the init drafter's loss on that batch
    (folder,) = (tmp_path / "cap").iterdir()
    samples = load_shards(folder)
    train_idx, _, _ = split_heldout(samples, cfg)
    (batch,) = make_batches([samples[i]["input_ids"].shape[0] for i in train_idx], cfg.tokens_per_batch, 0)
    batch = [train_idx[i] for i in batch]  # one batch holds the whole training split
    head = target.lm_head.weight[torch.arange(48) + init.d2t].detach()
    ids, aux, final, mask, in_vocab = collate(samples, batch, cfg.max_seq_len, head, init.t2d, target.device)
    init.bind_target_embedding(target.get_input_embeddings())
    with torch.no_grad():
        ref = ttt_loss(init, aux, final, head, ids, mask, in_vocab, 2).loss
    log = [json.loads(line) for line in (tmp_path / "out" / "training_log.jsonl").read_text().splitlines()]
    assert log[1]["step"] == 1 and log[1]["loss"] == pytest.approx(float(ref), rel=1e-4)


def test_bad_sources_and_conflicting_warm_start_fail_before_compute(tmp_path):
    from eagle_hf.training.pipeline import validate_run

    target, tok = tiny_target("llama"), tiny_tokenizer()
    _init_drafter(tmp_path, target)
    good = write_answers(tmp_path / "r.jsonl", 4)
    init = str(tmp_path / "init")
    cases = [
        (dict(responses=str(tmp_path / "missing.jsonl")), "no such file"),
        (dict(responses=str(tmp_path / "nothing-*.jsonl")), "no file matches"),
        (dict(responses=[str(good)], data_dir=[str(tmp_path / "no-such-dir")]), "no captured shards"),
        (dict(responses=str(good), init_from=init, draft_vocab_size=32), "draft vocabulary size 32 asked"),
        (dict(responses=str(good), init_from=init, eagle31=False), "EAGLE-3 .--eagle3. asked"),
        (dict(responses=str(good), init_from=init, aux_layer_ids=[1, 2, 3]), "aux layers"),
        (dict(responses=str(good), init_from=str(tmp_path / "nope")), "not a drafter folder"),
    ]
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "w1", "response": "w2"}\nnot json\n')
    cases.append((dict(responses=str(bad_json)), "bad.jsonl:2 is not JSON"))
    cases.append((dict(responses=str(good), train=TrainConfig(feature_noise=-0.1)), "--feature-noise -0.1: must be between"))
    for kw, msg in cases:
        kw = {"draft_vocab_size": 48, **kw} if "init_from" not in kw else kw
        run = RunConfig(data_root=str(tmp_path / "cap"), **kw)
        if "aux_layer_ids" not in kw:  # the default aux layers depend on the target: checked by run_training
            with pytest.raises(ValueError, match=msg):
                validate_run(run)
        with pytest.raises(ValueError, match=msg):
            run_training(target, tok, tmp_path / "out", run)
        assert not (tmp_path / "cap").exists() and not (tmp_path / "out" / "train_state.pt").exists()
