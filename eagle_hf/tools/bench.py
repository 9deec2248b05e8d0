"""`eagle-hf bench`: EAGLE against plain `generate()` and transformers' own speculative methods.

Interleaved (every mode runs on a prompt before the next prompt starts, in an order that alternates between
repeats), after a warm-up, medians with spread, speedup relative to the plain baseline measured in the same run,
and exactness: at temperature 0 every output is compared to the baseline's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import resource
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..devices import input_device
from ..files import save_figure, write_file
from ..hf.stopping import eos_ids
from ..speculation.stats import last_stats, merge_stats
from .evaluation import batch_chat_inputs, chat_inputs, load_prompt_set

logger = logging.getLogger(__name__)


@dataclass
class Mode:
    name: str
    kwargs: dict = field(default_factory=dict)
    uses_drafter: bool = False


#: the mode names `standard_modes` can produce ("eagle chain K" for each chain length K)
MODE_NAMES = ("prompt-lookup", "assisted (draft model)", "early-exit", "eagle chain K", "eagle tree",
              "eagle chain adaptive", "eagle alone", "copy alone", "eagle default")


def standard_modes(drafter, assistant=None, chain_lengths=(3, 5), early_exit_layer: int | None = None) -> list[Mode]:
    modes = [Mode("plain"), Mode("prompt-lookup", {"prompt_lookup_num_tokens": 5})]
    if assistant is not None:
        modes.append(Mode("assisted (draft model)", {"assistant_model": assistant}))
    if early_exit_layer is not None:
        modes.append(Mode("early-exit", {"assistant_early_exit": early_exit_layer}))
    if drafter is not None:
        for k in chain_lengths:
            modes.append(Mode(f"eagle chain {k}", {"assistant_model": drafter, "num_assistant_tokens": k}, True))
        fixed_tree = {"draft_mode": "tree", "num_assistant_tokens_schedule": "constant"}
        modes.append(Mode("eagle tree", {"assistant_model": drafter, **fixed_tree}, True))
        modes.append(Mode("eagle chain adaptive", {"assistant_model": drafter, "draft_mode": "chain"}, True))
        modes.append(Mode("eagle alone", {"assistant_model": drafter, "draft_sources": "eagle"}, True))
        modes.append(Mode("copy alone", {"draft_sources": "copy"}, True))  # no drafter: a stronger prompt lookup
        modes.append(Mode("eagle default", {"assistant_model": drafter}, True))  # adaptive tree, eagle + copy
    return modes


def check_mode_names(names: list[str], chain_lengths=(3, 5), assistant: bool = False, early_exit: bool = False) -> None:
    """`eagle-hf bench --modes`: every name is a standard mode that this run has (before any model loads)."""
    known = ["plain", *(n for n in MODE_NAMES if n != "eagle chain K"), *(f"eagle chain {k}" for k in chain_lengths)]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--modes: unknown mode(s) {unknown}; the modes of this run are: {', '.join(known)} "
                         "(--chain-lengths sets the K of 'eagle chain K'; --mode NAME=JSON adds one of your own).")
    needs = {"assisted (draft model)": (assistant, "--assistant MODEL"), "early-exit": (early_exit, "--early-exit-layer N")}
    for name, (given, flag) in needs.items():
        if name in names and not given:
            raise ValueError(f"--modes {name!r} needs {flag}.")


def prepare_out_dir(out_dir: str | Path) -> Path:
    """The results folder, made and checked writable (before any model loads: a run's results are not lost at
    its end)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out}: a file, not a folder; name a folder for the results.")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".eagle_hf_write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise PermissionError(f"--out {out}: cannot write there ({err.strerror or err}).") from err
    return out


def parse_mode(spec: str) -> tuple[str, dict]:
    """``NAME=JSON`` (`eagle-hf bench --mode`): a mode's name and its generate() keywords (a JSON object)."""
    name, sep, text = spec.partition("=")
    try:
        kwargs = json.loads(text) if sep else None
    except json.JSONDecodeError as e:
        kwargs, why = None, f" ({e})"
    else:
        why = ""
    if not name.strip() or not isinstance(kwargs, dict):
        raise ValueError(f"--mode takes NAME=JSON, a name and a JSON object of generate() keywords{why}, e.g. "
                         f"--mode 'copy b1={{\"draft_sources\": \"copy\", \"copy_branches\": 1}}'; got {spec!r}.")
    if name.strip() in ("plain", *MODE_NAMES):
        raise ValueError(f"--mode {name.strip()!r}: that name belongs to a standard mode; pick another name.")
    return name.strip(), kwargs


