"""Copy drafting: the n-gram index, branch sizing, the copy tree and its grafting, losslessness, stats, bad input."""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import tiny_drafter, tiny_target
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

import eagle_hf
from eagle_hf.speculation.copying import MAX_OCCURRENCES, CopyIndex, CopySource, Wait
from eagle_hf.speculation.settings import DraftSettings, DraftSettingsError
from eagle_hf.speculation.speculator import plan_round
from eagle_hf.speculation.stats import merge_stats
from eagle_hf.speculation.tree import COPY, EAGLE, DraftTree


def test_index_prefers_the_longest_then_the_most_recent_match():
    index = CopyIndex(max_ngram=3)
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3])  # suffix (1, 2, 3) occurred at the start
    (first, n1), (second, n2) = index.matches(num_branches=2, length=3)
    assert (first, n1) == ([4, 9, 2], 3)  # the 3-gram match
    assert (second, n2) == ([5, 7, 1], 2)  # then (2, 3): its other occurrence
    assert index.matches(1, 2) == [([4, 9], 3)]


def test_a_continuation_cut_by_the_end_of_the_text_is_the_longer_one_that_runs_on():
    """The suffix (1, 2) occurred just before the end, where its continuation is cut short (3, 1, 2 and then the
    text ends), and long ago, where the same tokens ran on: the branch is the longer continuation, in the rank
    of the recent one; different continuations keep their own ranks."""
    index = CopyIndex(max_ngram=2)
    index.extend([1, 2, 3, 1, 2, 6, 8, 9, 1, 2, 4, 1, 2, 3, 1, 2])
    assert index.matches(num_branches=8, length=5) == [([3, 1, 2, 6, 8], 2), ([4, 1, 2, 3, 1], 2),
                                                       ([6, 8, 9, 1, 2], 2)]


def test_index_update_and_lookup_cost_do_not_grow_with_the_context():
    index = CopyIndex(max_ngram=4)
    index.extend([7] * 5000)  # one n-gram occurring everywhere: the worst case for a scan
    before = len(index.ends)
    index.extend([7])
    assert len(index.ends) == before  # O(max_ngram) entries touched per token, no rescan
    ends = index.ends[(7,)]
    seen = []

    class Spy(list):
        def __reversed__(self):
            for e in list.__reversed__(self):
                seen.append(e)
                yield e

    index.ends = {k: Spy(v) for k, v in index.ends.items()}
    index.matches(num_branches=8, length=4)
    assert len(seen) <= 4 * (MAX_OCCURRENCES + 1) and len(ends) > 5000  # bounded scan at any length


def _source(cost=0.1):
    return CopySource(max_ngram=3, length=12, num_branches=1, marginal_cost=lambda n: cost, probe_every=4)


def _round(src, **kw):
    """A round's branches from `src`, its proposal executed as a round's plan executes it."""
    proposal = src.propose(**kw)
    src.begin_round(proposal.branches, proposal.wait)
    return src.branches


def test_a_reliable_source_earns_long_branches_and_a_failing_one_is_dropped_then_retried():
    src = _source()
    src.index.extend(list(range(20)) + [0, 1, 2])  # the suffix (0, 1, 2) continues with 3..14
    first = len(_round(src, room=50, verified=16)[0].tokens)
    for _ in range(20):
        _round(src, room=50, verified=16)
        src.update(src.branches[0].tokens)  # every copy token accepted
    assert len(_round(src, room=50, verified=16)[0].tokens) == 12 > first
    assert len(_round(src, room=5, verified=16)[0].tokens) == 5  # never past the room left
    for _ in range(40):  # now it keeps failing
        if _round(src, room=50, verified=16):
            src.update([-1])  # the first copy token rejected
    rounds = [bool(_round(src, room=50, verified=16)) for _ in range(40)]
    assert 0 < sum(rounds) < 10  # mostly dropped, retried now and then


def test_a_proposal_changes_nothing_until_the_plan_executes_it():
    """`propose` only proposes: the source's branches and its wait change when the round's plan is executed."""
    src = _source()
    src.index.extend(list(range(20)) + [0, 1, 2])
    for _ in range(40):  # a failing source: dropped
        if _round(src, room=50, verified=16):
            src.update([-1])
    before = (src.backoff.skipped, src.backoff.wait, list(src.branches))
    proposals = [src.propose(room=50, verified=16) for _ in range(10)]
    assert (src.backoff.skipped, src.backoff.wait, src.branches) == before
    assert all(p == proposals[0] for p in proposals) and proposals[0].wait == Wait.SKIP


