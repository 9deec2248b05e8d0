"""Every causal LM transformers ships, tiny, with an EAGLE drafter: the same output as plain generate(), or why not.

Each architecture in transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` is built from its config, tiny (hidden 64,
4 layers, a 512-token vocabulary, windows and chunks of 8; `OVERRIDES` where a family needs other fields), with
random weights in float32, and a drafter from `EagleDrafter.for_target`. Each case (`CASES`) runs greedy
generate() with the drafter (or copy drafting alone) against plain generate() on the same inputs. A cell is:

* ``spec``: equal, and it speculated (drafts were verified)
* ``plain``: equal, decoded plainly, with the reason logged (a warning, the first time for a model; listed below
  the table)
* ``silent``: equal, no drafts verified and no warning (the schedule may have chosen plain rounds)
* ``DIFFERS``: the output is not plain generate()'s
* ``CRASH``: it raised where plain generate() did not
* ``n/a``: plain generate() itself raised on this input (the error is listed)

Families that cannot be built tiny or need other inputs are skipped by name (`SKIPS`). tests/test_model_zoo.py
runs one family of each kind through the same cases.

    nice -n 19 .venv/bin/python benchmarks/model_zoo.py --out docs/results/model_zoo.md
    .venv/bin/python benchmarks/model_zoo.py --only gpt_neo,mamba --cases tree
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import eagle_hf  # (installs the generate() hooks)
from eagle_hf import EagleDrafter
from eagle_hf.hf import hooks

VOCAB = 512
#: the tiny size every family gets (a family's config ignores the fields it does not have)
TINY = dict(
    hidden_size=64, num_hidden_layers=4, vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, head_dim=16, sliding_window=8, attention_chunk_size=8, max_position_embeddings=512,
    bos_token_id=1, eos_token_id=None, pad_token_id=0, decoder_start_token_id=0, tie_word_embeddings=False,
    decoder_layers=4, encoder_layers=4, decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=128,
    encoder_ffn_dim=128, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16, rotary_dim=8, index_topk=4,
    index_head_dim=16, index_n_heads=4, n_group=1, topk_group=1, shared_experts_intermediate_size=32,
    num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
)
#: per family, the fields its config needs besides (or instead of) `TINY`
OVERRIDES: dict[str, dict] = {
    **{family: {"num_key_value_heads": 4}  # (multi-head latent attention: a key per head)
       for family in ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa", "youtu", "axk1",
                      "axk2", "dory")},
    "gpt_neo": {"window_size": 8, "attention_types": [[["global", "local"], 2]]},
    "dots1": {"n_shared_experts": 1},
    "bamba": {"attn_layer_indices": [1, 3]},
    "falcon_h1": {"mamba_chunk_size": 8},  # (a several-token forward pads to a chunk: 256 by default)
    "nemotron_h": {"chunk_size": 8},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba", "attention"]},
    "zaya": {"num_experts_per_tok": 1},
    "xlnet": {"d_head": 16},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "mamba2": {"num_heads": 8, "n_groups": 1},
    "dbrx": {"d_model": 64, "n_heads": 4, "n_layers": 4, "max_seq_len": 512,
             "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0},
             "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}},
    "gemma3n_text": {"num_kv_shared_layers": 0},
    "cohere_compass_text": {"rope_parameters": {t: {"rope_type": "default", "rope_theta": 10000.0}
                                                for t in ("full_attention", "sliding_attention")}},
}
#: families not run, with the reason
SKIPS: dict[str, str] = {
    **dict.fromkeys(("fuyu", "got_ocr2", "gemma4_assistant", "gemma4_unified_assistant", "moss_transcribe_diarize"),
                    "AutoConfig.for_model cannot build its config without a checkpoint"),
    **dict.fromkeys(("gemma3", "git", "phi4_multimodal", "dots3_note"),
                    "multimodal: its vision tower has no tiny default (its text model is in the zoo where it has one)"),
    "gemma3n": "its vision tower needs the timm package",
    "blt": "byte-level patches: a patcher and vocabulary-sized hash tables in sub-configs with no tiny default",
    "dots3_note_text": "97M parameters at the tiny size (sub-layer fields with no tiny default)",
    **dict.fromkeys(("musicgen", "musicgen_melody"), "decodes audio codebooks (its config nests a decoder config)"),
    **dict.fromkeys(("qwen4_exp", "qwen4_exp_text"), "its compressed-block indexer has no default token budget"),
    "reformer": "needs is_decoder and axial position shapes matched to the sequence length",
    "zamba2": "its default layer types name 54 layers (a tiny layout is not derived from num_hidden_layers)",
}

#: the cases: generate() keywords besides the inputs (the batch case also gets a ragged batch of two)
#: (the chain, tree and batch cases draft every round: a random drafter's drafts are mostly rejected, and the
#: adaptive schedule would soon decode plainly)
EVERY_ROUND = {"num_assistant_tokens_schedule": "constant"}
CASES: dict[str, dict] = {
    "default": {},
    "chain": {"draft_mode": "chain", "num_assistant_tokens": 4, **EVERY_ROUND},
    "tree": {"draft_mode": "tree", "tree_depth": 4, "tree_top_k": 2, "tree_total_tokens": 8, **EVERY_ROUND},
    "batch": EVERY_ROUND,
    "copy": {"draft_sources": "copy"},
}
NEW_TOKENS = 12
#: a family larger than this at the tiny size is not built (some configs have more vocabulary-sized tables)
MAX_PARAMETERS = 20_000_000


def tiny_model(model_type: str, vocab: int = VOCAB):
    """The family's causal LM, tiny (`vocab` tokens), float32, eval mode (seeded)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    override = OVERRIDES.get(model_type, {})
    config_class = CONFIG_MAPPING[model_type]
    text_class = (getattr(config_class, "sub_configs", None) or {}).get("text_config")
    tiny = {**TINY, "vocab_size": vocab, "vocab_size_per_layer_input": vocab}
    fields = {**_known(text_class or config_class, tiny), **override}
    if text_class is not None:
        config = AutoConfig.for_model(model_type, text_config=fields, **_known(config_class, tiny))
    else:
        config = AutoConfig.for_model(model_type, **fields)
    with torch.device("meta"):  # (counted before any memory is taken: some fields are vocabulary-sized)
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"{size / 1e6:.0f}M parameters at the tiny size: a field of its config needs an override")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model.eval()


