"""The quant stage: a bitsandbytes 4-bit and 8-bit target, when the package imports: does EAGLE run, is the output
plain generate()'s, how fast."""

from __future__ import annotations

import importlib.util
import tempfile

import torch

from .common import MODES, Budget, Context, StageResult, _kernel_cases, build_drafter, build_target, prompts


def stage_quant(ctx: Context, budget: Budget) -> StageResult:
    """A bitsandbytes 4-bit and 8-bit target, when the package imports: EAGLE runs, equality, speed."""
    res = StageResult()
    if importlib.util.find_spec("bitsandbytes") is None:
        res["status"], res["summary"] = "skipped", "bitsandbytes is not importable"
        return res
    try:
        import bitsandbytes  # noqa: F401
    except Exception as err:  # noqa: BLE001
        res["status"], res["summary"] = "skipped", f"bitsandbytes does not import: {type(err).__name__}: {err}"[:300]
        return res
    import transformers as tf

    s = ctx.shapes
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        build_target(s.quant, torch.bfloat16, torch.device("cpu"), seed=3).save_pretrained(tmp)
        for bits in (4, 8):
            if not budget.allows(20):
                res["status"] = "partial"
                res.find(f"budget: skipped {bits}-bit")
                continue
            q = (tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16) if bits == 4 else
                 tf.BitsAndBytesConfig(load_in_8bit=True))
            try:
                target = tf.AutoModelForCausalLM.from_pretrained(tmp, quantization_config=q, dtype=torch.bfloat16,
                                                                 device_map=str(ctx.device)).eval()
            except Exception as err:  # noqa: BLE001
                table.append({"bits": bits, "case": "load", "runs": False, "note": f"{type(err).__name__}: {err}"[:200]})
                continue
            target.generation_config.pad_token_id, target.generation_config.eos_token_id = 0, None
            drafter = build_drafter(target, s.draft_vocab if not ctx.small else 1024, seed=4)
            ids, mask = prompts(1, 64 if ctx.small else 512, target.config.vocab_size, seed=41, device=ctx.device,
                                repeat=True)
            table += _kernel_cases(ctx, target, drafter, ids, mask, 16 if ctx.small else 48, MODES, {"bits": bits})
            del target, drafter
            if ctx.cuda:
                torch.cuda.empty_cache()
    res["data"]["runs"] = table
    bad = [r for r in table if not r.get("runs", True) or r.get("equal") is False]
    for r in bad:
        res.find(f"{r['bits']}-bit {r['case']}: {'does not run: ' + r.get('note', '') if not r.get('runs', True) else 'differs from plain'}")
    res["summary"] = f"{len(table) - len(bad)} of {len(table)} runs ran and matched plain"
    return res