def test_a_batch_decides_when_its_rows_retry():
    """In a batch where drafting does not pay, a row's copy source retries in the rounds the batch retries (every row
    pays for the widest row's tree), never on its own wait."""
    src = _source()
    src.index.extend(list(range(20)) + [0, 1, 2])
    for _ in range(40):  # a failing source: dropped
        if _round(src, room=50, verified=1, retry_only=True):
            src.update([-1])
    assert not any(_round(src, room=50, verified=1, retry_only=True, retry=False) for _ in range(100))
    assert [len(b.tokens) for b in _round(src, room=50, verified=1, retry_only=True, retry=True)] == [2]


def test_a_branch_ends_at_an_eos_token():
    """Nothing after an EOS is ever emitted: a copy of an earlier turn stops at its end instead of running on into
    the next turn's header."""
    src = CopySource(max_ngram=3, length=12, num_branches=1, marginal_cost=lambda n: 0.0, stop_tokens={99})
    src.index.extend([5, 6, 7, 8, 99, 1, 2, 3, 5, 6])  # (5, 6) continues with 7, 8, then EOS, then the next turn
    assert src.propose(room=50, verified=1).branches[0].tokens == [7, 8, 99]


def test_the_copy_tree_shares_prefixes_and_grafts_onto_the_drafters_tree():
    """A round's branches are one tree below the text's last token (a prefix two branches share is one path, each
    token scored by the acceptance estimate); grafted onto the drafter's tree, a node both proposed is one, marked
    as both's, and a copy node keeps its own log-probability below its new parent."""
    from eagle_hf.speculation.copying import Branch

    src = _source()
    src.index.extend([4, 2, 5])
    src.begin_round([Branch([8, 6, 7], 2), Branch([8, 6, 1], 1), Branch([3], 1)])
    copy = src.tree
    assert copy.host.tokens == [5, 8, 6, 7, 1, 3] and copy.host.parents == [-1, 0, 1, 2, 2, 0]
    assert copy.host.sources == [EAGLE, COPY, COPY, COPY, COPY, COPY]
    first, later = src.acceptance.first[1], src.acceptance.later
    assert copy.host.scores[3] == pytest.approx(math.log(first) + 2 * math.log(later), abs=1e-6)
    tree = DraftTree(torch.tensor([5, 8, 9, 4]), torch.tensor([-1, 0, 0, 1]), torch.tensor([0.0, -0.1, -2.0, -0.5]))
    grafted = tree.graft(copy)
    assert grafted.tokens.tolist() == [5, 8, 9, 4, 6, 7, 1, 3]
    assert grafted.parents.tolist() == [-1, 0, 0, 1, 1, 4, 4, 0]
    assert grafted.sources.tolist() == [EAGLE, EAGLE | COPY, EAGLE, EAGLE, COPY, COPY, COPY, COPY]
    assert grafted.scores[4].item() == pytest.approx(-0.1 + math.log(later), abs=1e-6)


def test_a_branch_that_repeats_a_token_keeps_every_token():
    """A copied run of one token ("395 395 395", a repeated line's padding) is a path of as many nodes, in the copy
    tree and grafted onto a drafter's tree that drafted the token once: none is taken for the node above it."""
    from eagle_hf.speculation.copying import Branch

    src = _source()
    src.index.extend([4, 2, 5])
    src.begin_round([Branch([7, 7, 7], 2)])
    assert src.tree.host.tokens == [5, 7, 7, 7] and src.tree.host.parents == [-1, 0, 1, 2]
    drafter = DraftTree.of_lists([5, 7], [-1, 0], [0.0, -0.1])
    grafted = drafter.graft(src.tree)
    assert grafted.host.tokens == [5, 7, 7, 7] and grafted.host.parents == [-1, 0, 1, 2]
    assert grafted.host.sources == [EAGLE, EAGLE | COPY, COPY, COPY]


