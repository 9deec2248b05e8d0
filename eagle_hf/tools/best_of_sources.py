"""Is the default the best of its sources? A per-set comparison of `eagle-hf bench` runs that accounts for noise.

The default mode drafts with the EAGLE drafter and copies of the text in one adaptive tree; its promise is that
nobody need choose a source. On each prompt set this reads the runs of one or more processes (``results.json``
of `eagle-hf bench` with two or more repeats) and reports:

* the *A/A band*: how far a single source's median speedup moves between two runs of the very same mode and
  prompts (repeats of one process, and the processes against each other), the largest over the single sources
  (the controls: the default's own gap is what is tested against it); a difference inside it is noise;
* the *best single source*, chosen on the first repeat of the first run (the highest median speedup among the
  single sources: prompt lookup, copy alone, EAGLE alone) and scored on every other repeat, so that the choice
  does not also ride on its own lucky noise; the default scored on the same repeats;
* the verdict: the default's median against the best single source's, inside or outside the band;
* per prompt: the default's speedup over the best single source's (median and quartiles), and the worst prompts
  with what each source drafted and got accepted there, so that every loss has an explanation;
* the default's per-set medians in the separate processes, and their difference against the band;
* the *swap band*: a steadier estimate of the same noise. The A/A band is one realised gap per control, itself a
  draw: two runs of a mode over the same 20 prompts land 1% or 8% apart by chance. Swapping the two runs' values
  of a prompt at random (they are exchangeable if the runs differ only by noise) gives the gap's distribution
  under that null; the swap band is its 90th percentile, the largest over the controls;
* *paired, run against run*: each prompt's speedup in the last run (the second process) over the first, per mode;
  their median (does the mode move as a whole?) and the median size of a prompt's move (how much does one prompt's
  speedup wander?), the default's beside the controls' largest. A set median over 20 prompts whose speedups span
  1.3x-10x can jump by a gap between neighbours; the paired figures cannot;
* *same text or not*: in bf16 a multi-token forward flips near-ties, so the default and the chosen source may write
  different texts for one prompt, and a text that ends sooner or copies less runs at another speed whatever the
  decisions. Where the runs record a fingerprint of each call's text (`eagle-hf bench` does), the per-call ratio
  default / chosen is split into the calls where both wrote the same text (the decisions alone) and the others;
  per mode, the prompts that wrote one text in every run are counted; and *the same work* (the same text in as
  many rounds, the default drafting only from the chosen source's kind) times what the default's own machinery
  costs beside that source (`same_rounds`).

Medians of per-prompt speedups over plain `generate()`, measured in the same run, prompt by prompt.
"""

from __future__ import annotations

import gzip
import json
import math
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ..files import write_file

DEFAULT_MODE = "eagle default"
SINGLE_SOURCES = ("prompt-lookup", "copy alone", "eagle alone")
#: random swaps drawn per pair of runs for the swap band (seeded: the same files give the same band)
SWAPS = 1000


@dataclass
class SetVerdict:
    """One prompt set's comparison (speedups are medians of per-prompt speedups over plain generate())."""

    name: str
    prompts: int
    band: float  # the A/A noise band, relative (0.05: medians of one single source's runs differ by up to 5%)
    chosen: str  # the best single source, chosen on the first repeat
    default: float  # the default's median speedup on the scoring repeats
    best: float  # the chosen source's median speedup on the scoring repeats
    by_mode: dict[str, float]  # every mode's median speedup over all repeats and runs
    per_process: list[float]  # the default's median speedup in each process (all its repeats)
    ratio_quartiles: tuple[float, float, float]  # per prompt: default / chosen source, quartiles
    worst: list[dict] = field(default_factory=list)  # the prompts where the default trails the chosen source most
    swap_band: float = 0.0  # 90th percentile of a control's gap between two runs with prompts' values swapped
    # per mode, last run over first, prompt by prompt: (median ratio, median |log ratio|)
    paired: dict[str, tuple[float, float]] = field(default_factory=dict)
    # over the scoring calls, default / chosen per call: {"same": [...], "different": [...]} by whether the two
    # wrote the same text (None where the runs hold no text fingerprints)
    by_text: dict[str, list[float]] | None = None
    # per mode (the default and the chosen source): the prompts whose text was the same in every run and repeat
    # (a mode whose decisions follow timings may shape its verify differently in each run, and in bf16 write another
    # text), out of all prompts
    steady_texts: dict[str, int] = field(default_factory=dict)
    # the default's seconds over the chosen source's, per call where both wrote the same text in the same rounds and
    # the default drafted only from the chosen source: what the default's machinery costs beside it (`same_rounds`)
    same_rounds: list[float] = field(default_factory=list)

    @property
    def relative(self) -> float:
        """The default's median over the best single source's, minus 1 (-0.04: 4% behind)."""
        return self.default / self.best - 1.0

    @property
    def verdict(self) -> str:
        if self.relative >= 0:
            return "ahead"
        return "within noise" if -self.relative <= self.band else "behind"

    @property
    def processes_agree(self) -> bool:
        """Whether the default's medians in the separate processes differ by no more than the A/A band (both
        relative to the pair's mean)."""
        return self.process_gap <= self.band

    @property
    def paired_band(self) -> tuple[float, float]:
        """The controls' largest paired move, run against run: (|median ratio - 1|, median |log ratio|)."""
        controls = [v for m, v in self.paired.items() if m != DEFAULT_MODE]
        return (max(abs(r - 1.0) for r, _ in controls), max(c for _, c in controls)) if controls else (0.0, 0.0)

    @property
    def process_gap(self) -> float:
        """The default's medians in the separate processes: their largest gap, relative to the pair's mean."""
        return _relative_gap(min(self.per_process), max(self.per_process))


