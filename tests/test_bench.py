"""`eagle-hf bench` on tiny models: every field present, and a broken mode's differing outputs are reported."""

import json
import math

import pytest
from conftest import tiny_drafter

from eagle_hf.tools.bench import (
    Mode,
    custom_mode,
    parse_mode,
    results_markdown,
    run_benchmark,
    standard_modes,
    write_results,
)


def _parts(tmp_path):
    from test_training import peaky_target, tiny_tokenizer, write_prompts

    target, tok = peaky_target(), tiny_tokenizer()
    target.name_or_path = "tiny"
    return target, tok, tiny_drafter(target), str(write_prompts(tmp_path / "p.jsonl", n=3))


def test_bench_results_have_every_field(tmp_path):
    target, tok, drafter, prompts = _parts(tmp_path)
    modes = standard_modes(drafter, chain_lengths=(3,))
    res = run_benchmark(target, tok, modes, [prompts], max_new_tokens=12, limit=3, repeats=2)
    out = write_results(res, tmp_path / "out")
    data = json.loads((out / "results.json").read_text())
    assert {"settings", "machine", "sets", "peak_rss_mb"} <= set(data)
    assert {"torch", "transformers", "platform", "threads"} <= set(data["machine"])
    entry = data["sets"][prompts]
    assert set(entry) == {m.name for m in modes}
    for name, e in entry.items():
        assert {"tok_s_median", "tok_s_iqr", "speedup_median", "speedup_total", "speedups", "mismatches", "prompts"} <= set(e)
        assert e["mismatches"] == []  # greedy: every mode reproduces plain generate()
        # per call (3 prompts x 2 repeats): tokens and seconds, whose ratio is the call's rate
        assert len(e["tokens"]) == len(e["seconds"]) == len(e["speedups"]) == 6 and all(e["tokens"])
        assert e["texts"] == entry["plain"]["texts"]  # float32, greedy: every call wrote plain's text
        if name.startswith("eagle"):
            assert {"mean_acceptance_length", "acceptance_per_position", "drafter_share"} <= set(e)
    assert entry["plain"]["speedup_median"] == 1.0
    assert (out / "results.md").read_text().count("|") > 20
    assert (out / "speedup.png").stat().st_size > 1000


def test_bench_detects_a_broken_mode(tmp_path, monkeypatch):
    target, tok, _, prompts = _parts(tmp_path)
    broken = Mode("broken", {"repetition_penalty": 5.0})  # changes the output: must be reported
    res = run_benchmark(target, tok, [Mode("plain"), broken], [prompts], max_new_tokens=12, limit=3)
    assert res["sets"][prompts]["broken"]["mismatches"], "a differing output must be flagged"
    assert "broken" in results_markdown(res)


def test_sampling_draws_every_mode_from_one_seed_a_new_one_each_repeat(tmp_path, monkeypatch):
    """Each mode of a prompt samples from the same seed; each repeat from another (a repeat of the same draw would
    hide the drawn text's share of the noise from the A/A band)."""
    from eagle_hf.tools import bench

    target, tok, _, prompts = _parts(tmp_path)
    seeds, generate = [], bench._generate
    monkeypatch.setattr(bench, "_generate", lambda *a: (seeds.append((a[2].name, a[-1])), generate(*a))[1])
    run_benchmark(target, tok, [Mode("plain"), Mode("again")], [prompts], max_new_tokens=4, limit=2, repeats=2,
                  temperature=0.7)
    calls = seeds[2:]  # (after the warm-up)
    assert sorted(calls) == sorted((m, s) for m in ("plain", "again") for s in (0, 1, 2, 3))


def test_a_mode_of_ones_own(tmp_path):
    target, tok, drafter, prompts = _parts(tmp_path)
    name, kwargs = parse_mode('copy b1={"draft_sources": "copy", "copy_branches": 1}')
    assert (name, kwargs) == ("copy b1", {"draft_sources": "copy", "copy_branches": 1})
    assert "assistant_model" not in custom_mode(name, kwargs, drafter).kwargs  # copy alone: no drafter
    mine = custom_mode(*parse_mode('depth 3={"tree_depth": 3}'), drafter)
    assert mine.kwargs["assistant_model"] is drafter
    res = run_benchmark(target, tok, [Mode("plain"), mine], [prompts], max_new_tokens=12, limit=2)
    assert res["sets"][prompts]["depth 3"]["mismatches"] == []