def custom_mode(name: str, kwargs: dict, drafter) -> Mode:
    """A mode of the user's own: eagle_hf's generate() keywords, with the drafter as `assistant_model` unless the
    mode drafts by copying alone (``"draft_sources": "copy"``)."""
    if kwargs.get("draft_sources") != "copy":
        kwargs = {"assistant_model": drafter, **kwargs}
    return Mode(name, kwargs, True)


def _generate(target, enc, mode: Mode, max_new_tokens: int, temperature: float, seed: int):
    kwargs = dict(max_new_tokens=max_new_tokens, **mode.kwargs)
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature)
        torch.manual_seed(seed)
    else:
        kwargs["do_sample"] = False
    device = input_device(target)
    _synchronize(device)
    start = time.perf_counter()
    out = target.generate(**enc, **kwargs)
    _synchronize(device)
    elapsed = time.perf_counter() - start
    return out[:, enc["input_ids"].shape[1] :], elapsed


def _synchronize(device) -> None:
    """Wait for the device's queued work (every GPU's: a device_map may spread the target over several)."""
    if device.type == "cuda":
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def rows_to_eos(new: torch.Tensor, eos: set[int]) -> list[list[int]]:
    """What each row of a batch generated ([B, n] new columns): its tokens up to its first EOS, included (the
    padding after is not generated)."""
    rows = []
    for row in new.tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:end])
    return rows


def generated_tokens(new: torch.Tensor, eos: set[int]) -> int:
    """Tokens a batch generated ([B, n] new columns), each row up to its first EOS."""
    return sum(len(row) for row in rows_to_eos(new, eos))


def text_hash(new: torch.Tensor, eos: set[int]) -> str:
    """A short fingerprint of the text a call wrote ([B, n] new columns, each row up to its first EOS): in bf16
    two modes may write different texts (a multi-token forward flips a near-tie), and their speeds compare fairly
    only where the texts are the same."""
    digest = hashlib.sha1()
    for row in rows_to_eos(new, eos):
        digest.update(repr(row).encode())
    return digest.hexdigest()[:12]


