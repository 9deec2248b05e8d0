"""Trace the copy source's proposals, round by round (issue 35): why copy drafting decodes a round plainly (no match
in the context, or a match whose branch would not pay), and which of its branches (by rank: the most recent,
longest match first) supplied the accepted tokens. Runs `eagle-hf bench` with the given arguments and records
every `CopySource.propose` and its outcome.

    python benchmarks/copy_trace.py OUT.json --prompts translation --limit 6 --max-new-tokens 128 --temperature 0.7 \\
        --modes "copy alone"
    python benchmarks/copy_trace.py OUT.json --prompts math_word --limit 6 --max-new-tokens 128 --modes "copy alone" \\
        --mode 'copy4={"draft_sources": "copy", "copy_branches": 4}'
"""

from __future__ import annotations

import collections
import json
import os
import sys


def summary(rounds: list[dict]) -> dict:
    """Rounds by what the copy source did, and the rank of the branch that reached furthest where one hit."""
    kinds = collections.Counter("no match" if not r["matches"] else "matched, nothing drafted" if not r["branches"]
                                else "drafted" for r in rounds)
    ranks = collections.Counter()
    for r in rounds:
        hits = r.get("hits")
        if hits and max(hits) > 0:
            ranks[f"rank {hits.index(max(hits))}"] += 1
            ranks["a later rank hit where the first missed"] += hits[0] == 0
    return {"rounds": dict(kinds), "hit rounds by the best branch's rank": dict(ranks)}


def trace(out: str, bench_args: list[str]) -> dict:
    from eagle_hf.cli import main
    from eagle_hf.speculation import copying

    rounds: list[dict] = []
    propose, update = copying.CopySource.propose, copying.CopySource.update

    def proposing(self, room, *args, **kwargs):
        matches = self.index.matches(self.num_branches, min(self.length, room))
        proposal = propose(self, room, *args, **kwargs)
        rounds.append({"source": id(self), "matches": [n for _, n in matches],
                       "branches": [len(b.tokens) for b in proposal.branches]})
        return proposal

    def updating(self, taken):
        if rounds and rounds[-1]["source"] == id(self):
            rounds[-1]["hits"] = [copying._common_prefix(b.tokens, taken) for b in self.branches]
        return update(self, taken)

    copying.CopySource.propose, copying.CopySource.update = proposing, updating
    cache = os.environ.get("EAGLE_HF_COST_CACHE")  # (learnt costs off for the trace; the caller's setting kept)
    os.environ.setdefault("EAGLE_HF_COST_CACHE", "off")
    try:
        main(["bench", "--dtype", "bfloat16", *bench_args, "--out", out + ".bench"])
    finally:
        copying.CopySource.propose, copying.CopySource.update = propose, update
        if cache is None:
            os.environ.pop("EAGLE_HF_COST_CACHE", None)
    result = summary(rounds)
    with open(out, "w") as f:
        json.dump({"summary": result, "rounds": rounds}, f)
    return result


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    print(json.dumps(trace(sys.argv[1], sys.argv[2:]), indent=1))
