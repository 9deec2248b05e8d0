"""benchmarks/vllm_comparison.py: the comparison of what vLLM served (benchmarks/serve_with_vllm.py) with plain
generate() and eagle_hf's chain, checked on made-up counters and on the run docs/serving.md reports (its raw
outputs are saved in docs/results/vllm_serving.json; vLLM itself is not installed here)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAVED = ROOT / "docs" / "results" / "vllm_serving.json"


def _script():
    spec = importlib.util.spec_from_file_location("vllm_comparison", ROOT / "benchmarks" / "vllm_comparison.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cmp = _script()


def test_outputs_equal_up_to_a_trailing_stop_token():
    ref = {"a": [5, 6, 2], "b": [5, 6, 7], "c": [5, 6, 7]}
    served = {"a": [5, 6], "b": [5, 9, 7], "c": [5, 6]}
    res = cmp.compare_outputs(ref, served, stop_ids=[2])
    assert res["equal"] == 1 and res["prompts"] == 3
    assert res["per_prompt"]["a"]["equal"]
    assert res["per_prompt"]["b"]["first_difference"] == 1
    assert res["per_prompt"]["c"]["first_difference"] == 2  # a prefix is not equal


def test_a_prompt_missing_from_the_served_outputs_is_named():
    with pytest.raises(KeyError, match="'b'"):
        cmp.compare_outputs({"a": [1], "b": [2]}, {"a": [1]}, stop_ids=[])


def test_vllm_acceptance_from_its_counters():
    """10 rounds of 5 drafts: position i accepted in 8, 6, 4, 2, 1 of them; tau = 1 + 21 / 10."""
    counters = {"num_drafts": 10, "num_draft_tokens": 50, "num_accepted_tokens": 21,
                "num_accepted_tokens_per_pos": [8, 6, 4, 2, 1]}
    res = cmp.vllm_acceptance(counters)
    assert res["mean_acceptance_length"] == pytest.approx(3.1)
    assert res["acceptance_per_position"] == pytest.approx([0.8, 0.6, 0.4, 0.2, 0.1])
    assert cmp.vllm_acceptance({**counters, "num_drafts": 0})["mean_acceptance_length"] == 0.0


def test_the_saved_run_compares_to_the_figures_it_reports():
    """The comparison recomputed from the saved raw outputs gives the saved figures (and docs/serving.md's)."""
    saved = json.loads(SAVED.read_text())
    again = cmp.compare_run(saved["reference"], saved["served"])
    assert again["drafters"] == saved["drafters"]
    assert set(saved["drafters"]) >= {"shipped", "trained"}
    table = cmp.markdown(again)
    assert table in (ROOT / "docs" / "serving.md").read_text()


def test_references_of_several_folders_merge_when_their_plain_outputs_agree():
    a = {"max_new_tokens": 4, "plain": {"1": [3, 4]}, "drafters": {"x": {"outputs": {}}}}
    b = {"max_new_tokens": 4, "plain": {"1": [3, 4]}, "drafters": {"y": {"outputs": {}}}}
    assert set(cmp.merge_references([a, b])["drafters"]) == {"x", "y"}
    with pytest.raises(ValueError, match="plain"):
        cmp.merge_references([a, {**b, "plain": {"1": [3, 5]}}])