def prompt(rows: int = 1) -> dict:
    """A repetitive prompt (copy drafting finds its continuations); two rows: the second left-padded by 3."""
    torch.manual_seed(1)
    base = torch.randint(1, VOCAB, (6,))
    ids = torch.cat([base, base, base[:3]])[None]  # [1, 15]
    if rows == 1:
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    other = torch.randint(1, VOCAB, (1, 15))
    other[:, :3] = 0
    mask = torch.ones(2, 15, dtype=torch.long)
    mask[1, :3] = 0
    return {"input_ids": torch.cat([ids, other]), "attention_mask": mask}


def _known(config_class, fields: dict) -> dict:
    """The fields a config class has (one it lacks would be read by code that looks for it: a `sliding_window`
    on a Llama config makes a window the model does not have); read-only properties and fields the config refuses
    to read globally (per-layer ones) are left to it."""
    default = config_class()

    def has(name: str) -> bool:
        if isinstance(getattr(config_class, name, None), property):
            return False
        try:
            return hasattr(default, name)
        except Exception:  # noqa: BLE001  (a per-layer field, or one the family does not have)
            return False

    return {k: v for k, v in fields.items() if has(k)}


@dataclass
class Cell:
    outcome: str  # spec, plain, silent, DIFFERS, CRASH, n/a
    detail: str = ""  # the logged reason, the error, or where the outputs first differ
    loop: str = ""  # the loop the call was routed to


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def plain_output(model, rows: int, kept: dict):
    """Plain generate() on the case's inputs (kept per number of rows: the cases share them), or its error."""
    if rows not in kept:
        try:
            with torch.no_grad():
                kept[rows] = model.generate(**prompt(rows), max_new_tokens=NEW_TOKENS, do_sample=False)
        except Exception as e:  # noqa: BLE001
            kept[rows] = e
    return kept[rows]


