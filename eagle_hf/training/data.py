"""Self-distillation data: the target answers the prompts, and its hidden states are stored for training.

Each shard (``shard_00000.safetensors``) holds a batch of conversations, concatenated:

* ``input_ids``  ``[N]`` int32: prompt + response tokens of every sample, back to back;
* ``aux``        ``[N, num_aux * H_t]`` bf16: the target's aux taps at every position;
* ``final``      ``[N, H_t]`` bf16: the target's final-normed hidden state (its logits are ``lm_head(final)``);
* ``loss_mask``  ``[N]`` uint8: 1 on response (assistant) tokens;
* ``offsets``    ``[S + 1]`` int64: sample boundaries.

The last token of a sample was never fed to the target, so its feature rows are zeros; the trainer never reads
them. Shards are written atomically and skipped when present, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..drafter.capture import gather_aux, hidden_state_request
from ..files import tensor_bytes, write_file
from ..hf.version import cache_kwarg
from .distributed import Processes

logger = logging.getLogger(__name__)

META_FILE = "data_meta.json"


@torch.no_grad()
def generate_with_capture(
    target,
    prompts: Sequence[Sequence[int]],
    aux_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Batched decoding of `prompts` (left-padded) that records aux taps and final hidden states on the way."""
    from transformers import DynamicCache

    device = target.device
    bsz = len(prompts)
    plen = max(len(p) for p in prompts)
    ids = torch.full((bsz, plen), pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros((bsz, plen), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, plen - len(p) :] = torch.tensor(p, device=device)
        mask[i, plen - len(p) :] = 1
    request = hidden_state_request(aux_ids, with_final=True)
    cache = DynamicCache(config=target.config)
    eos = torch.tensor(list(eos_token_ids), device=device)
    finished = torch.zeros(bsz, dtype=torch.bool, device=device)
    aux_chunks, final_chunks, tokens = [], [], [ids]
    step_ids, step_mask = ids, mask
    for _ in range(max_new_tokens):
        positions = (step_mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]  # [B, t]
        out = target(
            input_ids=step_ids,
            attention_mask=step_mask,
            position_ids=positions,
            **cache_kwarg(cache),
            use_cache=True,
            output_hidden_states=request,
            logits_to_keep=1,
        )
        aux_chunks.append(gather_aux(out.hidden_states, aux_ids).to(torch.bfloat16).cpu())
        final_chunks.append(out.hidden_states[-1].to(torch.bfloat16).cpu())
        logits = out.logits[:, -1].float()  # [B, V]
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            nxt = logits.argmax(-1)
        nxt = torch.where(finished, torch.full_like(nxt, pad_token_id), nxt)
        tokens.append(nxt[:, None])
        step_mask = torch.cat([step_mask, (~finished).long()[:, None]], dim=1)
        finished |= torch.isin(nxt, eos)
        step_ids = nxt[:, None]
        if bool(finished.all()):
            break
    all_ids = torch.cat(tokens, dim=1).cpu()  # [B, plen + steps]
    aux = torch.cat(aux_chunks, dim=1)  # [B, plen + steps - 1, A]
    final = torch.cat(final_chunks, dim=1)
    samples = []
    for i in range(bsz):
        start = plen - len(prompts[i])
        resp = all_ids[i, plen:].tolist()
        # keep the response up to and including its first EOS
        n_resp = len(resp)
        for j, tok in enumerate(resp):
            if tok in eos_token_ids:
                n_resp = j + 1
                break
        end = plen + n_resp
        seq = all_ids[i, start:end]
        t = seq.shape[0]
        a = torch.zeros((t, aux.shape[-1]), dtype=torch.bfloat16)
        f = torch.zeros((t, final.shape[-1]), dtype=torch.bfloat16)
        a[: t - 1] = aux[i, start : end - 1]
        f[: t - 1] = final[i, start : end - 1]
        lm = torch.zeros(t, dtype=torch.uint8)
        lm[len(prompts[i]) :] = 1
        samples.append({"input_ids": seq.to(torch.int32), "aux": a, "final": f, "loss_mask": lm})
    return samples


def pack_shard(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    lengths = torch.tensor([s["input_ids"].shape[0] for s in samples])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return {
        "input_ids": torch.cat([s["input_ids"] for s in samples]),
        "aux": torch.cat([s["aux"] for s in samples]),
        "final": torch.cat([s["final"] for s in samples]),
        "loss_mask": torch.cat([s["loss_mask"] for s in samples]),
        "offsets": offsets,
    }


def unpack_shard(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    off = tensors["offsets"].tolist()
    keys = ("input_ids", "aux", "final", "loss_mask")
    return [{k: tensors[k][off[i] : off[i + 1]] for k in keys} for i in range(len(off) - 1)]


def build_dataset(
    target,
    tokenizer,
    prompts: Sequence[str],
    out_dir: str | Path,
    aux_ids: Sequence[int],
    batch_size: int = 64,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 256,
    temperature: float = 0.0,
    seed: int = 0,
    procs: Processes | None = None,
) -> Path:
    """Regenerate answers with the target and store hidden states, shard by shard (resumable).

    Shard i answers prompts ``[i * batch_size, (i + 1) * batch_size)``; with sampling it draws from its own seed
    (`shard_seed`), so a shard's answers do not depend on which process made it or on the shards made before.
    With several processes (`procs`) process r makes the missing shards i with ``i % N == r``; the main process
    then lists every shard, with the process that made it, in ``data_meta.json``.
    """
    from .prompts import render_chat

    procs = procs or Processes()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "target": getattr(target.config, "name_or_path", None) or target.name_or_path,
        "aux_layer_ids": list(aux_ids),
        "num_prompts": len(prompts),
        "batch_size": batch_size,
        "max_new_tokens": max_new_tokens,
        "max_prompt_tokens": max_prompt_tokens,
        "temperature": temperature,
        "seed": seed,
    }
    meta_path = out / META_FILE
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        changed = {k: (old.get(k), v) for k, v in meta.items() if k != "num_prompts" and old.get(k) != v}
        if changed:
            raise ValueError(f"{out} holds data generated with other settings {changed}; use a new folder.")
    made = dict(old.get("shards", {})) if meta_path.exists() else {}
    procs.barrier()  # every process has read the old manifest
    if procs.main:
        write_file(meta_path, json.dumps(meta, indent=2))

    encoded = [render_chat(tokenizer, p) for p in prompts]
    encoded = [e for e in encoded if len(e) <= max_prompt_tokens]
    logger.info("%d of %d prompts fit in %d tokens", len(encoded), len(prompts), max_prompt_tokens)
    eos = target.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("Neither the target's generation_config nor its tokenizer names an EOS token.")
    eos = [eos] if isinstance(eos, int) else list(eos)
    pad = target.generation_config.pad_token_id
    pad = eos[0] if pad is None else pad
    n_shards = (len(encoded) + batch_size - 1) // batch_size
    names = [f"shard_{shard:05d}.safetensors" for shard in range(n_shards)]
    mine = {}
    made_tokens, t0 = 0, time.perf_counter()
    bar = tqdm(range(procs.rank, n_shards, procs.world), desc="regenerating", unit="shard", disable=not procs.main)
    for shard in bar:
        path = out / names[shard]
        if path.exists():
            continue
        batch = encoded[shard * batch_size : (shard + 1) * batch_size]
        gen = torch.Generator(device=target.device).manual_seed(shard_seed(seed, shard))
        samples = generate_with_capture(target, batch, aux_ids, max_new_tokens, eos, pad, temperature, gen)
        _write_shard(path, samples)
        mine[path.name] = {"process": procs.rank, "conversations": len(samples),
                           "rows": sum(int(s["input_ids"].shape[0]) for s in samples)}
        made_tokens += sum(int(s["loss_mask"].sum()) for s in samples)
        rate = made_tokens / (time.perf_counter() - t0)
        bar.set_postfix(resp_tok=made_tokens, tok_per_s=f"{rate:.0f}")
        logger.info("shard %d: %d response tokens so far, %.0f tok/s", shard, made_tokens, rate)
    for part in procs.gather(mine):
        made.update(part)
    if procs.main:
        write_file(meta_path, json.dumps({**meta, "shards": {n: made.get(n, {}) for n in names}}, indent=1))
    procs.barrier()  # the manifest and every shard are written before any process reads them
    return out


def shard_seed(seed: int, shard: int) -> int:
    """The sampling seed of one regenerated shard."""
    return seed * 1_000_003 + shard


def load_shards(data_dir: str | Path) -> list[dict[str, torch.Tensor]]:
    """All samples of a data folder (memory-mapped safetensors shards)."""
    paths = sorted(Path(data_dir).glob("shard_*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"No data shards (shard_*.safetensors) in {data_dir}.")
    samples = []
    for p in paths:
        samples.extend(unpack_shard(load_file(str(p))))
    return samples


def _capture_sample(target, tokenizer, request, aux_ids, prompt: str, response: str, finished: bool | None,
                    max_tokens: int, max_answer_tokens: int | None = None,
                    context: list[dict] | None = None) -> dict[str, torch.Tensor]:
    """One teacher-forced target forward over `prompt` (chat-rendered after the earlier turns of `context`, which
    are not trained on) + `response`; returns one sample.

    EOS is appended unless `finished` is False (an answer cut at the generation limit did not end there) or the
    answer is cut to `max_answer_tokens`.
    """
    from .prompts import render_chat

    p_ids = render_chat(tokenizer, prompt, context)
    r_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    if max_answer_tokens is not None and len(r_ids) >= max_answer_tokens:
        r_ids, finished = r_ids[:max_answer_tokens], False
    if tokenizer.eos_token_id is not None and finished is not False:
        r_ids = r_ids + [tokenizer.eos_token_id]
    ids = torch.tensor([(p_ids + r_ids)[:max_tokens]], device=target.device)
    o = target(input_ids=ids, output_hidden_states=request, logits_to_keep=1)  # (the states are what it keeps)
    t = ids.shape[1]
    aux = gather_aux(o.hidden_states, aux_ids)[0].to(torch.bfloat16).cpu()
    final = o.hidden_states[-1][0].to(torch.bfloat16).cpu()
    aux[t - 1] = 0  # as in generated data: the last token's features are never used
    final[t - 1] = 0
    mask = torch.zeros(t, dtype=torch.uint8)
    mask[len(p_ids) :] = 1
    return {"input_ids": ids[0].cpu().to(torch.int32), "aux": aux, "final": final, "loss_mask": mask}


def _write_shard(path: Path, samples) -> None:
    packed = pack_shard(samples)
    write_file(path, lambda tmp: save_file(packed, str(tmp)), size=tensor_bytes(packed))


@torch.no_grad()
def build_dataset_from_responses(
    target,
    tokenizer,
    conversations: Sequence[tuple[str, str]],
    out_dir: str | Path,
    aux_ids: Sequence[int],
    shard_size: int = 64,
    max_tokens: int = 1024,
) -> Path:
    """Store hidden states for answers produced elsewhere (e.g. by a vLLM server): `(prompt, response)` pairs.

    One teacher-forced target forward per conversation captures the aux taps and the final hidden state; the loss
    mask covers the response. Shards are written and skipped exactly as in `build_dataset`. (`capture_records`
    is the content-checked variant that `eagle-hf train --responses` uses.)
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    request = hidden_state_request(aux_ids, with_final=True)
    n_shards = (len(conversations) + shard_size - 1) // shard_size
    for shard in tqdm(range(n_shards), desc="capturing", unit="shard"):
        path = out / f"shard_{shard:05d}.safetensors"
        if path.exists():
            continue
        samples = [
            _capture_sample(target, tokenizer, request, aux_ids, prompt, response, None, max_tokens)
            for prompt, response in conversations[shard * shard_size : (shard + 1) * shard_size]
        ]
        _write_shard(path, samples)
    return out


CAPTURE_FILE = "capture.json"
PART_GLOB = "capture.part*.json"  # one process's captured shards, until the main process merges them


def records_digest(records: Sequence[dict]) -> str:
    """Content hash of answer records (prompt, response, finished): what a capture shard was made from."""
    h = hashlib.sha256()
    for r in records:
        fields = [r["prompt"], r["response"], r.get("finished")] + ([r["context"]] if r.get("context") else [])
        h.update(json.dumps(fields, ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


@torch.no_grad()
def capture_records(
    target,
    tokenizer,
    records: Sequence[dict],
    out_dir: str | Path,
    aux_ids: Sequence[int],
    meta: dict | None = None,
    shard_size: int = 64,
    max_tokens: int = 1024,
    max_answer_tokens: int | None = None,
    procs: Processes | None = None,
) -> Path:
    """Capture hidden states of answer records (`prompt`, `response`, optional `finished`) into `out_dir`.

    Like `build_dataset_from_responses`, but every shard's source records are hashed into ``capture.json``: a
    shard is reused only when the records it was made from are unchanged (a growing ``.partial`` file recaptures
    just its last, grown shard), stale shards are recaptured and shards past the end removed. `meta` (source,
    kind) is stored in the manifest; a folder captured for another target or other aux layers is refused.

    With several processes (`procs`) each captures every N-th shard still to do and records it in its own
    ``capture.part<rank>.json``; the main process merges them into ``capture.json`` at the end (and a rerun after
    a crash reads the parts, so it skips the shards any process finished).
    """
    procs = procs or Processes()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / CAPTURE_FILE
    settings = {
        "target": getattr(target, "name_or_path", None) or getattr(target.config, "name_or_path", None),
        "aux_layer_ids": list(aux_ids),
        "shard_size": shard_size,
        "max_tokens": max_tokens,
        "max_answer_tokens": max_answer_tokens,
    }
    manifest = {**(meta or {}), **settings, "shards": {}}
    if manifest_path.exists():
        old = json.loads(manifest_path.read_text())
        changed = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
        if changed:
            raise ValueError(f"{out} holds a capture made with other settings {changed}; use another data root.")
        manifest["shards"] = dict(old.get("shards", {}))
    for part in sorted(out.glob(PART_GLOB)):  # shards finished by the processes of an interrupted run
        old = json.loads(part.read_text())
        if all(old.get(k) == v for k, v in settings.items()):
            manifest["shards"].update(old.get("shards", {}))
    n_shards = (len(records) + shard_size - 1) // shard_size
    names = [f"shard_{i:05d}.safetensors" for i in range(n_shards)]
    for extra in sorted(out.glob("shard_*.safetensors")):
        if extra.name not in names:  # the source shrank or was rewritten
            if procs.main:
                extra.unlink()
            manifest["shards"].pop(extra.name, None)
    request = hidden_state_request(aux_ids, with_final=True)
    todo = []
    for i, name in enumerate(names):
        digest = records_digest(records[i * shard_size : (i + 1) * shard_size])
        if (out / name).exists() and manifest["shards"].get(name) == digest:
            continue
        todo.append((i, name, digest))
    if todo:
        logger.info("%s: capturing %d of %d shards", out.name, len(todo), n_shards)
    procs.barrier()  # every process has read the manifests and planned the same shards
    progress = manifest_path if procs.world == 1 else out / f"capture.part{procs.rank}.json"
    t0, done_tokens = time.perf_counter(), 0
    for i, name, digest in tqdm(todo[procs.rank :: procs.world], desc=f"capturing {out.name}", unit="shard",
                                disable=not procs.main):
        chunk = records[i * shard_size : (i + 1) * shard_size]
        samples = [
            _capture_sample(target, tokenizer, request, aux_ids, r["prompt"], r["response"], r.get("finished"),
                            max_tokens, max_answer_tokens, r.get("context"))
            for r in chunk
        ]
        _write_shard(out / name, samples)
        manifest["shards"][name] = digest  # a crash before this is saved only costs a recapture of the shard
        write_file(progress, json.dumps({**manifest, "num_records": len(records), "complete": False}, indent=1))
        done_tokens += sum(int(s["input_ids"].shape[0]) for s in samples)
        logger.info("%s %s: %d records, %.0f captured tok/s", out.name, name, len(chunk),
                    done_tokens / (time.perf_counter() - t0))
    for i, name, digest in todo:  # what the other processes captured
        manifest["shards"][name] = digest
    rows = sum(procs.gather(done_tokens))  # (waits for every process's shards)
    if todo and procs.main:
        seconds = time.perf_counter() - t0
        logger.info("%s: captured %d rows in %.1f s, %.0f rows/s (%d process%s)", out.name, rows, seconds,
                    rows / seconds, procs.world, "es" if procs.world > 1 else "")
    if procs.main:
        manifest["shards"] = {n: manifest["shards"][n] for n in names}
        write_file(manifest_path, json.dumps({**manifest, "num_records": len(records), "complete": True,
                                              **({"processes": procs.world} if procs.world > 1 else {})}, indent=1))
        for part in out.glob(PART_GLOB):
            part.unlink()
    procs.barrier()  # the merged manifest is written before any process reads the folder
    return out

