"""vLLM against eagle_hf on the same prompts: what `benchmarks/serve_with_vllm.py` served, compared (docs/serving.md).

vLLM pins an older transformers than eagle_hf needs, so the two run in separate virtual environments and meet in
JSON files. This script runs in the project's venv; `serve_with_vllm.py` runs in vLLM's:

    # 1. the float32 target copy vLLM reads, the prompts as token ids, plain generate() and eagle_hf's chain of 5
    .venv/bin/python benchmarks/vllm_comparison.py prepare --out runs/vllm --drafter shipped=default \
        --drafter trained=runs/vllm-drafter
    # 2. vLLM serves each drafter (its own venv, see serve_with_vllm.py)
    /path/to/vllm-venv/bin/python benchmarks/serve_with_vllm.py --work runs/vllm --name shipped \
        --drafter eagle_hf/assets/smollm2-135m-eagle3.1
    # 3. the comparison: outputs against plain generate(), acceptance against eagle_hf's (--work repeatable:
    #    folders prepared side by side, one drafter each, whose plain outputs must agree)
    .venv/bin/python benchmarks/vllm_comparison.py compare --work runs/vllm --out docs/results/vllm_serving.json

`prepare` writes `<out>/target/` (the embedded SmolLM2-135M-Instruct de-quantized from its GGUF to float32, with
its tokenizer), `<out>/prompts.json` (the chat-template token ids of the first `--limit` MT-bench prompts, the
stop tokens, the number of new tokens) and `<out>/reference.json` (plain greedy `generate()` tokens per prompt;
per drafter, eagle_hf's greedy chain of `--num-draft-tokens` and its pooled acceptance; a rerun with the same
settings keeps what reference.json holds and adds the drafters it lacks). `compare` reads those and
each `<work>/vllm_<name>.json` and writes one JSON with every figure (`compare_run`, tested on a saved run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def strip_stop(tokens: list[int], stop_ids: list[int]) -> list[int]:
    """`tokens` without a trailing stop token: generate() keeps the EOS it stopped at, vLLM's token ids may not."""
    return tokens[:-1] if tokens and tokens[-1] in stop_ids else tokens


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where `a` and `b` differ (the shorter length when one is a prefix of the other), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(reference: dict[str, list[int]], served: dict[str, list[int]], stop_ids: list[int]) -> dict:
    """Per prompt id: does the served output equal the reference token for token (trailing stop token aside), and
    where do they first differ."""
    rows = {}
    for pid, ref in reference.items():
        if pid not in served:
            raise KeyError(f"prompt {pid!r} has a reference output but no served output")
        a, b = strip_stop(ref, stop_ids), strip_stop(served[pid], stop_ids)
        diff = first_difference(a, b)
        rows[pid] = {"equal": diff is None, "first_difference": diff, "reference_tokens": len(a), "served_tokens": len(b)}
    return {"equal": sum(r["equal"] for r in rows.values()), "prompts": len(rows), "per_prompt": rows}


def vllm_acceptance(metrics: dict) -> dict:
    """Mean acceptance length and per-position acceptance from vLLM's spec-decode counters.

    `metrics` holds `num_drafts` (verification rounds), `num_draft_tokens`, `num_accepted_tokens` and
    `num_accepted_tokens_per_pos` (position i: rounds whose draft i was accepted). Per position: the share of
    rounds whose draft i was accepted (a chain's draft i counts only when drafts 0..i-1 were); mean acceptance
    length: tokens per round, the target's own token counted (the EAGLE papers' tau)."""
    drafts = metrics["num_drafts"]
    if not drafts:
        return {"rounds": 0, "mean_acceptance_length": 0.0, "acceptance_per_position": []}
    return {
        "rounds": drafts,
        "drafted": metrics["num_draft_tokens"],
        "accepted": metrics["num_accepted_tokens"],
        "mean_acceptance_length": 1 + metrics["num_accepted_tokens"] / drafts,
        "acceptance_per_position": [a / drafts for a in metrics["num_accepted_tokens_per_pos"]],
    }