def test_the_drafter_learns_only_its_own_nodes_beside_copy_branches():
    """A greedy round lays copy branches out beside the drafter's nodes (`_beside`): the tree keeps who proposed
    each node, so the schedule learns the drafter's acceptance from its own nodes, not from the copies'."""
    from eagle_hf.speculation.drafting import _beside
    from eagle_hf.speculation.rounds import Round, RoundRecord

    copy = DraftTree.of_lists([5, 8, 6, 7], [-1, 0, 1, 2], [0.0, -0.1, -0.2, -0.3], [EAGLE, COPY, COPY, COPY])
    tree, columns = _beside([5, 8, 9], [-1, 0, 0], [0.0, -0.1, -2.0], copy, width=4)
    assert tree.host.sources == tree.sources.tolist()
    assert tree.sources.tolist() == [EAGLE, EAGLE | COPY, EAGLE, COPY | EAGLE, COPY, COPY]
    assert columns == [0, 1, 2, 4, 5, 6]
    record = RoundRecord(Round.DRAFT, 3, 7, tree=tree, path=[0, 3, 4, 5], eagle_depth=1)
    assert record.drafter_outcome == (1, 1)  # its depth-1 node, accepted; the copy's deeper nodes are not its


REPEAT = torch.tensor([[5, 17, 33, 8, 61, 12, 5, 17, 33, 8, 61, 12, 5, 17]])  # a prompt that invites copying


@pytest.mark.parametrize("mode,sources", [("tree", "eagle+copy"), ("tree", "copy"), ("chain", "eagle+copy"),
                                          ("chain", "copy")])
def test_copy_drafting_is_exact_greedy(mode, sources):
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ref = target.generate(REPEAT, max_new_tokens=40, do_sample=False)
    # (a constant schedule: the adaptive one sizes copies from timings, which a busy machine skews)
    out = target.generate(REPEAT, max_new_tokens=40, do_sample=False, assistant_model=drafter, draft_mode=mode,
                          draft_sources=sources, num_assistant_tokens_schedule="constant")
    assert torch.equal(out, ref)
    s = eagle_hf.last_stats()
    assert s.drafted_by_source["copy"] > 0 and s.accepted_by_source["copy"] > 0
    if sources == "copy":  # (with both, a random drafter mostly rests beside a reliable copy: not asserted)
        assert "eagle" not in s.drafted_by_source and s.drafter_time == 0
    assert s.accepted == sum(s.accepted_per_position)


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_generate_hands_the_eos_ids_to_the_copy_source(monkeypatch, mode):
    from eagle_hf.speculation import copying

    seen = []
    init = copying.CopySource.__init__
    monkeypatch.setattr(copying.CopySource, "__init__",
                        lambda self, *a, **k: (seen.append(set(k.get("stop_tokens", ()))), init(self, *a, **k))[1])
    target = tiny_target("llama")
    target.generate(REPEAT, max_new_tokens=4, do_sample=False, eos_token_id=[7, 11], draft_mode=mode,
                    draft_sources="copy")
    assert seen == [{7, 11}]


def test_copy_alone_needs_no_drafter():
    target = tiny_target("qwen2")  # another family, and no drafter at all
    ref = target.generate(REPEAT, max_new_tokens=40, do_sample=False)
    out = target.generate(REPEAT, max_new_tokens=40, do_sample=False, draft_sources="copy")
    assert torch.equal(out, ref)
    s = eagle_hf.last_stats()
    assert set(s.drafted_by_source) == {"copy"} and s.accepted_by_source["copy"] > 0 and s.drafter_time == 0


def test_default_tree_mode_copies_and_reports_per_source_stats():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ref = target.generate(REPEAT, max_new_tokens=40, do_sample=False)
    out = target.generate(REPEAT, max_new_tokens=40, do_sample=False, assistant_model=drafter,
                          num_assistant_tokens_schedule="constant")  # (the adaptive schedule sizes copies from
    # timings, which a busy machine skews: this tests the default sources and their stats, not adaptation)
    assert torch.equal(out, ref)
    s = eagle_hf.last_stats()
    per = s.acceptance_per_position_by_source
    assert set(per) <= {"eagle", "copy"} and "copy" in per and all(0 <= a <= 1 for a in per["copy"])
    assert "copy accepted" in s.summary()
    merged = merge_stats([s, s])
    assert merged.drafted_by_source["copy"] == 2 * s.drafted_by_source["copy"]
    assert merged.accepted_per_position_by_source["copy"] == [2 * a for a in s.accepted_per_position_by_source["copy"]]


def test_listeners_see_who_proposed_each_draft():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    seen = []
    # (a constant schedule: the adaptive one rests from timings, which a busy machine skews)
    target.generate(REPEAT, max_new_tokens=30, do_sample=False, assistant_model=drafter, draft_mode="tree",
                    draft_sources="eagle+copy", num_assistant_tokens_schedule="constant",
                    draft_listeners=[lambda d, n, last, sources: seen.append((d, sources)), lambda d, n, last: None])
    assert seen and all(len(d) == len(src) for d, src in seen)
    assert {x for _, src in seen for x in src} <= {"eagle", "copy", "eagle+copy"}
    assert any("copy" in x for _, src in seen for x in src)


