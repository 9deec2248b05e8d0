"""Acceptance measurement on prompt sets (the shared EAGLE evaluation sets ship with the package)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..devices import input_device
from ..speculation.stats import SpecDecodeStats, last_stats, merge_stats
from ..training.prompts import render_messages

logger = logging.getLogger(__name__)

PROMPT_DIR = Path(__file__).resolve().parents[1] / "data" / "prompts"
PROMPT_SETS = ("mt_bench", "humaneval", "gsm8k", "sum", "qa")
#: sets whose answers copy their context (scripts/make_copy_sets.py): code edits of HumanEval functions, and
#: MT-bench second turns after the default target's own first answer (`messages` records: the text is a chat)
COPY_SETS = ("code_edit", "multi_turn")
#: one set per kind of text a user brings (issue #35), written for eagle_hf: translation of short news items
#: from six languages, general questions, math word problems, questions over retrieved passages, extraction
#: from a document
KIND_SETS = ("translation", "questions", "math_word", "rag", "extraction")


def load_prompt_set(name_or_path: str, limit: int | None = None, turn: int = 0) -> list[tuple[str, str | list]]:
    """`(prompt id, text)` pairs of a shipped set (mt_bench, humaneval, gsm8k, sum, qa, code_edit, multi_turn) or a
    JSONL file. For `messages` records the text is the list of chat messages."""
    known = PROMPT_SETS + COPY_SETS + KIND_SETS
    path = PROMPT_DIR / f"{name_or_path}.jsonl" if name_or_path in known else Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(f"No prompt set {name_or_path!r}: use one of {known} or a JSONL file path.")
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("messages"):
            out.append((str(rec.get("question_id", i)), rec["messages"]))
            continue
        turns = rec.get("turns") or [rec.get("prompt")]
        if turn < len(turns) and turns[turn]:
            out.append((str(rec.get("question_id", i)), turns[turn]))
    return out[:limit] if limit else out


def chat_inputs(tokenizer, text: str | list[dict], device) -> dict:
    """The inputs for one user message (a string) or a whole conversation (a list of messages): the chat template
    with its generation prompt, or a pretrained model's plain text (`render_messages`)."""
    messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
    ids = torch.tensor([render_messages(tokenizer, messages)], device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def batch_chat_inputs(tokenizer, texts: list[str | list[dict]], device) -> dict:
    """`chat_inputs` of several prompts as one left-padded batch with its attention mask."""
    rows = [chat_inputs(tokenizer, text, "cpu")["input_ids"][0] for text in texts]
    width = max(r.shape[0] for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - r.shape[0] :], mask[b, width - r.shape[0] :] = r, 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


@torch.no_grad()
def measure_acceptance(target, tokenizer, drafter, prompts, max_new_tokens=256, num_draft_tokens=5, **gen_kwargs) -> SpecDecodeStats:
    """Greedy EAGLE generation over `prompts`; pooled stats (acceptance length, per position, timing)."""
    items = []
    for pid, text in tqdm(prompts, desc="acceptance", leave=False):
        enc = chat_inputs(tokenizer, text, input_device(target))
        target.generate(
            **enc, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False,
            num_assistant_tokens=num_draft_tokens, **gen_kwargs,
        )
        items.append(last_stats())
    return merge_stats(items)
