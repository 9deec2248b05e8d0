"""Acceptance measurement on prompt sets (the shared EAGLE evaluation sets ship with the package)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .stats import SpecDecodeStats, last_stats, merge_stats

logger = logging.getLogger(__name__)

PROMPT_DIR = Path(__file__).resolve().parent / "data" / "prompts"
PROMPT_SETS = ("mt_bench", "humaneval", "gsm8k", "sum", "qa")


def load_prompt_set(name_or_path: str, limit: int | None = None, turn: int = 0) -> list[tuple[str, str]]:
    """`(prompt id, text)` pairs of a shipped set (mt_bench, humaneval, gsm8k, sum, qa) or a JSONL file."""
    path = PROMPT_DIR / f"{name_or_path}.jsonl" if name_or_path in PROMPT_SETS else Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(f"No prompt set {name_or_path!r}: use one of {PROMPT_SETS} or a JSONL file path.")
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        rec = json.loads(line)
        turns = rec.get("turns") or [rec.get("prompt")]
        if turn < len(turns) and turns[turn]:
            out.append((str(rec.get("question_id", i)), turns[turn]))
    return out[:limit] if limit else out


def chat_inputs(tokenizer, text: str, device) -> dict:
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return {k: v.to(device) for k, v in enc.items()}


@torch.no_grad()
def measure_acceptance(target, tokenizer, drafter, prompts, max_new_tokens=256, num_draft_tokens=5, **gen_kwargs) -> SpecDecodeStats:
    """Greedy EAGLE generation over `prompts`; pooled stats (acceptance length, per position, timing)."""
    items = []
    for pid, text in tqdm(prompts, desc="acceptance", leave=False):
        enc = chat_inputs(tokenizer, text, target.device)
        target.generate(
            **enc, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False,
            num_assistant_tokens=num_draft_tokens, **gen_kwargs,
        )
        items.append(last_stats())
    return merge_stats(items)