@pytest.mark.parametrize("name,value", [("copy_length", 0), ("copy_length", 65), ("copy_ngram", 0),
                                        ("copy_ngram", 17), ("copy_branches", 0), ("copy_branches", 9)])
def test_copy_settings_out_of_range_name_the_range(name, value):
    with pytest.raises(DraftSettingsError, match=rf"{name} must be in \d+\.\.\d+, got {value}"):
        DraftSettings.resolve(None, None, {name: value})
    with pytest.raises(DraftSettingsError, match="draft_sources must be one of"):
        DraftSettings.resolve(None, None, {"draft_sources": "ngram"})


def test_copy_branches_default_two_beside_the_drafter_or_alone():
    assert DraftSettings.resolve(None, None, {}).copy_branch_count == 2
    assert DraftSettings(draft_sources="copy").copy_branch_count == 2
    assert DraftSettings.resolve(None, None, {"draft_sources": "copy", "copy_branches": 3}).copy_branch_count == 3


def test_sampling_with_copy_branches_is_lossless():
    """Deterministic copy branches beside the drafter's sampled branches: the chi-square test of
    tests/test_sampling.py against the exact distribution of the target alone."""
    from test_sampling import PROMPT, VOCAB, chi_square, exact_distribution, marginal

    target = tiny_target("llama", vocab=VOCAB)
    with torch.no_grad():
        target.model.norm.weight.mul_(6.0)
    drafter = tiny_drafter(target)
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(6)])
    torch.manual_seed(77)
    rows, copied, accepted = [], 0, 0
    for _ in range(800):
        out = target.generate(PROMPT, assistant_model=drafter, do_sample=True, temperature=0.9, top_k=6,
                              max_new_tokens=4, draft_mode="tree", draft_sources="eagle+copy", tree_top_k=2,
                              tree_total_tokens=5, num_assistant_tokens_schedule="constant", tree_depth=2)
        rows.append(tuple(out[0, PROMPT.shape[1]:].tolist()))
        s = eagle_hf.last_stats()
        copied += s.drafted_by_source.get("copy", 0)
        accepted += s.accepted_by_source.get("copy", 0)
    exact = exact_distribution(target, processors, 3)
    p12 = chi_square(rows, marginal(exact, (0, 1)), (0, 1))
    p23 = chi_square(rows, marginal(exact, (1, 2)), (1, 2))
    assert copied > 400 and 0 < accepted < copied
    assert p12 > 1e-3 and p23 > 1e-3, (p12, p23)


def test_copy_drafting_where_the_own_loop_cannot_run(caplog):
    """A target whose layers the tree mask cannot cover runs chains in transformers' loop: copy alone decodes
    plainly with a warning that names why and the alternatives; both sources fall back to the drafter alone,
    exactly."""
    from test_tree import unmaskable_target

    target = unmaskable_target()
    drafter = tiny_drafter(target)
    with caplog.at_level("WARNING", logger="eagle_hf"):
        out = target.generate(REPEAT, max_new_tokens=8, do_sample=False, draft_sources="copy")
    assert "Decoding plainly" in caplog.text and "prompt_lookup_num_tokens" in caplog.text
    assert torch.equal(out, target.generate(REPEAT, max_new_tokens=8, do_sample=False))
    ref = target.generate(REPEAT, max_new_tokens=12, do_sample=False)
    out = target.generate(REPEAT, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                          draft_sources="eagle+copy")
    assert torch.equal(out, ref) and "copy" not in eagle_hf.last_stats().drafted_by_source


def test_branches_cut_to_fit_teach_only_what_was_verified():
    """Where a static cache has no room for every copy node, the plan keeps the first nodes of the copy tree
    (`cut_branches`): each branch is shortened to what is kept (gone if nothing), so its acceptance learns nothing about
    the tokens never verified."""
    from eagle_hf.speculation.copying import Branch, cut_branches

    branches = [Branch([1, 2, 3, 4], 2), Branch([5, 6], 2)]  # nodes: 1 2 3 4 | 5 6
    assert [b.tokens for b in cut_branches(branches, 2)] == [[1, 2]]
    assert [b.tokens for b in cut_branches(branches, 5)] == [[1, 2, 3, 4], [5]]
    assert [b.tokens for b in cut_branches([Branch([1, 2, 3], 1), Branch([1, 2, 9], 1)], 3)] == [[1, 2, 3], [1, 2]]
    src, uncut = _source(), _source()
    src.branches, uncut.branches = cut_branches(branches, 2), [Branch([1, 2, 3, 4], 2)]
    src.update([1, 2]), uncut.update([1, 2])  # a full hit of a 2-token branch, not a miss at the third of four
    assert vars(src.acceptance) != vars(uncut.acceptance)


