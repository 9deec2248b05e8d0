"""Cost of the copy source per round at long contexts: index update for the round's new tokens plus one lookup.

    python benchmarks/copy_source_cost.py   # prints microseconds per round at 1k, 4k and 16k context tokens
"""

from __future__ import annotations

import json
import statistics
import time

from eagle_hf.drafter.default import load_default_target
from eagle_hf.speculation.copying import CopySource
from eagle_hf.tools.evaluation import PROMPT_DIR


def main() -> None:
    _, tok = load_default_target()
    text = " ".join(json.loads(x)["turns"][0] for x in (PROMPT_DIR / "sum.jsonl").read_text().splitlines())
    ids = tok(text, add_special_tokens=False)["input_ids"]
    print(f"{len(ids)} tokens of CNN/DailyMail text available")
    for context in (1024, 4096, 16384):
        src = CopySource(max_ngram=4, length=16, num_branches=2, marginal_cost=lambda n: 0.02)
        start = time.perf_counter()
        src.index.extend(ids[:context])
        build = time.perf_counter() - start
        rounds = []
        for r in range(500):  # rounds of 3 new tokens each (a typical accepted length), continuing the text
            new = ids[context + 3 * r : context + 3 * r + 3]
            t0 = time.perf_counter()
            src.index.extend(new)
            src.propose(room=64, verified=16)
            rounds.append(time.perf_counter() - t0)
        print(f"context {context:6d}: index built in {build * 1e3:.1f} ms; per round (3 new tokens + lookup) "
              f"median {statistics.median(rounds) * 1e6:.0f} us, p90 {statistics.quantiles(rounds, n=10)[-1] * 1e6:.0f} us")


if __name__ == "__main__":
    main()