def swap_gap(a: list[float], b: list[float], rng: random.Random, swaps: int = SWAPS) -> float:
    """The 90th percentile of the gap between the medians of two runs `a` and `b` (per-prompt values, same
    prompts) when each prompt's two values are swapped at random: how far apart two runs differing only by
    noise land on these prompts."""
    gaps = []
    for _ in range(swaps):
        x, y = zip(*((u, v) if rng.random() < 0.5 else (v, u) for u, v in zip(a, b)))
        gaps.append(_relative_gap(statistics.median(x), statistics.median(y)))
    return sorted(gaps)[int(0.9 * swaps)]


def per_repeat(entry: dict, repeats: int, key: str = "speedups") -> list[list] | None:
    """A mode's per-call values of `key` split by repeat (`eagle-hf bench` lists them repeat after repeat): its
    speedups, or its text fingerprints ("texts"; None in runs that hold none)."""
    values = entry.get(key)
    if not values:
        return None
    n = len(values) // repeats
    return [values[r * n : (r + 1) * n] for r in range(repeats)]


def split_by_text(ratios: list[list[float]], texts_a: list[list[str]], texts_b: list[list[str]]) -> dict:
    """Per-call ratios (repeat by repeat, prompt by prompt) split by whether the two modes wrote the same text."""
    out: dict[str, list[float]] = {"same": [], "different": []}
    for rep, ta, tb in zip(ratios, texts_a, texts_b):
        for r, a, b in zip(rep, ta, tb):
            out["same" if a == b else "different"].append(r)
    return out


def same_rounds(runs: list[dict], name: str, default: str, chosen: str) -> list[float]:
    """The default's seconds over the chosen source's, call by call in every run, where both wrote the same text in
    as many drafting rounds and plain steps and the default drafted from no other source (copies alone where copy
    alone is chosen): the same work, so the ratio is what the default's own machinery costs (its controller, the
    drafter's features it keeps). Empty without text fingerprints or round records."""
    out = []
    for run in runs:
        d, c = run["sets"][name][default], run["sets"][name][chosen]
        if not (d.get("texts") and c.get("texts") and d.get("calls") and c.get("calls")):
            continue
        for i, (cd, cc) in enumerate(zip(d["calls"], c["calls"])):
            sources = {k for k, v in cd["drafted_by_source"].items() if v}
            same_rounds_taken = (cd["cycles"], cd["plain_steps"]) == (cc["cycles"], cc["plain_steps"])
            if d["texts"][i] == c["texts"][i] and same_rounds_taken and sources <= set(cc["drafted_by_source"]):
                out.append(d["seconds"][i] / c["seconds"][i])
    return out


def paired_move(first: list[float], last: list[float]) -> tuple[float, float]:
    """Two runs of one mode over the same prompts: the median of each prompt's ratio last / first, and the median
    size of a prompt's move, |log(last / first)| (0.07: a prompt's speedup typically moves by about 7%)."""
    ratios = [b / a for a, b in zip(first, last)]
    return statistics.median(ratios), statistics.median(abs(math.log(r)) for r in ratios)


def _relative_gap(a: float, b: float) -> float:
    return abs(a - b) / ((a + b) / 2)


