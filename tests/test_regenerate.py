"""scripts/regenerate.py: the continuous-batching (refill) decoder and the resumable chunk store."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

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
    render = lambda s: [1, 2, 3, 4][: 4 if s == "q110" else 2]  # noqa: E731  (q110 is too long)
    items = list(regenerate.eligible_prompts(prompts, render, 98, again.done | {111}, 3))
    assert [idx for idx, _ in items] == [98, 99, 107, 108, 109]
    again.add({"idx": 100, "prompt": "dup", "response": "dup", "finished": False})  # already done: ignored
    again.add({"idx": 107, "prompt": "q", "response": "r", "finished": False})
    again.add({"idx": 108, "prompt": "q", "response": "r", "finished": False})
    again.close()
    assert sorted(p.name for p in tmp_path.iterdir())[-1] == "sharegpt_first_turns_002.jsonl.gz"
    with gzip.open(tmp_path / "sharegpt_first_turns_002.jsonl.gz", "rt") as f:
        assert [json.loads(line)["idx"] for line in f] == [106, 107, 108]
    assert regenerate.ChunkStore(tmp_path, chunk_size=3).done == set(range(100, 109))
