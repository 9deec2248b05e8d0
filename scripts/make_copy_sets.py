"""Build the copy-heavy prompt sets shipped in eagle_hf/data/prompts/ (see its README for licences).

* ``code_edit.jsonl``: every HumanEval prompt completed with its reference solution, and the request to add type
  hints and a docstring and return the whole function (the answer copies most of the prompt).
* ``multi_turn.jsonl``: MT-bench's first turn, the default target's own greedy answer (bf16, at most 192 new
  tokens), then MT-bench's second turn, which refers back to that answer (``messages`` records).

    python scripts/make_copy_sets.py [--multi-turn-limit 24]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm.auto import tqdm

PROMPTS = Path(__file__).resolve().parents[1] / "eagle_hf" / "data" / "prompts"
CODE_EDIT_REQUEST = "Add type hints and a docstring to this function. Return the whole function.\n\n```python\n{code}```"


def code_edit() -> int:
    lines = []
    for line in (PROMPTS / "humaneval.jsonl").read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        code = rec["turns"][0].split("\n", 1)[1].lstrip("\n") + rec["reference"][0]
        lines.append(json.dumps({"question_id": rec["question_id"], "category": "code_edit",
                                 "turns": [CODE_EDIT_REQUEST.format(code=code)]}))
    (PROMPTS / "code_edit.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(lines)


def multi_turn(limit: int, max_new_tokens: int = 192) -> int:
    import torch

    import eagle_hf
    from eagle_hf.tools.evaluation import chat_inputs

    target, tok = eagle_hf.load_target("default")
    drafter, _ = eagle_hf.load_drafter("default", target)
    out_path = PROMPTS / "multi_turn.jsonl"
    done = [json.loads(x) for x in out_path.read_text().splitlines()] if out_path.exists() else []
    records = [json.loads(x) for x in (PROMPTS / "mt_bench.jsonl").read_text(encoding="utf-8").splitlines()]
    records = [r for r in records if len(r["turns"]) > 1][:limit]
    with out_path.open("a", encoding="utf-8") as f:
        for rec in tqdm(records[len(done):], desc="first answers"):
            enc = chat_inputs(tok, rec["turns"][0], target.device)
            with torch.no_grad():
                ids = target.generate(**enc, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False)
            answer = tok.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
            messages = [{"role": "user", "content": rec["turns"][0]}, {"role": "assistant", "content": answer},
                        {"role": "user", "content": rec["turns"][1]}]
            f.write(json.dumps({"question_id": rec["question_id"], "category": rec.get("category"),
                                "messages": messages}) + "\n")
            f.flush()
    return len(records)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--multi-turn-limit", type=int, default=24, help="MT-bench conversations to answer (default 24)")
    args = p.parse_args()
    print(f"code_edit: {code_edit()} prompts")
    print(f"multi_turn: {multi_turn(args.multi_turn_limit)} conversations")


if __name__ == "__main__":
    main()
