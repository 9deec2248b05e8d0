#!/usr/bin/env python
"""Regenerate self-distillation answers at scale: the default target answers ShareGPT first user turns.

Resumable and append-only: answers go to gzipped JSONL chunks in ``data/regenerated/``
(``sharegpt_first_turns_NNN.jsonl.gz``, ``--chunk-size`` answers each); the chunk being filled is
``sharegpt_first_turns_NNN.jsonl.partial`` (one fsync'ed line per answer) and is gzipped to its final name
once full. Rerunning the same command reads back every chunk (and the partial one), skips every `idx`
already answered there or in the shared file (``--skip``), and carries on. SIGSTOP/SIGCONT are harmless;
SIGTERM/SIGINT lose only the answers still in flight.

Throughput: plain batched ``generate()`` keeps every row running until the longest ends. This script
instead decodes greedily with its own continuous-batching loop over one KV cache: a row that ends (EOS or
``--max-new-tokens``) is written out and dropped from the cache at once, and freshly prefilled prompts take
the freed slots (their caches left-padded to the batch's length; leading columns that no row uses any more
are trimmed). Every decoded token is an answer token. ``--mode baseline`` runs plain batched
``generate()`` on the same prompts, for measuring (with ``--dry-run``).

Output records (identical to ``data/smollm2_sharegpt_responses.jsonl.gz``): ``idx`` (index in
``load_prompts("sharegpt", seed=0, shuffle=True)``), ``prompt``, ``response`` (special tokens removed),
``finished`` (the answer ended with EOS within the limit).

``--turn 2``: multi-turn contexts. The target answers the *second* user turn of the ShareGPT conversations whose
first turn it already answered (``--first-turns``: the shared answers and ``sharegpt_first_turns_*``, finished
answers only), after its own first answer: records gain ``context`` (the first user turn and the target's
answer), ``prompt`` is the second user turn; chunks are ``sharegpt_second_turns_NNN``. ``eagle-hf train
--responses 'data/regenerated/sharegpt_second_turns_*'`` trains on the second answers in that context.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

logger = logging.getLogger("regenerate")

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "data" / "regenerated"
DEFAULT_SKIP = REPO / "data" / "smollm2_sharegpt_responses.jsonl.gz"
CHUNK_PREFIX = "sharegpt_first_turns_"
CHUNK_PREFIXES = {1: CHUNK_PREFIX, 2: "sharegpt_second_turns_"}  # per --turn


# --------------------------------------------------------------------------------------------------------
# Continuous-batching greedy decoding
# --------------------------------------------------------------------------------------------------------


def _left_pad(x: torch.Tensor, length: int) -> torch.Tensor:
    """Pad dim -2 (sequence) of a `[B, H, S, D]` cache tensor on the left with zeros to `length`."""
    missing = length - x.shape[-2]
    return x if missing == 0 else torch.nn.functional.pad(x, (0, 0, missing, 0))


class RefillDecoder:
    """Greedy decoding of a stream of prompts with at most `batch_size` rows in flight.

    Each row's answer is exactly what `model.generate(prompt, do_sample=False, max_new_tokens=...)` gives
    for that prompt alone (up to floating-point differences from padding/batch shapes, which can flip
    near-ties in bf16). Only models whose cache is a plain `DynamicCache` of full-attention layers are
    supported (Llama, Qwen2, Mistral without sliding window, ...).
    """

    def __init__(self, model, batch_size: int, max_new_tokens: int, eos_token_ids: Iterable[int],
                 refill_min: int = 1):
        self.model = model
        self.batch_size = int(batch_size)
        self.max_new_tokens = int(max_new_tokens)
        self.eos = {int(e) for e in eos_token_ids}
        self.refill_min = max(1, int(refill_min))
        self.device = next(model.parameters()).device
        self.decoded_tokens = 0  # every token this decoder produced (all are answer tokens, EOS included)

    @torch.inference_mode()
    def _forward(self, input_ids, attention_mask=None, position_ids=None, cache=None):
        from eagle_hf.hf.version import cache_kwarg, output_cache

        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         **cache_kwarg(cache), use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :].argmax(dim=-1), output_cache(out)

    def _prefill(self, ids: list[int]):
        from transformers import DynamicCache

        cache = DynamicCache()
        tok, cache = self._forward(torch.tensor([ids], device=self.device), cache=cache)
        for layer in cache.layers:
            if type(layer).__name__ != "DynamicLayer":
                raise NotImplementedError(f"RefillDecoder supports full-attention DynamicCache layers only, got {type(layer).__name__}")
        return int(tok[0]), cache

    def run(self, items: Iterable[tuple[object, list[int]]]) -> Iterator[tuple[object, list[int], bool]]:
        """Yield `(key, new_token_ids, finished)` for every `(key, prompt_ids)` of `items`, in finishing order.

        `new_token_ids` includes the EOS token when `finished`.
        """
        source = iter(items)
        exhausted = False
        cache = None  # DynamicCache over the rows in flight
        mask = None  # [B, L] long: 1 where the cache column is a real token of that row
        keys: list[object] = []
        gens: list[list[int]] = []
        lengths: list[int] = []  # real tokens in the cache per row
        pending = None  # [B] the last token of each row, not yet in the cache

        while True:
            # ---- refill freed slots
            free = self.batch_size - len(keys)
            if not exhausted and free >= (self.refill_min if keys else 1):
                new = []
                while len(new) < free:
                    try:
                        key, ids = next(source)
                    except StopIteration:
                        exhausted = True
                        break
                    ids = list(ids)
                    tok, c = self._prefill(ids)
                    self.decoded_tokens += 1
                    if tok in self.eos or self.max_new_tokens <= 1:
                        yield key, [tok], tok in self.eos
                        continue
                    new.append((key, ids, tok, c))
                if new:
                    old_len = mask.shape[1] if keys else 0
                    length = max([old_len] + [len(ids) for _, ids, _, _ in new])
                    parts_mask = []
                    if keys:
                        parts_mask.append(torch.nn.functional.pad(mask, (length - old_len, 0)))
                    for _, ids, _, _ in new:
                        m = torch.zeros(1, length, dtype=torch.long, device=self.device)
                        m[0, length - len(ids):] = 1
                        parts_mask.append(m)
                    if cache is None:
                        cache = new[0][3]
                        base = []
                    else:
                        base = [(layer.keys, layer.values) for layer in cache.layers]
                    for li, layer in enumerate(cache.layers):
                        ks = [_left_pad(base[li][0], length)] if base else []
                        vs = [_left_pad(base[li][1], length)] if base else []
                        for _, _, _, c in new:
                            ks.append(_left_pad(c.layers[li].keys, length))
                            vs.append(_left_pad(c.layers[li].values, length))
                        layer.keys = torch.cat(ks, dim=0)
                        layer.values = torch.cat(vs, dim=0)
                    mask = torch.cat(parts_mask, dim=0)
                    new_pending = torch.tensor([t for _, _, t, _ in new], device=self.device)
                    pending = new_pending if pending is None or not keys else torch.cat([pending, new_pending])
                    for key, ids, tok, _ in new:
                        keys.append(key)
                        gens.append([tok])
                        lengths.append(len(ids))
            if not keys:
                if exhausted:
                    return
                continue

            # ---- one decoding step for every row in flight
            mask = torch.cat([mask, torch.ones(len(keys), 1, dtype=mask.dtype, device=self.device)], dim=1)
            pos = torch.tensor(lengths, device=self.device)[:, None]
            nxt, cache = self._forward(pending[:, None], attention_mask=mask, position_ids=pos, cache=cache)
            self.decoded_tokens += len(keys)
            nxt_list = nxt.tolist()
            keep = []
            for i, tok in enumerate(nxt_list):
                lengths[i] += 1
                gens[i].append(tok)
                if tok in self.eos:
                    yield keys[i], gens[i], True
                elif len(gens[i]) >= self.max_new_tokens:
                    yield keys[i], gens[i], False
                else:
                    keep.append(i)
            pending = nxt
            if len(keep) < len(keys):
                if keep:
                    idx = torch.tensor(keep, device=self.device)
                    cache.batch_select_indices(idx)
                    mask = mask[idx]
                    pending = pending[idx]
                    # drop leading columns no remaining row uses
                    used = mask.any(dim=0).nonzero()
                    first = int(used[0]) if len(used) else 0
                    if first > 0:
                        mask = mask[:, first:]
                        for layer in cache.layers:
                            layer.keys = layer.keys[:, :, first:, :]
                            layer.values = layer.values[:, :, first:, :]
                else:
                    cache = None
                    mask = None
                    pending = None
                keys = [keys[i] for i in keep]
                gens = [gens[i] for i in keep]
                lengths = [lengths[i] for i in keep]


class _StepLogger:
    """A stopping criterion that never stops: logs the answer tokens produced so far inside one `generate()`."""

    def __init__(self, prompt_len: int, eos: set[int], every: float):
        self.prompt_len, self.eos, self.every = prompt_len, torch.tensor(sorted(eos)), every
        self.t0 = self.last = time.perf_counter()

    def __call__(self, input_ids, scores, **kwargs):
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            gen = input_ids[:, self.prompt_len:]
            hit = torch.isin(gen, self.eos)
            ended = hit.cumsum(1) - hit.long() > 0  # positions after a row's EOS (padding)
            useful = int((~ended & ~hit).sum())
            logger.info("baseline batch: step %d, answer tokens so far %d, %.1f answer tok/s (an upper bound for "
                        "the whole batch), rows still running %d", gen.shape[1], useful,
                        useful / (now - self.t0), int((~(ended | hit)[:, -1]).sum()))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def baseline_generate(model, items: Iterable[tuple[object, list[int]]], batch_size: int, max_new_tokens: int,
                      eos_token_ids: Iterable[int], pad_token_id: int, log_every: float | None = None,
                      ) -> Iterator[tuple[object, list[int], bool]]:
    """Plain batched `generate()` (left padded, greedy), `batch_size` prompts at a time, for comparison."""
    eos = {int(e) for e in eos_token_ids}
    device = next(model.parameters()).device
    items = list(items)
    for start in range(0, len(items), batch_size):
        batch = items[start:start + batch_size]
        length = max(len(ids) for _, ids in batch)
        input_ids = torch.full((len(batch), length), pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(batch), length), dtype=torch.long)
        for i, (_, ids) in enumerate(batch):
            input_ids[i, length - len(ids):] = torch.tensor(ids)
            attn[i, length - len(ids):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids.to(device), attention_mask=attn.to(device), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=pad_token_id,
                                 stopping_criteria=[_StepLogger(length, eos, log_every)] if log_every else None)
        for (key, _), row in zip(batch, out[:, length:].tolist()):
            gen = []
            for tok in row:
                gen.append(tok)
                if tok in eos:
                    break
            yield key, gen, bool(gen) and gen[-1] in eos


# --------------------------------------------------------------------------------------------------------
# Append-only chunk store
# --------------------------------------------------------------------------------------------------------


def _read_jsonl_lines(lines: Iterable[str]) -> tuple[list[dict], int]:
    records, bad = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(rec, dict) and "idx" in rec:
            records.append(rec)
        else:
            bad += 1
    return records, bad


class ChunkStore:
    """`NNN.jsonl.gz` chunks of `chunk_size` answers plus one `.partial` JSONL being filled."""

    def __init__(self, out_dir: str | Path, chunk_size: int = 500, prefix: str = CHUNK_PREFIX):
        self.dir = Path(out_dir)
        self.chunk_size = int(chunk_size)
        self.prefix = prefix
        self._chunk_re = re.compile(re.escape(prefix) + r"(\d+)\.jsonl(\.gz|\.partial)$")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.done: set[int] = set()
        self.records = 0
        self._current = None  # chunk number of the partial file
        self._count = 0  # records in the partial file
        self._fh = None
        self._recover()

    def _path(self, n: int, kind: str) -> Path:
        return self.dir / f"{self.prefix}{n:03d}.jsonl{kind}"

    def _recover(self) -> None:
        gz, partial = {}, {}
        for path in self.dir.iterdir():
            m = self._chunk_re.fullmatch(path.name)
            if m:
                (gz if m.group(2) == ".gz" else partial)[int(m.group(1))] = path
        for n in sorted(gz):
            with gzip.open(gz[n], "rt", encoding="utf-8") as f:
                recs, bad = _read_jsonl_lines(f)
            if bad:
                logger.warning("%s: %d unreadable lines ignored", gz[n], bad)
            self._add_done(recs)
        for n in sorted(partial):
            path = partial[n]
            if n in gz:  # crashed after gzipping, before removing the partial
                path.unlink()
                continue
            recs, bad = _read_jsonl_lines(path.read_text(encoding="utf-8").splitlines())
            recs = [r for r in recs if int(r["idx"]) not in self.done]
            if bad:  # a line cut by a crash: rewrite the partial without it
                logger.warning("%s: %d unreadable lines dropped (interrupted write)", path, bad)
                self._atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
            self._add_done(recs)
            if len(recs) >= self.chunk_size:
                self._finalize(n, recs)
            elif self._current is None:
                self._current, self._count = n, len(recs)
            else:  # a second partial (should not happen): fold it into the current one
                self._open()
                for r in recs:
                    self._append_line(r)
                path.unlink()
        if self._current is None:
            self._current = max(list(gz) + list(partial) + [-1]) + 1
            self._count = 0

    def _add_done(self, recs: list[dict]) -> None:
        for r in recs:
            self.done.add(int(r["idx"]))
        self.records += len(recs)

    @staticmethod
    def _atomic_write_text(path: Path, text: str) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)

    def _finalize(self, n: int, recs: list[dict]) -> None:
        final = self._path(n, ".gz")
        tmp = final.with_name(final.name + ".tmp")
        with open(tmp, "wb") as raw:
            # mtime=0: the same records give the same bytes
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
                gz.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs).encode("utf-8"))
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, final)
        partial = self._path(n, ".partial")
        if partial.exists():
            partial.unlink()
        logger.info("Chunk %s written (%d answers)", final.name, len(recs))

    def _open(self) -> None:
        if self._fh is None:
            self._fh = open(self._path(self._current, ".partial"), "a", encoding="utf-8")  # noqa: SIM115

    def _append_line(self, rec: dict) -> None:
        self._fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._count += 1

    def add(self, rec: dict) -> None:
        idx = int(rec["idx"])
        if idx in self.done:
            return
        self._open()
        self._append_line(rec)
        self.done.add(idx)
        self.records += 1
        if self._count >= self.chunk_size:
            self._fh.close()
            self._fh = None
            path = self._path(self._current, ".partial")
            recs, _ = _read_jsonl_lines(path.read_text(encoding="utf-8").splitlines())
            self._finalize(self._current, recs)
            self._current += 1
            self._count = 0

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_skip_idx(path: str | Path) -> set[int]:
    path = Path(path)
    text = gzip.decompress(path.read_bytes()).decode("utf-8") if path.suffix == ".gz" else path.read_text("utf-8")
    recs, _ = _read_jsonl_lines(text.splitlines())
    return {int(r["idx"]) for r in recs}


def eligible_prompts(prompts: list[str] | dict[int, str], render: Callable[[int], list[int]], start: int,
                     done: set[int], max_prompt_tokens: int, limit: int | None = None) -> Iterator[tuple[int, list[int]]]:
    """`(idx, prompt_ids)` in index order from `start`, skipping `done` and prompts over `max_prompt_tokens`
    (`prompts`: a list, or idx -> prompt; `render(idx)`: the prompt's chat-rendered ids)."""
    count = 0
    indices = range(start, len(prompts)) if isinstance(prompts, list) else sorted(i for i in prompts if i >= start)
    for idx in indices:
        if idx in done:
            continue
        if len(prompts[idx]) > 8 * max_prompt_tokens:  # certainly too long (tokens are >= 1 char mostly)
            continue
        ids = render(idx)
        if len(ids) > max_prompt_tokens:
            continue
        yield idx, ids
        count += 1
        if limit is not None and count >= limit:
            return


def read_first_turns(paths: Iterable[str | Path]) -> dict[int, dict]:
    """idx -> first-turn answer record, the finished ones (ended with EOS) of every file (JSONL, .gz, .partial)."""
    from eagle_hf.training.sources import read_answer_file

    answers = {}
    for path in paths:
        for rec in read_answer_file(Path(path)):
            if rec.get("idx") is not None and rec.get("finished") is not False:
                answers[int(rec["idx"])] = rec
    return answers


def second_turn_prompts(first: dict[int, dict], conversations: list[tuple[str, dict]], done: set[int]
                        ) -> Iterator[tuple[int, list[dict], str]]:
    """`(idx, context, second user turn)` for the conversations of `first` that go on, in index order."""
    from eagle_hf.training.sources import second_user_turn

    for idx in sorted(first):
        if idx in done or idx >= len(conversations):
            continue
        text, record = conversations[idx]
        if text != first[idx]["prompt"].strip():  # another ShareGPT file or order: never mix conversations
            raise SystemExit(f"idx {idx}: the first-turn answer's prompt is not conversation {idx}'s first turn")
        follow = second_user_turn(record)
        if follow:
            yield idx, [{"role": "user", "content": text}, {"role": "assistant", "content": first[idx]["response"]}], follow


# --------------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default=str(DEFAULT_OUT))
    p.add_argument("--skip", action="append", default=None,
                   help=f"JSONL whose `idx` values are already answered (repeatable; default {DEFAULT_SKIP})")
    p.add_argument("--start", type=int, default=3855, help="first prompt index (the first shipped drafter used 0..3854)")
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--refill-min", type=int, default=4, help="prefill new prompts once this many slots are free")
    p.add_argument("--max-new-tokens", type=int, default=320)
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest chat-rendered prompt, context included (default 384; 768 with --turn 2)")
    p.add_argument("--turn", type=int, choices=[1, 2], default=1,
                   help="1: first user turns; 2: second user turns after the target's own first answer")
    p.add_argument("--first-turns", action="append", default=None,
                   help="--turn 2: first-turn answer files/globs (default: the shared answers and "
                        "data/regenerated/sharegpt_first_turns_*)")
    p.add_argument("--chunk-size", type=int, default=500)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--limit", type=int, default=None, help="stop after this many prompts")
    p.add_argument("--max-seconds", type=float, default=None, help="stop after this long (measuring)")
    p.add_argument("--mode", choices=["refill", "baseline"], default="refill")
    p.add_argument("--dry-run", action="store_true", help="write nothing (measuring)")
    p.add_argument("--log-every", type=float, default=60.0, help="seconds between progress lines")
    args = p.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout,
                        force=True)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from eagle_hf import load_target
    from eagle_hf.training.prompts import load_prompts, render_chat

    if args.max_prompt_tokens is None:
        args.max_prompt_tokens = 384 if args.turn == 1 else 768
    skip_files = args.skip if args.skip is not None else ([str(DEFAULT_SKIP)] if args.turn == 1 else [])
    done: set[int] = set()
    for path in skip_files:
        if not Path(path).is_file():
            p.error(f"--skip file {path} is missing; without it already-answered prompts would be answered again "
                    f"(pass --skip for each file of answered idx, or --skip /dev/null deliberately)")
        done |= read_skip_idx(path) if Path(path).stat().st_size else set()
    store = None if args.dry_run else ChunkStore(args.out_dir, args.chunk_size, CHUNK_PREFIXES[args.turn])
    if store is not None:
        logger.info("Resuming: %d answers already in %s; %d idx skipped from %s", store.records, args.out_dir,
                    len(done), skip_files)
        done |= store.done

    dtype = getattr(torch, args.dtype)
    model, tokenizer = load_target("default", dtype=dtype)
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    pad = model.generation_config.pad_token_id
    contexts: dict[int, list[dict]] = {}
    if args.turn == 1:
        prompts = load_prompts("sharegpt", seed=0, shuffle=True)
        logger.info("%d ShareGPT prompts; starting at %d; %s, batch %d, mode %s", len(prompts), args.start,
                    args.dtype, args.batch_size, args.mode)
        items = eligible_prompts(prompts, lambda i: render_chat(tokenizer, prompts[i]), args.start, done,
                                 args.max_prompt_tokens, args.limit)
    else:
        import glob

        from eagle_hf.training.sources import sharegpt_records

        patterns = args.first_turns or [str(DEFAULT_SKIP), str(Path(args.out_dir) / f"{CHUNK_PREFIX}*")]
        first = read_first_turns(sorted(p for pattern in patterns for p in glob.glob(pattern)))
        conversations = sharegpt_records("sharegpt", seed=0)
        prompts = {}
        for idx, context, follow in second_turn_prompts(first, conversations, done):
            prompts[idx], contexts[idx] = follow, context
        logger.info("%d finished first-turn answers, %d conversations with a second turn left; %s, batch %d",
                    len(first), len(prompts), args.dtype, args.batch_size)
        items = eligible_prompts(prompts, lambda i: render_chat(tokenizer, prompts[i], contexts[i]),
                                 args.start, done, args.max_prompt_tokens, args.limit)

    if args.mode == "refill":
        decoder = RefillDecoder(model, args.batch_size, args.max_new_tokens, eos, refill_min=args.refill_min)
        stream = decoder.run(items)
    else:
        decoder = None
        stream = baseline_generate(model, items, args.batch_size, args.max_new_tokens, eos, pad, args.log_every)

    t0 = time.perf_counter()
    last_log = t0
    answers = tokens = finished = 0

    def progress(final: bool = False) -> None:
        el = time.perf_counter() - t0
        msg = (f"answers {answers} ({finished} finished), answer tokens {tokens}, {tokens / max(el, 1e-9):.1f} answer tok/s"
               f" over {el:.0f}s")
        if decoder is not None:
            msg += f"; decoded {decoder.decoded_tokens} ({decoder.decoded_tokens / max(el, 1e-9):.1f} tok/s incl. rows in flight)"
        if store is not None:
            msg += f"; {store.records} answers in {args.out_dir}"
        logger.info("%s%s", "DONE " if final else "", msg)

    def heartbeat() -> None:  # progress lines even while no answer ends (long prefills, a busy CPU)
        nonlocal last_log
        while True:
            time.sleep(min(5.0, args.log_every))
            now = time.perf_counter()
            if args.max_seconds is not None and now - t0 >= args.max_seconds:
                progress(final=True)
                logging.shutdown()
                if store is not None:
                    store.close()
                os._exit(0)
            if now - last_log >= args.log_every:
                last_log = now
                progress()

    threading.Thread(target=heartbeat, daemon=True).start()
    try:
        for idx, gen, fin in stream:
            n_tok = len(gen) - (1 if fin else 0)
            answers += 1
            finished += int(fin)
            tokens += n_tok
            if store is not None:
                context = {"context": contexts[idx]} if idx in contexts else {}
                store.add({"idx": idx, **context, "prompt": prompts[idx],
                           "response": tokenizer.decode(gen, skip_special_tokens=True), "finished": bool(fin)})
    except KeyboardInterrupt:
        logger.info("Interrupted")
    finally:
        progress(final=True)
        if store is not None:
            store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
