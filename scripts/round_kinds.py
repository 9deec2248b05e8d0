"""Where the default mode's time goes against copy drafting alone's, by kind of round (issue 35).

Runs copy alone and the default on one prompt set, interleaved per prompt, and sorts every round of every call by
its kind: a plain step (``fallback``, ``final``), copies alone, the drafter alone, or both (where the drafter drafts,
why: its rounds pay, a first try, a paced try, or it joins copies where its margin pays). Per kind: rounds, wall
seconds (from the end of the previous round to the end of this one: the whole loop's time, the forwards included),
tokens emitted (accepted drafts + 1). In float32 both modes write plain `generate()`'s text, so the two calls of a
prompt differ only in how they drafted it.

    python scripts/round_kinds.py OUT.json [--dtype float32] [--prompts translation] [--limit 20]

Not run by the tests (it loads the embedded SmolLM2 and the shipped drafter); docs/benchmarks.md reads its output.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch

from eagle_hf.drafter.default import load_drafter, load_target
from eagle_hf.speculation import speculator
from eagle_hf.speculation.schedule import DraftLengthController
from eagle_hf.tools.evaluation import chat_inputs, load_prompt_set

PLAIN = ("fallback", "final")


def record_rounds(log: list):
    """Wrap `Speculator.end_round`: append (kind, seconds since the last round ended, tokens emitted) to `log`.
    Returns `new_call()`, to call before each generate() (it clears the log; a call's prefill starts its clock)."""
    original = speculator.Speculator.end_round
    last = {"t": None}
    choose, probe_due = DraftLengthController.choose, DraftLengthController._probe_due

    def choose_noting(self):  # why the controller drafts: its rounds pay, a first try, or a paced try (probe)
        self.why = None
        depth = choose(self)
        if depth > 0 and self.why is None:
            self.why = "pays" if self._drafting else "first try"
        return depth

    def probe_noting(self, k, gain):
        due = probe_due(self, k, gain)
        if due:
            self.why = "try"
        return due

    def end_round(self, accepted, last_token, path=None, cut=False):
        kind = self.round
        if kind == "draft":
            copies = self.copy is not None and bool(self.copy.branches)
            kind = {(True, True): "both", (True, False): "drafter alone"}.get((self.eagle_depth > 0, copies),
                                                                            "copies alone")
            if self.eagle_depth > 0 and self.controller is not None:
                kind += f" ({getattr(self.controller, 'why', None) or 'joins copies'})"
        record = original(self, accepted, last_token, path, cut)
        now = time.perf_counter()
        if kind != "prefill" and last["t"] is not None:
            log.append((kind, now - last["t"], 1 if kind in PLAIN else accepted + 1))
        last["t"] = now
        return record

    def new_call() -> None:
        log.clear()
        last["t"] = None

    speculator.Speculator.end_round = end_round
    DraftLengthController.choose, DraftLengthController._probe_due = choose_noting, probe_noting
    return new_call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", default="translation")
    p.add_argument("--limit", type=int, default=20)
    args = p.parse_args()
    target, tok = load_target("default", dtype=getattr(torch, args.dtype))
    drafter, _ = load_drafter("default", target)
    modes = {"copy alone": {"draft_sources": "copy"}, "default": {"assistant_model": drafter}}
    log: list = []
    new_call = record_rounds(log)
    warm = chat_inputs(tok, "Hello!", target.device)
    for kwargs in modes.values():  # first-call allocations, the costs' first measurements
        target.generate(**warm, max_new_tokens=16, do_sample=False, **kwargs)
    totals = {m: collections.defaultdict(lambda: [0, 0.0, 0]) for m in modes}
    calls: dict[str, list] = {m: [] for m in modes}
    for i, (_, text) in enumerate(load_prompt_set(args.prompts, limit=args.limit)):
        enc = chat_inputs(tok, text, target.device)
        for m in list(modes) if i % 2 == 0 else list(reversed(modes)):
            new_call()
            start = time.perf_counter()
            target.generate(**enc, max_new_tokens=128, do_sample=False, **modes[m])
            per_call = collections.defaultdict(lambda: [0, 0.0, 0])
            for kind, seconds, tokens in log:
                for agg in (totals[m][kind], per_call[kind]):
                    agg[0], agg[1], agg[2] = agg[0] + 1, agg[1] + seconds, agg[2] + tokens
            calls[m].append({"total_s": time.perf_counter() - start, "kinds": dict(per_call)})
        print(i, {m: round(calls[m][-1]["total_s"], 2) for m in modes}, flush=True)
    summary = {m: {k: {"rounds": n, "seconds": round(s, 3), "tokens": t, "ms_per_round": round(1e3 * s / n, 1),
                       "tokens_per_s": round(t / s, 1)} for k, (n, s, t) in totals[m].items()} for m in modes}
    with open(args.out, "w") as f:
        json.dump({"settings": vars(args), "summary": summary, "calls": calls}, f, indent=1)
    for m in modes:
        print(f"{m}: {sum(c['total_s'] for c in calls[m]):.2f} s")
        for kind, row in sorted(summary[m].items()):
            print(f"    {kind}: {row}")


if __name__ == "__main__":
    main()