def compare_run(reference: dict, served: dict[str, dict]) -> dict:
    """Everything `compare` reports: per drafter, vLLM's outputs against plain generate() (and eagle_hf's against
    it), and vLLM's acceptance beside eagle_hf's. `reference` is prepare's reference.json, `served` maps a drafter's
    name to serve_with_vllm.py's JSON."""
    stop_ids = reference["stop_token_ids"]
    plain = reference["plain"]
    out = {"prompts": len(plain), "max_new_tokens": reference["max_new_tokens"],
           "num_draft_tokens": reference["num_draft_tokens"], "drafters": {}}
    for name, run in served.items():
        row = {"vllm_version": run.get("vllm_version"), "drafter": run.get("drafter")}
        row["vllm_vs_plain"] = compare_outputs(plain, run["outputs"], stop_ids)
        if run.get("speculative"):
            row["vllm"] = vllm_acceptance(run["spec_decode"])
        ours = reference["drafters"].get(name)
        if ours is not None:
            row["eagle_hf_vs_plain"] = compare_outputs(plain, ours["outputs"], stop_ids)
            row["eagle_hf"] = {k: ours["stats"][k] for k in
                               ("cycles", "drafted", "accepted", "mean_acceptance_length", "acceptance_per_position")}
        out["drafters"][name] = row
    return out


def _equal_cell(comparison: dict | None) -> str:
    return f"{comparison['equal']}/{comparison['prompts']}" if comparison else "-"


def _tau_cell(acceptance: dict | None) -> str:
    return f"{acceptance['mean_acceptance_length']:.2f}" if acceptance else "-"


def _positions_cell(acceptance: dict | None) -> str:
    return ", ".join(f"{a:.2f}" for a in acceptance["acceptance_per_position"]) if acceptance else "-"


def markdown(result: dict) -> str:
    """The comparison as a Markdown table (docs/serving.md)."""
    lines = [("| drafter | vLLM = plain generate() | eagle_hf = plain generate() | vLLM τ | eagle_hf τ | "
              "vLLM acceptance at draft 1..5 | eagle_hf acceptance at draft 1..5 |"),
             "|---|---|---|---|---|---|---|"]
    for name, row in result["drafters"].items():
        lines.append(f"| {name} | {_equal_cell(row.get('vllm_vs_plain'))} | {_equal_cell(row.get('eagle_hf_vs_plain'))} "
                     f"| {_tau_cell(row.get('vllm'))} | {_tau_cell(row.get('eagle_hf'))} "
                     f"| {_positions_cell(row.get('vllm'))} | {_positions_cell(row.get('eagle_hf'))} |")
    return "\n".join(lines)