def compare(runs: list[dict], default: str = DEFAULT_MODE, singles: tuple[str, ...] = SINGLE_SOURCES,
            worst: int = 3) -> list[SetVerdict]:
    """Per prompt set present in every run: the default against the best single source (see the module doc).
    `runs`: `eagle-hf bench` results of separate processes, same prompts and settings; two repeats or more in
    total (an A/A band needs two runs of each mode)."""
    verdicts = []
    for name in runs[0]["sets"]:
        if not all(name in r["sets"] for r in runs):
            continue
        modes = [m for m in (default, *singles) if m in runs[0]["sets"][name]]
        if default not in modes or len(modes) < 2:
            raise ValueError(f"Set {name!r}: the runs need the mode {default!r} and at least one of {singles}.")
        # repeats[mode] = [per-prompt speedups of one repeat], every run's repeats in order
        repeats = {m: [rep for r in runs for rep in per_repeat(r["sets"][name][m], repeats_of(r, name))]
                   for m in modes}
        if len(repeats[default]) < 2:
            raise ValueError("An A/A band needs two runs of every mode: use --repeats 2, or two processes.")
        medians = {m: [statistics.median(rep) for rep in reps] for m, reps in repeats.items()}
        band = max(_relative_gap(a, b) for m, meds in medians.items() if m != default  # the single sources
                   for i, a in enumerate(meds) for b in meds[i + 1 :])  # against themselves: the controls
        rng = random.Random(0)
        swap_band = max(swap_gap(a, b, rng) for m, reps in repeats.items() if m != default
                        for i, a in enumerate(reps) for b in reps[i + 1 :])
        chosen = max((m for m in modes if m != default), key=lambda m: medians[m][0])
        scored = {m: [x for rep in repeats[m][1:] for x in rep] for m in (default, chosen)}
        n = len(repeats[default][0])
        # per prompt, over the scoring repeats: the default's speedup over the chosen source's
        ratios = [statistics.median(d[i] / c[i] for d, c in zip(repeats[default][1:], repeats[chosen][1:]))
                  for i in range(n)]
        q = quartiles(ratios)
        per_process = []
        start = 0
        for r in runs:
            count = repeats_of(r, name)
            per_process.append(statistics.median(x for rep in repeats[default][start : start + count] for x in rep))
            start += count
        order = sorted(range(n), key=lambda i: ratios[i])[:worst]
        run, repeat = _scoring_run(runs, name)
        texts = {m: [per_repeat(r["sets"][name][m], repeats_of(r, name), "texts") for r in runs]
                 for m in (default, chosen)}  # per run: its repeats' fingerprints (None in runs without)
        by_text, steady = None, {}
        if all(t is not None for ts in texts.values() for t in ts):
            flat = {m: [rep for t in ts for rep in t] for m, ts in texts.items()}
            by_text = split_by_text([[a / b for a, b in zip(d, c)] for d, c in
                                     zip(repeats[default][1:], repeats[chosen][1:])],
                                    flat[default][1:], flat[chosen][1:])
            steady = {m: sum(len({rep[i] for rep in reps}) == 1 for i in range(n)) for m, reps in flat.items()}
        verdicts.append(SetVerdict(
            name=name, prompts=n, band=band, chosen=chosen,
            default=statistics.median(scored[default]), best=statistics.median(scored[chosen]),
            by_mode={m: statistics.median(x for rep in reps for x in rep) for m, reps in repeats.items()},
            per_process=per_process, ratio_quartiles=q,
            worst=[_explain(run["sets"][name], repeat * n + i, i, ratios[i], default, chosen) for i in order],
            swap_band=swap_band,
            paired={m: paired_move(reps[0], reps[-1]) for m, reps in repeats.items()}, by_text=by_text,
            steady_texts=steady, same_rounds=same_rounds(runs, name, default, chosen)))
    return verdicts


def process_spread(runs: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """How far apart two processes of the same code land by chance, from several processes (same prompts and
    settings): per set and mode, over every pair of processes, the median and 90th percentile of the gap between
    their medians of per-prompt speedups and between their total-time speedups (all generated tokens over all
    time), each relative to the pair's mean. Two processes give one draw of each gap; a dozen give its spread.
    -> {set: {mode: {"processes", "median_gap", "p90_gap", "total_median_gap", "total_p90_gap", "low", "high"}}}"""
    def spread(values: list[float]) -> tuple[float, float]:
        gaps = sorted(_relative_gap(a, b) for i, a in enumerate(values) for b in values[i + 1 :])
        return statistics.median(gaps), gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))]

    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in runs[0]["sets"]:
        for mode in runs[0]["sets"][name]:
            entries = [r["sets"][name][mode] for r in runs if mode in r["sets"].get(name, {})]
            if mode == "plain" or len(entries) < 2:
                continue
            medians = [e["speedup_median"] for e in entries]
            (median_gap, p90_gap), (total_median, total_p90) = spread(medians), spread(
                [e["speedup_total"] for e in entries])
            out.setdefault(name, {})[mode] = {
                "processes": len(entries), "median_gap": median_gap, "p90_gap": p90_gap,
                "total_median_gap": total_median, "total_p90_gap": total_p90, "low": min(medians),
                "high": max(medians)}
    return out


