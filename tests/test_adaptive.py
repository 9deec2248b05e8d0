"""Adaptive speculation: decisions on synthetic costs/acceptance; exactness and stats with adaptation on."""

import torch
from conftest import tiny_drafter, tiny_target

import eagle_hf
from eagle_hf.adaptive import CostModel, DraftLengthController, measure_costs

CPU_LIKE = CostModel(verify=[1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.4, 1.5], draft_step=0.06)


def test_falls_back_when_drafts_are_rejected_and_returns_when_they_are_accepted():
    c = DraftLengthController(CPU_LIKE, max_draft=8, probe_every=4)
    assert c.choose() > 0  # optimistic prior: starts drafting
    for _ in range(30):  # everything rejected
        k = c.choose()
        if k:
            c.update(k, 0)
    decisions = [c.choose() for _ in range(8)]
    assert decisions.count(0) >= 6 and any(decisions), decisions  # mostly plain, with periodic probes
    for _ in range(40):  # the drafter becomes good: probes succeed and drafting resumes
        k = c.choose()
        if k:
            c.update(k, k)
    assert c.choose() >= 5


def test_draft_length_follows_the_cost_curve():
    flat = CostModel(verify=[1.0] * 9, draft_step=0.01)  # GPU-like: verifying 9 tokens costs as much as 1
    steep = CostModel(verify=[1.0 + 0.5 * i for i in range(9)], draft_step=0.2)  # verify cost grows fast
    good = [0.8] * 8
    assert DraftLengthController(flat, acceptance=list(good)).best()[0] == 8
    k_steep, gain = DraftLengthController(steep, acceptance=list(good)).best()
    assert k_steep < 8 and gain > 1
    # deterministic: the same inputs give the same decision
    assert DraftLengthController(steep, acceptance=list(good)).best() == (k_steep, gain)


def test_expected_tokens():
    c = DraftLengthController(CPU_LIKE, acceptance=[0.5, 0.5, 0.5, 0, 0, 0, 0, 0])
    assert c.expected_tokens(3) == 1 + 0.5 + 0.25 + 0.125


def test_measured_costs_are_relative_and_monotone():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    drafter.bind_target_embedding(target.get_input_embeddings())
    cost = measure_costs(target, drafter, max_tokens=5, context=16, repeats=2)
    assert cost.verify[0] == 1.0 and all(b >= a for a, b in zip(cost.verify, cost.verify[1:]))
    assert cost.draft_step > 0


def test_adaptive_default_is_exact_and_stats_add_up():
    for family in ("llama", "gemma3"):
        target = tiny_target(family)
        drafter = tiny_drafter(target)  # random: acceptance ~0, so the controller falls back
        for seed in range(3):
            torch.manual_seed(seed)
            ids = torch.randint(1, 96, (1, 6))
            ref = target.generate(ids, max_new_tokens=40, do_sample=False)
            out = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=drafter)
            assert torch.equal(out, ref)
            s = eagle_hf.last_stats()
            assert s.fallback_steps > 0
            assert s.steps == s.cycles + s.fallback_steps + s.final_steps
            # every round yields tokens: 1 from the prefill, accepted+1 per cycle, 1 per plain step
            assert 1 + s.accepted + s.cycles + s.fallback_steps + s.final_steps == s.new_tokens
            assert 0 < s.fallback_ratio <= 1


def test_switches_off():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids = torch.randint(1, 96, (1, 6))
    target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=drafter, num_assistant_tokens=4)
    s = eagle_hf.last_stats()
    assert s.fallback_steps == 0 and set(s.draft_length_per_cycle) <= {4, 3, 2, 1}


def test_tree_size_follows_the_verify_curve():
    from eagle_hf.adaptive import choose_tree_size

    flat = CostModel(verify=[1.0] * 32, draft_step=0.0)
    steep = CostModel(verify=[1.0 + 0.1 * i for i in range(32)], draft_step=0.0)
    assert choose_tree_size(flat) == 32
    assert choose_tree_size(steep) == 8
