"""scripts/regenerate.py: the continuous-batching (refill) decoder and the resumable chunk store."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_target

_SPEC = importlib.util.spec_from_file_location("regenerate", Path(__file__).resolve().parent.parent / "scripts" / "regenerate.py")
regenerate = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(regenerate)

MAX_NEW = 12


def _plain(model, ids, max_new, eos):
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_refill_matches_single_prompt_generate(one_thread):
    model = tiny_target("llama", seed=3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 96, (int(n),), generator=g).tolist() for n in torch.randint(2, 20, (11,), generator=g)]
    # an EOS that some answers hit early, so rows leave the batch at different steps
    free_run = [_plain(model, ids, MAX_NEW, None) for ids in prompts]
    counts = torch.bincount(torch.tensor([t for r in free_run for t in r[1:MAX_NEW - 2]]), minlength=96)
    eos = int(counts.argmax())
    refs = {i: _plain(model, ids, MAX_NEW, eos) for i, ids in enumerate(prompts)}
    refs = {i: r[: r.index(eos) + 1] if eos in r else r for i, r in refs.items()}
    assert 0 < sum(r[-1] == eos for r in refs.values()) < len(refs)

    for batch_size, refill_min in [(4, 1), (3, 2), (16, 1)]:
        dec = regenerate.RefillDecoder(model, batch_size, MAX_NEW, [eos], refill_min=refill_min)
        got = {}
        for key, gen, fin in dec.run(enumerate(prompts)):
            assert key not in got
            got[key] = gen
            assert fin == (gen[-1] == eos)
        assert got == refs, (batch_size, refill_min)


def test_chunk_store_resume_skips_done(tmp_path):
    store = regenerate.ChunkStore(tmp_path, chunk_size=3)
    for i in range(7):
        store.add({"idx": 100 + i, "prompt": f"p{i}", "response": f"r{i}", "finished": True})
    store.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["sharegpt_first_turns_000.jsonl.gz", "sharegpt_first_turns_001.jsonl.gz",
                     "sharegpt_first_turns_002.jsonl.partial"]
    with gzip.open(tmp_path / names[0], "rt") as f:
        assert [json.loads(line)["idx"] for line in f] == [100, 101, 102]
    # a crash cut the last line of the partial chunk
    partial = tmp_path / names[2]
    partial.write_text(partial.read_text() + '{"idx": 107, "prom')

    again = regenerate.ChunkStore(tmp_path, chunk_size=3)
    assert again.done == set(range(100, 107)) and again.records == 7
    prompts = [f"q{i}" for i in range(112)]
    render = lambda i: [1, 2, 3, 4][: 4 if prompts[i] == "q110" else 2]
    items = list(regenerate.eligible_prompts(prompts, render, 98, again.done | {111}, 3))
    assert [idx for idx, _ in items] == [98, 99, 107, 108, 109]
    again.add({"idx": 100, "prompt": "dup", "response": "dup", "finished": False})  # already done: ignored
    again.add({"idx": 107, "prompt": "q", "response": "r", "finished": False})
    again.add({"idx": 108, "prompt": "q", "response": "r", "finished": False})
    again.close()
    assert max(p.name for p in tmp_path.iterdir()) == "sharegpt_first_turns_002.jsonl.gz"
    with gzip.open(tmp_path / "sharegpt_first_turns_002.jsonl.gz", "rt") as f:
        assert [json.loads(line)["idx"] for line in f] == [106, 107, 108]
    assert regenerate.ChunkStore(tmp_path, chunk_size=3).done == set(range(100, 109))


def test_second_turns_follow_the_targets_own_first_answers(tmp_path):
    """--turn 2: the conversations of finished first-turn answers that go on, with the first exchange as context
    (the target's answer, not ShareGPT's), in their own chunks; a first-turn file of other conversations stops."""
    first = tmp_path / "first.jsonl"
    first.write_text("\n".join(json.dumps(r) for r in [
        {"idx": 0, "prompt": "u0", "response": "ours0", "finished": True},
        {"idx": 1, "prompt": "u1", "response": "ours1", "finished": False},  # cut: no context for a second turn
        {"idx": 2, "prompt": "u2", "response": "ours2", "finished": True},  # its conversation ends after one exchange
        {"idx": 3, "prompt": "u3", "response": "ours3", "finished": True}]) + "\n")
    turns = lambda i, n: [{"from": ("human", "gpt")[k % 2], "value": f"{'ug'[k % 2]}{i}.{k}"} for k in range(n)]
    conversations = [(f"u{i}", {"conversations": turns(i, 2 if i == 2 else 4)}) for i in range(4)]
    for i in range(4):
        conversations[i][1]["conversations"][0]["value"] = f"u{i}"
    answers = regenerate.read_first_turns([first])
    got = list(regenerate.second_turn_prompts(answers, conversations, done={3}))
    assert got == [(0, [{"role": "user", "content": "u0"}, {"role": "assistant", "content": "ours0"}], "u0.2")]
    store = regenerate.ChunkStore(tmp_path / "out", chunk_size=2, prefix=regenerate.CHUNK_PREFIXES[2])
    store.add({"idx": 0, "context": got[0][1], "prompt": "u0.2", "response": "r", "finished": True})
    store.close()
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["sharegpt_second_turns_000.jsonl.partial"]
    conversations[3] = ("other", conversations[3][1])
    with pytest.raises(SystemExit, match="idx 3: the first-turn answer's prompt is not conversation 3's"):
        list(regenerate.second_turn_prompts(answers, conversations, done=set()))