def prepare(args) -> None:
    import torch

    import eagle_hf
    from eagle_hf.speculation.stats import last_stats, merge_stats
    from eagle_hf.tools.evaluation import chat_inputs, load_prompt_set

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    drafters = dict(spec.split("=", 1) for spec in args.drafter)
    for name, path in drafters.items():  # before any compute
        if path != "default" and not (Path(path) / "config.json").is_file():
            raise SystemExit(f"--drafter {name}={path}: no drafter there (no config.json); pass a saved drafter folder")
    torch.manual_seed(0)
    target, tok = eagle_hf.load_target("default", dtype=torch.float32)
    # a plain float32 checkpoint vLLM can read: de-quantized already, so no GGUF quantization config
    target.hf_quantizer = None
    if hasattr(target.config, "quantization_config"):
        del target.config.quantization_config
    target.save_pretrained(out / "target")
    tok.save_pretrained(out / "target")
    stop_ids = list(target.generation_config.eos_token_id)
    prompts = load_prompt_set(args.prompts, limit=args.limit)
    inputs = {pid: chat_inputs(tok, text, "cpu") for pid, text in prompts}
    (out / "prompts.json").write_text(json.dumps({
        "prompt_set": args.prompts, "max_new_tokens": args.max_new_tokens, "stop_token_ids": stop_ids,
        "prompts": [{"id": pid, "input_ids": enc["input_ids"][0].tolist()} for pid, enc in inputs.items()]}, indent=1))

    def new_tokens(pid, **kwargs):
        enc = inputs[pid]
        ids = target.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False, **kwargs)
        return ids[0, enc["input_ids"].shape[1]:].tolist()

    settings = {"prompt_set": args.prompts, "max_new_tokens": args.max_new_tokens, "stop_token_ids": stop_ids,
                "num_draft_tokens": args.num_draft_tokens, "target_dtype": str(target.dtype),
                "transformers_version": __import__("transformers").__version__}
    reference = json.loads((out / "reference.json").read_text()) if (out / "reference.json").is_file() else {}
    if any(reference.get(k) != v for k, v in settings.items()) or set(reference.get("plain", {})) != set(inputs):
        reference = {**settings, "plain": {pid: new_tokens(pid) for pid in inputs}, "drafters": {}}
    for name, path in drafters.items():
        if reference["drafters"].get(name, {}).get("drafter") == path:  # a rerun adds the drafters it lacks
            continue
        drafter = eagle_hf.EagleDrafter.from_pretrained(eagle_hf.DEFAULT_DRAFTER if path == "default" else path)
        outputs, stats = {}, []
        for pid in inputs:
            outputs[pid] = new_tokens(pid, assistant_model=drafter, draft_mode="chain",
                                      num_assistant_tokens=args.num_draft_tokens)
            stats.append(last_stats())
        s = merge_stats(stats)
        reference["drafters"][name] = {"drafter": path, "outputs": outputs, "stats": {
            "cycles": s.cycles, "drafted": s.drafted, "accepted": s.accepted,
            "mean_acceptance_length": s.mean_acceptance_length, "acceptance_per_position": s.acceptance_per_position}}
        print(name, json.dumps(reference["drafters"][name]["stats"]), flush=True)
        (out / "reference.json").write_text(json.dumps(reference, indent=1))
    (out / "reference.json").write_text(json.dumps(reference, indent=1))


def merge_references(references: list[dict]) -> dict:
    """One reference from several `prepare` folders (e.g. one per drafter, run side by side): their settings and
    plain generate() outputs must agree; their drafters are pooled."""
    merged = {**references[0], "drafters": {}}
    for ref in references:
        differ = [k for k, v in merged.items() if k != "drafters" and ref.get(k) != v]
        if differ:
            raise ValueError(f"The reference folders disagree on {differ}: compare runs made with the same settings")
        merged["drafters"].update(ref["drafters"])
    return merged


def compare(args) -> None:
    works = [Path(w) for w in args.work]
    reference = merge_references([json.loads((w / "reference.json").read_text()) for w in works])
    served = {p.stem.removeprefix("vllm_"): json.loads(p.read_text())
              for w in works for p in sorted(w.glob("vllm_*.json"))}
    if not served:
        raise SystemExit(f"No vllm_<name>.json in {', '.join(map(str, works))}: "
                         "run benchmarks/serve_with_vllm.py first")
    result = compare_run(reference, served)
    result["reference"], result["served"] = reference, served  # the raw outputs, so the comparison can be redone
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(markdown(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("prepare", help="target copy, prompts, plain generate() and eagle_hf's chain (project venv)")
    a.add_argument("--out", required=True, help="working folder shared with serve_with_vllm.py")
    a.add_argument("--drafter", action="append", default=[], metavar="NAME=PATH",
                   help="a drafter to run eagle_hf's chain with ('default': the shipped one); repeatable")
    a.add_argument("--prompts", default="mt_bench", help="a shipped prompt set or a JSONL file")
    a.add_argument("--limit", type=int, default=8, help="prompts taken from the set")
    a.add_argument("--max-new-tokens", type=int, default=64)
    a.add_argument("--num-draft-tokens", type=int, default=5, help="the chain's length")
    a.set_defaults(func=prepare)
    c = sub.add_parser("compare", help="vLLM's outputs and acceptance against the reference (project venv)")
    c.add_argument("--work", required=True, action="append",
                   help="a folder prepare and serve_with_vllm.py wrote; repeatable (their plain outputs must agree)")
    c.add_argument("--out", required=True, help="the JSON file to write")
    c.set_defaults(func=compare)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