@pytest.mark.parametrize("spec,match", [("nojson", "NAME=JSON"), ("x={bad", "Expecting"), ("x=[1]", "JSON object"),
                                        ('plain={"a": 1}', "standard mode")])
def test_a_bad_mode_is_refused_before_any_model_loads(spec, match, capsys):
    from eagle_hf.cli import main

    with pytest.raises(ValueError, match=match):
        parse_mode(spec)
    assert main(["bench", "--target", "/nonexistent", "--mode", spec]) == 2
    assert "--mode" in capsys.readouterr().err


def test_every_cli_option_has_help_text():
    """`eagle-hf <command> --help` documents every option (its default is shown by the formatter)."""
    import argparse

    from eagle_hf.cli import build_parser

    root = build_parser()
    (commands,) = [a for a in root._actions if isinstance(a, argparse._SubParsersAction)]
    parsers = {"eagle-hf": root, **{f"eagle-hf {name}": p for name, p in commands.choices.items()}}
    assert {"eagle-hf generate", "eagle-hf bench", "eagle-hf demo", "eagle-hf train"} <= set(parsers)
    missing = [f"{prog} {' '.join(a.option_strings) or a.dest}" for prog, p in parsers.items() for a in p._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help]
    assert not missing, missing
    assert "generate, bench, demo, train" in root.description
    assert "eagle chain adaptive" in parsers["eagle-hf bench"].format_help()
    assert "(default: 128)" in parsers["eagle-hf generate"].format_help()


def test_every_shipped_prompt_set_loads_with_its_licence_noted():
    from eagle_hf.tools.evaluation import COPY_SETS, KIND_SETS, PROMPT_DIR, PROMPT_SETS, load_prompt_set

    readme = (PROMPT_DIR / "README.md").read_text()
    for name in PROMPT_SETS + COPY_SETS + KIND_SETS:
        prompts = load_prompt_set(name)
        assert len(prompts) >= (9 if name == "multi_turn" else 40), name
        assert all(text for _, text in prompts) and f"`{name}.jsonl`" in readme, name


def _run(speedups: dict[str, list[float]], repeats: int = 2) -> dict:
    """A fake `eagle-hf bench` results dict of one set: per mode, per-prompt speedups repeat after repeat."""
    calls = [{"cycles": 3, "plain_steps": 1, "drafted_by_source": {"copy": 9}, "accepted_by_source": {"copy": 4}}] * 8
    return {"settings": {"repeats": repeats, "max_new_tokens": 128, "temperature": 0.0, "batch_size": 1},
            "machine": {"target": "t", "dtype": "bf16", "device": "cpu", "threads": 2},
            "sets": {"s": {m: {"speedups": v, "calls": calls} for m, v in speedups.items()}}}


def test_best_of_sources_chooses_on_one_repeat_and_scores_on_the_others():
    from eagle_hf.tools.best_of_sources import compare, markdown

    run1 = _run({"eagle default": [2.0, 2.0, 2.0, 2.0, 1.9, 2.0, 2.1, 2.0],
                 "copy alone": [2.2, 2.2, 2.2, 2.2, 2.0, 2.0, 2.0, 2.0],  # lucky on repeat 1
                 "eagle alone": [1.2] * 8, "prompt-lookup": [1.5] * 8})
    run2 = _run({"eagle default": [1.95] * 8, "copy alone": [2.0] * 8, "eagle alone": [1.2] * 8,
                 "prompt-lookup": [1.5] * 8})
    (v,) = compare([run1, run2])
    assert v.chosen == "copy alone" and v.best == pytest.approx(2.0)  # its repeat-1 luck is not scored
    assert v.band == pytest.approx(0.2 / 2.1)  # copy alone against itself: 2.2 vs 2.0
    assert v.verdict == "within noise" and v.per_process == [2.0, 1.95] and v.processes_agree
    assert v.worst and v.worst[0]["default"]["cycles"] == 3
    assert "| s | 4 |" in markdown([v], [run1, run2])
    behind = _run({"eagle default": [1.5] * 4 + [1.5] * 4, "copy alone": [2.0] * 4 + [2.0] * 4}, repeats=2)
    (v,) = compare([behind])
    assert v.verdict == "behind" and v.relative == pytest.approx(-0.25)