def run_benchmark(
    target,
    tokenizer,
    modes: list[Mode],
    prompt_sets: list[str],
    max_new_tokens: int = 256,
    limit: int | None = None,
    temperature: float = 0.0,
    repeats: int = 1,
    seed: int = 0,
    batch_size: int = 1,
    on_set=None,
) -> dict:
    """Run every mode on every prompt (or batch of `batch_size` prompts, left-padded), interleaved; return the
    results dict (see `write_results`). Speed is generated tokens per second (a batch's rows up to their EOS).
    Sampling: every mode draws a prompt's call from the same seed, a new one each repeat (a sampled text's speed
    depends on the text drawn: repeats of the same draw would hide that noise from an A/A band). `on_set`: called
    with the results so far after each prompt set (`eagle-hf bench` writes them: a late failure loses nothing)."""
    results = {"settings": dict(max_new_tokens=max_new_tokens, limit=limit, temperature=temperature, repeats=repeats,
                                prompt_sets=prompt_sets, modes=[m.name for m in modes], batch_size=batch_size),
               "machine": machine_info(target), "sets": {}}
    eos = eos_ids(target.generation_config)
    device = input_device(target)  # where the target's inputs go (its embedding's device under a device_map)
    warm = chat_inputs(tokenizer, "Hello!", device)
    for mode in modes:  # warm-up: first-call allocations, lazy inits
        _generate(target, warm, mode, 16, temperature, seed)
    for set_name in prompt_sets:
        prompts = load_prompt_set(set_name, limit=limit)
        batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
        # per mode, per call: tokens generated, seconds (rates and totals are derived in `summarize`), text written
        per_mode = {m.name: {"tokens": [], "seconds": [], "texts": [], "stats": [], "mismatches": []} for m in modes}
        for r in range(repeats):
            for i, batch in enumerate(tqdm(batches, desc=f"{set_name} (repeat {r + 1}/{repeats})")):
                pid = ",".join(p for p, _ in batch)
                texts = [text for _, text in batch]
                enc = chat_inputs(tokenizer, texts[0], device) if batch_size == 1 else \
                    batch_chat_inputs(tokenizer, texts, device)
                order = modes if (i + r) % 2 == 0 else list(reversed(modes))
                outputs = {}
                for mode in order:
                    new, elapsed = _generate(target, enc, mode, max_new_tokens, temperature, seed + r * len(batches) + i)
                    rec = per_mode[mode.name]
                    tokens = generated_tokens(new, eos) if batch_size > 1 else new.shape[1]
                    rec["tokens"].append(int(tokens))
                    rec["seconds"].append(elapsed)
                    rec["texts"].append(text_hash(new, eos))
                    if mode.uses_drafter:
                        rec["stats"].append(last_stats())
                    outputs[mode.name] = new
                if temperature == 0:
                    base = outputs["plain"]
                    for name, new in outputs.items():
                        if not torch.equal(new, base) and pid not in per_mode[name]["mismatches"]:
                            per_mode[name]["mismatches"].append(pid)
                            # in float32 a difference is a bug; in bf16/fp16 multi-token forwards flip near-ties
                            level = logging.ERROR if target.dtype == torch.float32 else logging.INFO
                            logger.log(level, "Output of %s differs from plain generate() on %s prompt %s",
                                       name, set_name, pid)
        results["sets"][set_name] = summarize(per_mode, len(prompts))
        results["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if on_set is not None:
            on_set(results)
    return results


def summarize(per_mode: dict, n_prompts: int) -> dict:
    def rate(rec):  # tokens per second of each call, and of all calls together
        return [t / s for t, s in zip(rec["tokens"], rec["seconds"])], sum(rec["tokens"]) / sum(rec["seconds"])

    base, base_total = rate(per_mode["plain"])
    out = {}
    for name, rec in per_mode.items():
        tok_s, total = rate(rec)
        ratios = [a / b for a, b in zip(tok_s, base)]
        q = statistics.quantiles(tok_s, n=4) if len(tok_s) > 1 else [tok_s[0]] * 3
        entry = {
            "prompts": n_prompts,
            "tok_s_median": statistics.median(tok_s),
            "tok_s_iqr": [q[0], q[2]],
            "speedup_median": statistics.median(ratios),
            "speedup_total": total / base_total,
            "speedups": ratios,  # per prompt (or batch), in prompt order: runs compare prompt by prompt
            # per call, in the same order: tokens generated (a batch's rows up to their EOS) and seconds (a rate
            # can fall because a call took longer, or because its text ended sooner)
            "tokens": rec["tokens"],
            "seconds": [round(x, 4) for x in rec["seconds"]],
            "texts": rec["texts"],  # per call, a fingerprint of the text written (`text_hash`)
            "mismatches": rec["mismatches"],
        }
        if rec["stats"]:
            pooled = merge_stats(rec["stats"])
            entry.update(
                mean_acceptance_length=pooled.mean_acceptance_length,
                acceptance_per_position=pooled.acceptance_per_position,
                drafter_share=pooled.drafter_time / pooled.total_time if pooled.total_time else 0.0,
                fallback_ratio=pooled.fallback_ratio,
                mean_draft_length=pooled.drafted / pooled.cycles if pooled.cycles else 0.0,
                drafted_by_source=pooled.drafted_by_source,
                accepted_by_source=pooled.accepted_by_source,
                acceptance_per_position_by_source=pooled.acceptance_per_position_by_source,
                calls=[_call_record(st) for st in rec["stats"]],  # per prompt (or batch), in prompt order
            )
        out[name] = entry
    return out


def _call_record(stats) -> dict:
    """What one call drafted, per source (for explaining a prompt's speed)."""
    return {"cycles": stats.cycles, "plain_steps": stats.fallback_steps + stats.final_steps,
            "drafted_by_source": dict(stats.drafted_by_source), "accepted_by_source": dict(stats.accepted_by_source)}


def machine_info(target) -> dict:
    import transformers

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(input_device(target)),
        "device_map": _placement(target),
        "dtype": str(target.dtype),
        "target": getattr(target, "name_or_path", None),
    }