def run_case(model, drafter, case: str, kept: dict | None = None) -> Cell:
    """One case of one model against plain generate() on the same inputs (`kept`: plain outputs so far)."""
    rows = 2 if case == "batch" else 1
    inputs = prompt(rows)
    asked = dict(CASES[case])
    common = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    ref = plain_output(model, rows, {} if kept is None else kept)
    if isinstance(ref, Exception):
        return Cell("n/a", f"plain generate() raises {type(ref).__name__}: {_first_line(ref)}")
    if "draft_sources" not in asked or asked["draft_sources"] != "copy":
        asked["assistant_model"] = drafter
    routes = []
    original = hooks.route

    def spy(*args, **kwargs):
        routes.append(original(*args, **kwargs))
        return routes[-1]

    handler = _Messages()
    log = logging.getLogger("eagle_hf")
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)
    hooks.route = spy
    try:
        with torch.no_grad():
            out = model.generate(**inputs, **common, **asked)
    except Exception as e:  # noqa: BLE001
        where = traceback.extract_tb(e.__traceback__)[-1]
        return Cell("CRASH", f"{type(e).__name__}: {_first_line(e)} ({Path(where.filename).name}:{where.lineno})",
                    routes[-1].loop if routes else "")
    finally:
        hooks.route = original
        log.removeHandler(handler)
        log.setLevel(level)
    loop = routes[-1].loop if routes else ""
    out_ids, ref_ids = getattr(out, "sequences", out), getattr(ref, "sequences", ref)
    if out_ids.shape != ref_ids.shape or not torch.equal(out_ids, ref_ids):
        return Cell("DIFFERS", _first_difference(out_ids, ref_ids), loop)
    stats = eagle_hf.last_stats()
    if stats is not None and stats.drafted > 0:
        return Cell("spec", (routes[-1].reason or "") if routes else "", loop)
    said = [m for m in handler.messages if "plainly" in m or "not possible" in m]
    if said:  # (the reason is logged as a warning the first time, then at info level)
        return Cell("plain", said[0], loop)
    return Cell("silent", "", loop)


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def _first_difference(out: torch.Tensor, ref: torch.Tensor) -> str:
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} against plain {tuple(ref.shape)}"
    where = (out != ref).nonzero()[0].tolist()
    return f"row {where[0]} differs at token {where[1]}"


def run_family(model_type: str, cases) -> dict[str, Cell]:
    """Every case of one family (a family that cannot be built: one CRASH cell per case, naming the step)."""
    try:
        model = tiny_model(model_type)
    except Exception as e:  # noqa: BLE001
        return {c: Cell("n/a", f"cannot build it tiny: {type(e).__name__}: {_first_line(e)}") for c in cases}
    try:
        torch.manual_seed(2)
        drafter = EagleDrafter.for_target(model).float().eval()
    except Exception as e:  # noqa: BLE001
        cell = Cell("CRASH", f"EagleDrafter.for_target raises {type(e).__name__}: {_first_line(e)}")
        drafter = None
    out, kept = {}, {}
    for case in cases:
        if drafter is None and case != "copy":
            out[case] = cell
        else:
            out[case] = run_case(model, drafter, case, kept)
    return out


def families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def table(results: dict[str, dict[str, Cell]], cases) -> str:
    """The markdown table, the counts, and each non-speculating cell's reason."""
    lines = ["| family | " + " | ".join(cases) + " |", "|---|" + "---|" * len(cases)]
    for family, cells in results.items():
        lines.append(f"| {family} | " + " | ".join(_shown(cells[c]) for c in cases) + " |")
    counts: dict[str, int] = {}
    for cells in results.values():
        for cell in cells.values():
            counts[cell.outcome] = counts.get(cell.outcome, 0) + 1
    order = ["spec", "plain", "silent", "DIFFERS", "CRASH", "n/a"]
    lines += ["", "Cells: " + ", ".join(f"{k} {counts[k]}" for k in order if k in counts), ""]
    lines += [f"Skipped families: {', '.join(f'{k} ({v})' for k, v in SKIPS.items()) or 'none'}", ""]
    lines.append("Reasons (cells other than spec):")
    lines.append("")
    for family, cells in results.items():
        for case in cases:
            cell = cells[case]
            if cell.outcome != "spec":
                lines.append(f"- {family} / {case}: {cell.outcome}: {cell.detail or '(nothing logged)'}")
    return "\n".join(lines) + "\n"


def _shown(cell: Cell) -> str:
    """A cell as the table shows it: a speculating one names its loop (eagle_hf's trees, or transformers' chain)."""
    if cell.outcome == "spec":
        return "spec (tree loop)" if cell.loop == "eagle_hf" else "spec (chain)"
    return cell.outcome


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated model types (default: all)")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated cases")
    p.add_argument("--out", default="", help="write the table to this markdown file too")
    p.add_argument("--threads", type=int, default=1, help="torch threads (tiny models gain nothing from more)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cases = [c for c in args.cases.split(",") if c]
    chosen = [f for f in args.only.split(",") if f] or families()
    results: dict[str, dict[str, Cell]] = {}
    start = time.perf_counter()
    for family in chosen:
        if family in SKIPS:
            continue
        began = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):
            results[family] = run_family(family, cases)
        cells = results[family]
        print(f"{family:28s} " + " ".join(f"{c}={cells[c].outcome}" for c in cases)
              + f"  ({time.perf_counter() - began:.1f} s)", flush=True)
    text = table(results, cases)
    print(text)
    print(f"{len(results)} families in {time.perf_counter() - start:.0f} s")
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