def test_the_worst_prompts_are_explained_by_the_repeat_that_scored_them():
    """One repeat in each of two processes: the ratios are the second process's, so are the round records."""
    from eagle_hf.tools.best_of_sources import compare

    run1 = _run({"eagle default": [2.0] * 4, "copy alone": [2.2] * 4}, repeats=1)
    run2 = _run({"eagle default": [2.0, 2.0, 0.5, 2.0], "copy alone": [2.0] * 4}, repeats=1)
    run2["sets"]["s"]["eagle default"]["calls"] = [
        {"cycles": c, "plain_steps": 0, "drafted_by_source": {}, "accepted_by_source": {}} for c in (7, 7, 2, 7)]
    (v,) = compare([run1, run2])
    assert v.worst[0]["prompt"] == 2 and v.worst[0]["default"]["cycles"] == 2  # run 2's call, not run 1's (3)


def test_calls_are_split_by_whether_the_default_wrote_the_chosen_sources_text():
    """bf16 flips near-ties: a loss where the two wrote different texts is the text's, not the decisions'. The
    split reads the scoring calls only; the worst prompts say whether their texts were the same."""
    from eagle_hf.tools.best_of_sources import compare, markdown

    run = _run({"eagle default": [2.0] * 4 + [2.0, 2.0, 1.0, 2.1], "copy alone": [2.0] * 8}, repeats=2)
    sets = run["sets"]["s"]
    sets["eagle default"].update(texts=list("abcdabxd"), tokens=[128] * 6 + [40, 128], seconds=[1.1] * 8)
    sets["copy alone"].update(texts=list("abcdabcd"), tokens=[128] * 8, seconds=[1.0] * 8)
    (v,) = compare([run])
    assert sorted(v.by_text["same"]) == pytest.approx([1.0, 1.0, 1.05]) and v.by_text["different"] == [0.5]
    assert v.worst[0]["prompt"] == 2 and v.worst[0]["tokens"] == {"default": 40, "chosen": 128}
    text = markdown([v], [run])
    assert "| s | 3 of 4 | 1.00 (1.00-1.05) | 0.50 | 3 of 4, 4 of 4 |" in text
    # the same work (same text, same rounds, copies alone): the default's time over copy alone's, every call
    assert v.same_rounds == pytest.approx([1.1] * 7) and "| 7: 1.10 (1.10-1.10) |" in text
    assert "different: 40 / 128 tokens" in text
    assert v.steady_texts == {"eagle default": 3, "copy alone": 4}  # prompt 2: "c", then "x"
    del sets["eagle default"]["texts"]  # runs from before the fingerprints: no split, no note
    (v,) = compare([run])
    assert v.by_text is None and "Same text" not in markdown([v], [run])


def test_a_process_joins_files_of_different_repeats_set_by_set(tmp_path):
    """One process's sets from two files, one repeat in one and two in the other: each set split by its own."""
    from eagle_hf.tools.best_of_sources import compare, markdown, read_run

    one = _run({"eagle default": [2.0] * 4, "copy alone": [1.0] * 4}, repeats=1)
    two = _run({"eagle default": [3.0] * 4 + [3.3] * 4, "copy alone": [1.0] * 8}, repeats=2)
    two["sets"] = {"t": two["sets"]["s"]}
    (tmp_path / "one.json").write_text(json.dumps(one))
    (tmp_path / "two.json").write_text(json.dumps(two))
    run = read_run(f"{tmp_path / 'two.json'},{tmp_path / 'one.json'}")
    again = _run({"eagle default": [2.2] * 4, "copy alone": [1.0] * 4}, repeats=1)
    again["sets"]["t"] = _run({"eagle default": [3.0] * 4, "copy alone": [1.0] * 4})["sets"]["s"]
    t, s = compare([run, again])
    assert (t.name, t.per_process) == ("t", [pytest.approx(3.15), 3.0])  # two repeats, then one
    assert (s.name, s.per_process) == ("s", [2.0, 2.2])  # one repeat, then one
    assert "2/3 repeats (per set, as its files)" in markdown([t, s], [run, again])