def _placement(target) -> dict | None:
    """How a target spread by a device_map lies: device -> number of its modules in `hf_device_map`; None when
    the target sits on one device."""
    counts = Counter(str(d) for d in (getattr(target, "hf_device_map", None) or {}).values())
    return dict(counts) if len(counts) > 1 else None


def results_markdown(results: dict) -> str:
    lines = []
    s = results["settings"]
    m = results["machine"]
    batch = s.get("batch_size", 1)
    lines.append(
        f"Target `{m['target']}` ({m['dtype']}, {m['device']}, {m['threads']} threads, torch {m['torch']}, "
        f"transformers {m['transformers']}); {s['max_new_tokens']} new tokens, temperature {s['temperature']}, "
        f"{s['limit'] or 'all'} prompts per set, {s['repeats']} repeat(s)"
        + (f", batches of {batch} prompts (speedup per batch)." if batch > 1 else ".")
    )
    lines.append("")
    lines.append(
        "| prompt set | mode | tok/s (median) | speedup (median per prompt) | τ | accepted per position "
        "| accepted / drafted by source | mean draft length | plain steps | outputs ≠ plain |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for set_name, modes in results["sets"].items():
        for name, e in modes.items():
            tau = f"{e['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in e else "–"
            pos = ", ".join(f"{a:.2f}" for a in e.get("acceptance_per_position", [])[:6]) or "–"
            mism = len(e["mismatches"]) if s["temperature"] == 0 else "n/a"
            length = f"{e['mean_draft_length']:.1f}" if "mean_draft_length" in e else "–"
            plain = f"{e['fallback_ratio']:.0%}" if "fallback_ratio" in e else "–"
            by_source = ", ".join(f"{src} {e['accepted_by_source'].get(src, 0)}/{n}"
                                  for src, n in e.get("drafted_by_source", {}).items()) or "–"
            lines.append(
                f"| {set_name} | {name} | {e['tok_s_median']:.1f} | {e['speedup_median']:.2f}x | {tau} | {pos} "
                f"| {by_source} | {length} | {plain} | {mism} |"
            )
    return "\n".join(lines) + "\n"


def plot_results(results: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sets = list(results["sets"])
    modes = [m for m in results["settings"]["modes"] if m != "plain"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / max(1, len(modes))
    for j, mode in enumerate(modes):
        ax1.bar([i + j * width for i in range(len(sets))], [results["sets"][s][mode]["speedup_median"] for s in sets], width,
                label=mode, color=f"C{j}")
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.set_xticks([i + 0.4 - width / 2 for i in range(len(sets))], sets)
    ax1.set_ylabel("speedup over plain generate() (median)")
    ax1.legend(fontsize=7)
    curves = [(f"{mode} / {s}" if len(sets) > 1 else mode, f"C{j}", acc) for j, mode in enumerate(modes) for s in sets
              if (acc := results["sets"][s][mode].get("acceptance_per_position"))]
    for label, color, acc in curves:  # every drafting mode's (chains, trees, copies), in its bar's colour
        ax2.plot(range(1, len(acc) + 1), acc, marker=".", label=label, color=color)
    ax2.set_xlabel("draft position (depth in the tree)")
    ax2.set_ylabel("P(accepted | proposed)")
    if curves:
        ax2.legend(fontsize=6)
    else:
        ax2.text(0.5, 0.5, "no mode recorded acceptance per position", ha="center", va="center",
                 transform=ax2.transAxes)
    fig.tight_layout()
    try:
        save_figure(fig, path, dpi=110)
    finally:
        plt.close(fig)
    return path


def write_results(results: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_file(out / "results.json", json.dumps(results, indent=2))
    write_file(out / "results.md", results_markdown(results))
    plot_results(results, out / "speedup.png")
    return out