def _speculator(sources: str, copy_first: float, drafter_acceptance: float):
    from eagle_hf.speculation.costs import CostModel
    from eagle_hf.speculation.schedule import DraftLengthController
    from eagle_hf.speculation.speculator import Speculator
    from eagle_hf.speculation.stats import SpecDecodeStats

    cost = CostModel(verify=[1.0 + 0.05 * i for i in range(64)], draft_step=0.1)  # a CPU-like verify curve
    controller = DraftLengthController(cost, max_draft=5, tree=(4, 16), acceptance=[drafter_acceptance] * 5)
    sp = Speculator(None, DraftSettings(draft_sources=sources), SpecDecodeStats(), controller)
    sp.copy.acceptance.first = [copy_first] * len(sp.copy.acceptance.first)
    sp.extend_context([1, 2, 3, 4, 5, 6, 7, 8, 9, 50, 2, 3, 4, 60, 61, 62, 63, 64, 65, 66, 70, 2, 3, 4])  # (2, 3, 4)
    # continued twice before: 5, 6, ... and 60, 61, ...
    return sp


def _depth(sp, room: int) -> int:
    """The drafter's depth in this row's plan of a round (`plan_round`), which the row then executes."""
    return plan_round([sp], [room]).depths[0]


def test_copy_branches_are_sized_alike_beside_the_drafter_or_alone():
    """A round where only copies draft is a copy-alone round: the same branches, not cut to leave the drafter's
    tree room (issue 35)."""
    rounds = {}
    for sources in ("eagle+copy", "copy"):
        sp = _speculator(sources, copy_first=0.6, drafter_acceptance=0.6)
        _depth(sp, room=50)
        rounds[sources] = [b.tokens for b in sp.copy.branches]
    assert rounds["eagle+copy"] == rounds["copy"] and len(rounds["copy"]) == 2
    assert len(rounds["copy"][0]) > 4


def test_each_round_drafts_with_the_sources_that_pay():
    """Of the copies alone, the drafter alone and both, the plan with the most tokens per cost (issue 35)."""
    streaming = _speculator("eagle+copy", copy_first=0.9, drafter_acceptance=0.5)
    assert _depth(streaming, room=50) == 0 and streaming.round == "draft"  # copies alone this round
    assert streaming.copy.branches
    failing = _speculator("eagle+copy", copy_first=0.1, drafter_acceptance=0.8)
    assert _depth(failing, room=50) > 0 and not failing.copy.branches  # the drafter alone: copies rest
    both = _speculator("eagle+copy", copy_first=0.15, drafter_acceptance=0.6)  # short copies, a shallow tree
    assert _depth(both, room=50) > 0 and both.copy.branches


def test_a_dropped_copy_source_retries_beside_a_drafter_that_pays():
    """A single row whose drafter pays: a copy source whose branches do not pay sits out its wait, then its retry
    drafts beside the drafter (its estimates refreshed), and a failed retry doubles its wait."""
    sp = _speculator("eagle+copy", copy_first=0.01, drafter_acceptance=0.8)
    wait = sp.copy.backoff.wait
    rounds = []
    for _ in range(3 * wait + 2):
        depth = _depth(sp, room=50)
        rounds.append(bool(sp.copy.branches))
        assert depth > 0  # the drafter drafts every round
        if sp.copy.branches:
            sp.copy.update([-1])  # the retry's first token rejected
    assert rounds.index(True) == wait  # sat out its wait, then retried
    assert sum(rounds) == 2 and rounds[wait + 1 :].index(True) == 2 * wait  # the next wait twice as long