def spread_markdown(spread: dict[str, dict[str, dict[str, float]]]) -> str:
    """`process_spread` as a table."""
    lines = [("| set | mode | processes | set medians, lowest / highest | gap between two processes' medians: median "
              "/ 90th percentile of pairs | the same, total-time speedup |"), "|---|---|---|---|---|---|"]
    for name, modes in spread.items():
        for mode, x in modes.items():
            lines.append(f"| {name} | {mode} | {x['processes']} | {x['low']:.2f}x / {x['high']:.2f}x "
                         f"| {x['median_gap']:.1%} / {x['p90_gap']:.1%} "
                         f"| {x['total_median_gap']:.1%} / {x['total_p90_gap']:.1%} |")
    return "\n".join(lines) + "\n"


def repeats_of(run: dict, name: str) -> int:
    """How many repeats a run holds of set `name` (a process's sets may come from files of several settings:
    `read_run`)."""
    return run.get("repeats_of", {}).get(name, run["settings"]["repeats"])


def _scoring_run(runs: list[dict], name: str) -> tuple[dict, int]:
    """(the run that holds the first scoring repeat, that repeat's index in it): the first run's second repeat
    where it repeated, else the second run's first."""
    return (runs[0], 1) if repeats_of(runs[0], name) > 1 or len(runs) == 1 else (runs[1], 0)


def _explain(modes: dict, at: int, prompt: int, ratio: float, default: str, chosen: str) -> dict:
    """What the default and the chosen source did on one prompt in the first scoring repeat (`modes`: the run
    that holds it, `at`: the prompt's call there, `_scoring_run`)."""
    out = {"prompt": prompt, "ratio": ratio}
    for label, mode in (("default", default), ("chosen", chosen)):
        calls = modes[mode].get("calls") or []
        if at < len(calls):
            out[label] = calls[at]
        for key in ("tokens", "texts"):  # what the call wrote: its length, its fingerprint
            values = modes[mode].get(key) or []
            if at < len(values):
                out.setdefault(key, {})[label] = values[at]
    return out


def _text_note(worst: dict) -> str:
    """'same', or 'different: 46 / 128 tokens' (the default's / the chosen source's), or '–' without fingerprints."""
    texts, tokens = worst.get("texts", {}), worst.get("tokens", {})
    if len(texts) < 2:
        return "–"
    if texts["default"] == texts["chosen"]:
        return "same"
    return f"different: {tokens.get('default', '?')} / {tokens.get('chosen', '?')} tokens"


def _sources(call: dict | None) -> str:
    if not call:
        return "–"
    by = ", ".join(f"{s} {call['accepted_by_source'].get(s, 0)}/{n}" for s, n in call["drafted_by_source"].items())
    return f"{by or 'nothing drafted'}; {call['cycles']} drafting rounds, {call['plain_steps']} plain"