def test_the_swap_band_is_the_noise_of_a_median_over_these_prompts():
    """Swapping each prompt's values between two runs at random: identical runs give a band of 0; runs that differ
    prompt by prompt give a band however close their medians happen to land; the same values, the same band."""
    import random

    from eagle_hf.tools.best_of_sources import compare, swap_gap

    a = [1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2]
    assert swap_gap(a, a, random.Random(0)) == 0.0
    b = [1.3, 0.9, 1.7, 1.6, 1.5, 2.3, 1.9]  # the same median (1.6), each prompt 0.3 off
    assert swap_gap(a, b, random.Random(0)) > 0.05
    assert swap_gap(a, b, random.Random(0)) == swap_gap(a, b, random.Random(0))
    run1 = _run({"eagle default": [2.0] * 7, "copy alone": a}, repeats=1)
    run2 = _run({"eagle default": [2.2] * 7, "copy alone": b}, repeats=1)
    (v,) = compare([run1, run2])
    assert v.band == 0.0 and not v.processes_agree  # the realised A/A gap: 0, by luck
    assert v.process_gap == pytest.approx(0.2 / 2.1) and v.process_gap <= v.swap_band


def test_paired_moves_compare_each_prompt_with_itself_run_against_run():
    """A median over prompts whose speedups span a wide range jumps when the prompt at the middle moves; the
    paired figures (each prompt's last run over its first) see a mode move as a whole, and how far prompts wander."""
    from eagle_hf.tools.best_of_sources import compare, markdown, paired_move

    assert paired_move([1.0, 2.0, 4.0], [1.0, 2.0, 4.0]) == (1.0, 0.0)
    ratio, move = paired_move([1.0, 2.0, 4.0], [1.1, 2.2, 4.4])
    assert ratio == pytest.approx(1.1) and move == pytest.approx(math.log(1.1))
    # one prompt of the default moves (the middle one, to its neighbour's value): its median jumps from 3.0 to 5.0
    default1, default2 = [1.0, 2.0, 3.0, 5.0, 8.0], [1.0, 2.0, 5.0, 5.0, 8.0]
    run1 = _run({"eagle default": default1, "copy alone": [1.0, 2.0, 3.0, 5.0, 8.0]}, repeats=1)
    run2 = _run({"eagle default": default2, "copy alone": [1.1, 2.2, 3.3, 5.5, 8.8]}, repeats=1)
    (v,) = compare([run1, run2])
    assert v.process_gap == pytest.approx(0.5) and not v.processes_agree
    assert v.paired["copy alone"] == pytest.approx((1.1, math.log(1.1)))
    assert v.paired_band == pytest.approx((0.1, math.log(1.1)))
    assert v.paired["eagle default"][0] == pytest.approx(1.0)
    assert "1.00, moves" in markdown([v], [run1, run2])


def test_process_spread_is_the_gap_between_two_processes_over_every_pair():
    """Several processes of the same code: per mode, the median and 90th percentile over every pair of processes
    of the gap between their set medians (and their total-time speedups); plain is the yardstick, not a mode."""
    from eagle_hf.tools.best_of_sources import process_spread, spread_markdown

    def run(median, total):
        return {"sets": {"s": {"plain": {"speedup_median": 1.0, "speedup_total": 1.0},
                               "copy alone": {"speedup_median": median, "speedup_total": total}}}}

    spread = process_spread([run(2.0, 2.0), run(2.0, 2.2), run(3.0, 2.0)])
    x = spread["s"]["copy alone"]
    assert "plain" not in spread["s"] and x["processes"] == 3 and (x["low"], x["high"]) == (2.0, 3.0)
    assert x["median_gap"] == pytest.approx(0.4) and x["p90_gap"] == pytest.approx(0.4)  # gaps 0, 0.4, 0.4
    assert x["total_median_gap"] == pytest.approx(0.2 / 2.1) and x["total_p90_gap"] == pytest.approx(0.2 / 2.1)
    assert "| s | copy alone | 3 | 2.00x / 3.00x | 40.0% / 40.0% |" in spread_markdown(spread)


def test_chat_inputs_without_a_chat_template():
    """A pretrained model's tokenizer (no chat template, as Gemma 3 270M's) gets the messages' text."""

    from eagle_hf.tools.evaluation import chat_inputs

    class Plain:
        chat_template = None

        def __call__(self, text):
            self.text = text
            return {"input_ids": [1, 2]}

    tok = Plain()
    enc = chat_inputs(tok, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "cpu")
    assert tok.text == "a\n\nb\n\n" and enc["input_ids"].tolist() == [[1, 2]]