def test_a_resting_drafter_drafts_beside_copies_where_its_margin_pays():
    """The controller rests a drafter whose rounds of its own would not pay; where copies draft anyway it costs
    only its margin beside them (its levels, its catch-up, a few more verified tokens), and joins the round when
    that pays (issue 35: a drafter dropped on its first rounds stayed out of the copies' rounds for the call)."""
    outcomes = {}
    for name, copy_first in (("missing", 0.1), ("streaming", 0.9)):
        sp = _speculator("eagle+copy", copy_first=copy_first, drafter_acceptance=0.45)
        c = sp.controller
        c.costs.cycle_overhead = 0.4  # a drafting round's own cost: dear enough that the drafter alone rests
        c.update(1, 1)  # (tried)
        c.acceptance.values = [0.45] * 5
        c._drafting = False
        assert c.best()[1] < c.min_gain
        outcomes[name] = _depth(sp, room=50), len(sp.copy.branches), c.backoff.skipped
    assert outcomes["missing"][0] > 0 and outcomes["missing"][1] > 0  # copies keep missing: the drafter joins them
    assert outcomes["missing"][2] == 0  # (its estimates refreshed, as by a retry: the wait starts again)
    assert outcomes["streaming"][0] == 0 and outcomes["streaming"][1] > 0  # copies stream: it rests


def test_copy_trace_records_each_round_and_the_rank_that_hit(tmp_path, monkeypatch):
    """benchmarks/copy_trace.py: every proposal of the copy source with its matches, branch lengths and how far each
    branch got; rounds summarised by kind and by the rank of the branch that reached furthest; the copy source
    is left as it was."""
    import importlib.util
    import json
    from pathlib import Path

    import eagle_hf.cli
    from eagle_hf.speculation import copying

    spec = importlib.util.spec_from_file_location(
        "copy_trace", Path(__file__).resolve().parent.parent / "benchmarks" / "copy_trace.py")
    trace = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trace)
    target = tiny_target("llama")
    monkeypatch.setattr(eagle_hf.cli, "main", lambda argv: target.generate(
        REPEAT, max_new_tokens=40, do_sample=False, draft_sources="copy"))
    monkeypatch.delenv("EAGLE_HF_COST_CACHE", raising=False)
    propose = copying.CopySource.propose
    result = trace.trace(str(tmp_path / "t.json"), [])
    assert copying.CopySource.propose is propose and "EAGLE_HF_COST_CACHE" not in os.environ  # (nothing leaks)
    rounds = json.loads((tmp_path / "t.json").read_text())["rounds"]
    assert sum(result["rounds"].values()) == len(rounds) > 0 and result["rounds"]["drafted"] > 0
    assert all(len(r["hits"]) == len(r["branches"]) for r in rounds if r["branches"])
    assert trace.summary([{"matches": [2, 1], "branches": [3, 2], "hits": [0, 2]},
                          {"matches": [], "branches": []}, {"matches": [1], "branches": []}]) == {
        "rounds": {"drafted": 1, "no match": 1, "matched, nothing drafted": 1},
        "hit rounds by the best branch's rank": {"rank 1": 1, "a later rank hit where the first missed": 1}}


def test_accepted_copy_paths_are_the_first_columns_where_copies_lead():
    """Where the last accepted draft was a copy's, the next round lays its copy branches out first: with a random
    drafter beside copies that are right (a prompt that repeats its first half), an accepted copy path is the
    verify's first columns and the cache's commit moves nothing (with the copies after the drafter's nodes, 10 of
    the 14 commits moved the accepted nodes)."""
    from unittest import mock

    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle_hf import EagleDrafter
    from eagle_hf.hf import cache

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=128, vocab_size=512)).eval()
    drafter = EagleDrafter.for_target(target, eagle31=True).eval()
    half = torch.randint(3, 512, (1, 24), generator=torch.Generator().manual_seed(1))
    prompt = torch.cat([half, half], 1)
    ref = target.generate(prompt, max_new_tokens=64, do_sample=False, pad_token_id=0)
    moved, commit = [], cache.TreeCache.commit

    def counted(self, past_len, index, *args, **kwargs):
        moved.append(index is not None)
        return commit(self, past_len, index, *args, **kwargs)

    with mock.patch.object(cache.TreeCache, "commit", counted):
        out = target.generate(prompt, max_new_tokens=64, do_sample=False, pad_token_id=0, assistant_model=drafter,
                              draft_mode="tree", tree_depth=5, tree_top_k=4, tree_total_tokens=16,
                              num_assistant_tokens_schedule="constant")
    assert torch.equal(out, ref)
    stats = eagle_hf.last_stats()
    assert stats.accepted_by_source["copy"] > 2 * stats.cycles  # (the copies are right, the drafter is not)
    assert sum(moved) <= 1, moved  # (the first copy path accepted, laid out after the drafter's nodes)