def markdown(verdicts: list[SetVerdict], runs: list[dict]) -> str:
    s, m = runs[0]["settings"], runs[0]["machine"]
    totals = {sum(repeats_of(r, v.name) for r in runs) for v in verdicts}
    total = "/".join(str(t) for t in sorted(totals)) + (" repeats (per set, as its files)" if len(totals) > 1 else
                                                        " repeats")
    lines = [
        (f"Target `{m['target']}` ({m['dtype']}, {m['device']}, {m['threads']} threads); {s['max_new_tokens']} new "
        f"tokens, temperature {s['temperature']}, batch {s.get('batch_size', 1)}; {len(runs)} process(es), "
        f"{total} in all. Speedups: medians of per-prompt speedups over plain generate() in the same run. "
        "Best single source: chosen on the first repeat, scored (as is the default) on the others. A/A band: the "
        "largest gap between two runs of one single source (the controls), relative to their mean. Swap band: the "
        "90th percentile of that gap with each prompt's two values swapped at random, the largest over the controls "
        "(a steadier estimate of the same noise than one realised gap). Last run / first: each prompt's speedup in "
        "the last run over the first, the median of those ratios and the median size of a prompt's move, the "
        "default's and (in brackets) the controls' largest."),
        "",
        ("| set | prompts | " + " | ".join(SINGLE_SOURCES) + " | default | best single (chosen) | default vs best "
         "| A/A band | swap band | verdict | default per process | per prompt: default / best (quartiles) "
         "| last run / first, per prompt: default (controls' largest) |"),
        "|---|---|" + "---|" * (len(SINGLE_SOURCES) + 9),
    ]
    for v in verdicts:
        singles = " | ".join(f"{v.by_mode[x]:.2f}x" if x in v.by_mode else "–" for x in SINGLE_SOURCES)
        lines.append(
            f"| {v.name} | {v.prompts} | {singles} | {v.by_mode[DEFAULT_MODE]:.2f}x | {v.best:.2f}x ({v.chosen}) "
            f"| {v.relative:+.1%} | ±{v.band:.1%} | ±{v.swap_band:.1%} | **{v.verdict}** | "
            + " / ".join(f"{x:.2f}x" for x in v.per_process) + _agreement(v)
            + " | " + " / ".join(f"{x:.2f}" for x in v.ratio_quartiles) + " | " + _paired(v) + " |")
    split = [v for v in verdicts if v.by_text is not None]
    if split:
        lines += ["", ("Same text or not (bf16 flips near-ties, so two modes may write different texts): over the "
                       "scoring calls, the default's speedup over the best single source's, call by call, where the "
                       "two wrote the same text (their decisions alone) and where they did not."), "",
                  ("| set | calls with the same text | default / best there: median (quartiles) | other calls: "
                   "median (quartiles) | prompts with one text in every run: default, best single | the same "
                   "text in the same rounds from the best's source alone, every run: calls, the default's time over "
                   "the best's (quartiles) |"), "|---|---|---|---|---|---|"]
        for v in split:
            same, other = v.by_text["same"], v.by_text["different"]
            lines.append(f"| {v.name} | {len(same)} of {len(same) + len(other)} | {_quartiles(same)} "
                         f"| {_quartiles(other)} | {v.steady_texts[DEFAULT_MODE]} of {v.prompts}, "
                         f"{v.steady_texts[v.chosen]} of {v.prompts} | {len(v.same_rounds)}: "
                         f"{_quartiles(v.same_rounds)} |")
    lines += ["", "Worst prompts per set (what each drafted and got accepted in the first scoring repeat):", "",
              "| set | prompt | default / best | default | best single | text |", "|---|---|---|---|---|---|"]
    for v in verdicts:
        for w in v.worst:
            lines.append(f"| {v.name} | {w['prompt']} | {w['ratio']:.2f} | {_sources(w.get('default'))} "
                         f"| {_sources(w.get('chosen'))} | {_text_note(w)} |")
    return "\n".join(lines) + "\n"


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(lower quartile, median, upper quartile) of `values` (one value: itself three times)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def _quartiles(values: list[float]) -> str:
    """'0.98 (0.91-1.06)', or '–' for none."""
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    low, mid, high = quartiles(values)
    return f"{mid:.2f} ({low:.2f}-{high:.2f})"


def _paired(v: SetVerdict) -> str:
    """'0.99, moves 6.8% (±4.0%, 7.1%)': the default's median ratio and a prompt's median move, run against run;
    in brackets the controls' largest of each."""
    ratio, move = v.paired[DEFAULT_MODE]
    band, control_move = v.paired_band
    return f"{ratio:.2f}, moves {move:.1%} (±{band:.1%}, {control_move:.1%})"


def _agreement(v: SetVerdict) -> str:
    if len(v.per_process) < 2:
        return ""
    if v.processes_agree:
        return " (agree)"
    return " (outside the A/A band, within the swap band)" if v.process_gap <= v.swap_band else " (outside both bands)"


def _text(path: Path) -> str:
    """A results file's text (``results.json``, or a gzipped copy ``.json.gz``)."""
    return gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()


def read_run(paths: str) -> dict:
    """One process's results: a results.json, or several (comma-separated, one per set) merged."""
    parts = [json.loads(_text(Path(p))) for p in paths.split(",")]
    run = parts[0]
    # each set's own repeats (the files may differ: one repeat in an older file, two in a newer)
    run["repeats_of"] = {name: part["settings"]["repeats"] for part in parts for name in part["sets"]}
    for part in parts[1:]:
        run["sets"].update(part["sets"])
    return run


def compare_files(paths: list[str], out: str | Path | None = None) -> str:
    """`compare` over `eagle-hf bench` results files (one entry per process; a process's per-set files joined by
    commas); the markdown table, also written to `out` (with a JSON copy beside it) when given."""
    runs = [read_run(p) for p in paths]
    verdicts = compare(runs)
    text = markdown(verdicts, runs)
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_file(out, text)
        write_file(out.with_suffix(".json"), json.dumps(
            [dict(v.__dict__, verdict=v.verdict, relative=v.relative) for v in verdicts], indent=1))
    return text
