"""Adaptive speculation: decisions on synthetic costs/acceptance; exactness and stats with adaptation on."""

import json
import math

import pytest
import torch
from conftest import tiny_drafter, tiny_target

import eagle_hf
from eagle_hf.hf import costs
from eagle_hf.speculation.costs import CostModel
from eagle_hf.speculation.rounds import RoundTiming
from eagle_hf.speculation.schedule import COPY, EAGLE, EAGLE_COPY, DraftLengthController

MEASURED_CPU = CostModel(verify=[1.0] + [1.4] * 15, draft_step=0.023)  # SmolLM2 bf16 on this project's CPU
CPU_LIKE = CostModel(verify=[1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.4, 1.5], draft_step=0.06)


def test_falls_back_when_drafts_are_rejected_and_returns_when_they_are_accepted():
    c = DraftLengthController(CPU_LIKE, max_draft=8, probe_every=4)
    assert c.choose() > 0  # optimistic prior: starts drafting
    for _ in range(30):  # everything rejected
        k = c.choose()
        if k:
            c.update(k, 0)
    decisions = [c.choose() for _ in range(8)]
    assert decisions.count(0) >= 6 and any(decisions), decisions  # mostly plain, with periodic retries
    for _ in range(200):  # the drafter becomes good: the next retry succeeds and drafting resumes
        k = c.choose()
        if k:
            c.update(k, k)
    assert c.choose() >= 5


def test_failed_retries_back_off_and_a_good_retry_resets_the_wait():
    c = DraftLengthController(CPU_LIKE, max_draft=8, probe_every=4, max_probe_every=16)
    waits, plain = [], 0
    for _ in range(120):  # a drafter that is never right
        k = c.choose()
        if k:
            c.update(k, 0)
            waits.append(plain)
            plain = 0
        else:
            plain += 1
    retries = [w for w in waits if w > 0]
    relative = c.costs.relative_cost(1)  # a retry (depth 1 here) costs a bit more than a plain round: it waits longer
    assert 1 < relative < 1.2
    assert retries[:4] == [math.ceil(w * relative) for w in (4, 8, 16, 16)], waits  # 4, then doubling, capped
    for _ in range(200):  # the drafter becomes right: drafting resumes and the wait is back to probe_every
        k = c.choose()
        if k:
            c.update(k, k)
    assert c.choose() > 0 and c.backoff.wait == 4


def rounds_until_a_try(c: DraftLengthController) -> int:
    n = 0
    while c.choose() == 0:
        n += 1
    return n


def test_a_drafter_dropped_just_below_break_even_tries_again_within_a_few_rounds():
    """A drop decided on a round or two is revisited at once where trying loses little: two processes whose costs
    differ by a few per cent land on either side of break-even, and a drop kept for a whole call made the same
    prompts 15% slower in one process than in the other (issue 35). A drafter far below break-even waits longer,
    and longer after each failed try (at most the retry's wait)."""
    waits = {}
    for name, acceptance in (("near", 0.08), ("poor", 0.0)):
        c = DraftLengthController(CPU_LIKE, max_draft=8)  # probe_every 16
        c.update(1, 0)  # (tried: the drafter's first round)
        c.acceptance.values = [acceptance] * 8
        c._drafting = False  # dropped
        gain = c.best()[1]
        waits[name] = [rounds_until_a_try(c)]
        c.update(1, 0)  # the try fails (below break-even, as estimated)
        c.acceptance.values = [acceptance] * 8
        waits[name].append(rounds_until_a_try(c))
        assert gain < c.keep_gain if name == "poor" else 0.95 < gain < 1.0, gain
    relative = DraftLengthController(CPU_LIKE).costs.relative_cost(1)
    assert waits["near"][0] <= 3 and waits["near"][1] <= 6, waits  # (a try loses ~2% of a round)
    assert 8 <= waits["poor"][0] <= math.ceil(16 * relative), waits  # (a try loses ~10% of a round: 1% of ten)
    assert waits["poor"][1] >= 2 * waits["poor"][0] - 1, waits  # (a failed try: the share halves)


def test_a_batch_retries_less_often_as_its_retries_pad_every_row():
    """In a batch of 16 a depth-1 retry verifies 16 x 2 tokens: it costs more plain rounds, and comes rarer."""
    one, batch = (DraftLengthController(CPU_LIKE, max_draft=8, rows=rows) for rows in (1, 16))
    assert batch.costs.relative_cost(1) > one.costs.relative_cost(1) + 0.3
    plain_rounds = []
    for c in (one, batch):
        c.observe(RoundTiming(seconds=0.1))  # (a batch times a plain round before anything else)
        c.update(8, 0)  # acceptance observed low: the controller backs off
        for _ in range(2):  # (and a batch's drafter was timed: until then it drafts)
            c.observe(RoundTiming(seconds=0.15, width=2, depth=1, tokens=1.0))
        n = 0
        while c.choose() == 0:
            n += 1
        plain_rounds.append(n)
    assert plain_rounds[1] > 1.3 * plain_rounds[0]


def test_measured_rounds_overrule_a_model_that_says_drafting_pays():
    """A batch of 2 rows: the model expects a gain (accurate drafts, cheap verification), but timed rounds say
    otherwise: drafting rounds emit 2 tokens a row in 0.3 s where plain rounds emit 1 in 0.1 s. The controller falls
    back; rounds of copy branches alone, timed as losing too, leave the copies to their retries."""
    c = DraftLengthController(CostModel(verify=[1.0] * 33, draft_step=0.01, base_seconds=0.1), max_draft=4, rows=2)
    for _ in range(20):
        c.update(4, 4)
    assert c.choose() == 0 and c.rest  # a batch times a plain round first
    c.observe(RoundTiming(seconds=0.1))
    assert c.choose() > 0 and c.copy_branches(0) == "draft"  # (nothing timed yet)
    for _ in range(5):  # (every depth timed: a depth not timed yet gets its try first)
        c.observe(RoundTiming(seconds=0.1))
        for k in range(1, 5):
            c.observe(RoundTiming(seconds=0.3, width=k + 1, levels=k, depth=k, tokens=2.0))
    assert c.measured_gains()[4, False] == pytest.approx(2.0 / 0.3 * 0.1)
    assert c.choose() == 0 and c.copy_branches(0) == "draft"
    for _ in range(2):
        c.observe(RoundTiming(seconds=0.3, width=9, copies=True, tokens=2.0))
    c.choose()  # (a round's plan reads its timed rounds)
    assert c.copy_branches(0) == "retry" and c.copy_branches() == "draft"  # (a single row's: its own plan choice)


def test_a_batch_judges_its_drafting_rounds_on_their_total_time():
    """Drafting rounds alternate fast and slow (a shared machine): one token a row in 0.05 s, then in 0.25 s. Their
    rates average 12 tokens/s, above plain rounds' 10, but together they made 2 tokens in 0.3 s: drafting loses."""
    c = DraftLengthController(CostModel(verify=[1.0] * 33, draft_step=0.01, base_seconds=0.1), max_draft=4, rows=2)
    for i in range(20):
        c.observe(RoundTiming(seconds=0.1))
        c.observe(RoundTiming(seconds=0.05 if i % 2 else 0.25, width=5, levels=4, depth=4, tokens=1.0))
    assert c.measured_gains()[4, False] == pytest.approx(2 / 0.3 * 0.1, rel=0.05)
    assert c.measured_gains()[4, False] < c.keep_gain


def test_a_batch_times_plain_rounds_before_trusting_drafting():
    """A batch of 8 whose model says drafting pays: without a timed plain round its verdict would rest on that model
    (a plain round of 8 rows is not a one-row forward times 8). It times a plain round first and then one every
    `plain_every` drafting rounds; once timed, a plain round faster than the model thought ends the drafting."""
    c = DraftLengthController(CostModel(verify=[1.0] * 33, draft_step=0.01, base_seconds=0.1), max_draft=4, rows=8,
                              plain_every=6)
    for _ in range(20):
        c.update(4, 2)
    rests = []
    for _ in range(17):
        k = c.choose()
        rests.append(c.rest)
        if not c.rest:  # (the drafter's rounds, or a try of copy branches alone)
            c.observe(RoundTiming(seconds=0.2, width=k + 5, levels=k, depth=k, copies=k == 0, tokens=2.0))
        else:
            c.observe(RoundTiming(seconds=0.2))  # as slow as a drafting round: drafting pays
    assert [i for i, rest in enumerate(rests) if rest] == [0, 7, 14]
    for _ in range(40):  # plain rounds become much faster: the next timed one ends the drafting
        k = c.choose()
        if c.rest:
            c.observe(RoundTiming(seconds=0.05))
        else:
            c.observe(RoundTiming(seconds=0.2, width=k + 5, levels=k, depth=k, copies=k == 0, tokens=2.0))
    assert max(c.measured_gains().values()) < c.keep_gain and c.choose() == 0 and not c.rest
    assert c.plan is None and c.copy_branches(0) == "retry"


def test_a_batch_drafts_at_the_depth_its_timed_rounds_say_pays():
    """A batch of 4 whose model says drafting loses (as SmolLM2's batches of 4 on the questions set were told:
    verification looks dear, acceptance poor). Timed rounds have the last word: depth-1 rounds emit 1.5 tokens a
    row in 0.06 s, plain rounds 1 in 0.05 s (gain 1.25), depth-4 rounds 1.8 tokens in 0.1 s (0.9). The batch
    drafts at depth 1."""
    c = _batch_told_drafting_loses()
    assert c.measured_gains()[1, False] == pytest.approx(1.25)
    assert c.best() == (1, pytest.approx(1.25)) and c.choose() == 1  # the depth it timed: its measured gain
    for _ in range(3):
        c.observe(RoundTiming(seconds=0.1, width=13, levels=3, depth=4, tokens=1.8))
    assert c.measured_gains()[4, False] == pytest.approx(0.9)
    assert c.best()[0] == 1 and c.choose() == 1


def test_a_batch_judges_a_resting_drafter_on_its_acceptance_now():
    """A stretch of rounds where nothing drafted is accepted rests the drafter; once its acceptance recovers
    (its retries) it drafts again: the timed rounds' rate is not kept stale while the drafter rests, what they
    teach is how far the model is off (here: 1.5 tokens a round where it expected about 1)."""
    c = _batch_told_drafting_loses()
    for _ in range(10):
        c.update(1, 0)
        c.observe(RoundTiming(seconds=0.06, width=5, depth=1, tokens=1.0))
    assert c.best()[1] < c.keep_gain and c.choose() == 0
    for _ in range(10):
        c.update(1, 1)
    assert c.best()[0] == 1 and c.best()[1] > 1.0 and c.choose() == 1


def test_a_batch_lets_copy_branches_join_its_drafter_where_its_timed_rounds_say_they_pay():
    """Copy branches beside the drafter widen every row's round. A batch times both kinds of drafting round and
    keeps the better: here rounds with copy branches emit 1.6 tokens a row in 0.08 s (gain 1.0) against the
    drafter alone's 1.5 in 0.06 s (1.25), so the drafter drafts alone, trying copies again (two rounds, the
    timed rounds a verdict needs) once the rounds since absorb a try's expected loss; when a try emits 3 tokens a
    row, copies join again."""
    c = _batch_told_drafting_loses()  # (the drafter alone and copy branches alone timed)
    assert c.choose() == 1 and c.copies  # copies beside it (not timed yet: preferred)
    for _ in range(3):
        c.observe(RoundTiming(seconds=0.08, width=12, depth=1, copies=True, tokens=1.6))
    assert c.measured_gains()[1, True] == pytest.approx(1.0)
    tries = []
    for i in range(60):
        c.choose()
        if c.rest:
            c.observe(RoundTiming(seconds=0.05))  # (a timed plain round)
        elif c.plan != EAGLE:
            tries.append((i, c.plan))
    # tries of two rounds, paced by their expected loss: copies beside the drafter (a try loses 2 x (1 - 1.0 / 1.25)
    # = 0.4 rounds) once 40 drafting rounds absorb it at 1%; copies alone (0.67 rounds) later
    assert tries == [(41, EAGLE_COPY), (42, EAGLE_COPY)]
    for _ in range(5):
        c.observe(RoundTiming(seconds=0.08, width=12, depth=1, copies=True, tokens=3.0))
    while c.choose() == 0:
        c.observe(RoundTiming(seconds=0.05))
    assert c.plan == EAGLE_COPY and c.copies


def test_a_batch_drafts_copy_branches_alone_where_their_timed_rounds_beat_its_drafters():
    """Batched translation (issue 35): the drafter barely pays, copies carry the text. A batch times rounds of copy
    branches alone as a kind of its own and drafts with them alone (depth 0, copies drafting) where they beat its
    drafter's kinds by `KIND_MARGIN`: here 3 tokens a row in 0.06 s (gain 2.5) against the drafter's 1.25 alone and
    1.5 beside copies. The drafter's kinds are tried seldom (two rounds a try, each expected to lose most of a
    round: at the longest wait); once its tries with copies emit 5 tokens a row in 0.08 s (3.1), it drafts beside
    them again."""
    c = _batch_told_drafting_loses()  # (the drafter alone timed: 1.25; copies alone: 0.83)
    for _ in range(2):
        c.observe(RoundTiming(seconds=0.08, width=12, depth=1, copies=True, tokens=2.4))
    for _ in range(30):
        c.observe(RoundTiming(seconds=0.06, width=8, copies=True, tokens=3.0))
    assert c.measured_gains()[0, True] == pytest.approx(2.5, rel=0.02)
    plans = []
    for i in range(150):
        k = c.choose()
        if c.rest:
            c.observe(RoundTiming(seconds=0.05))  # (a timed plain round)
        elif k == 0:
            assert c.plan == COPY and c.copy_branches(0) == "draft"  # copies alone draft
        else:
            plans.append((i, c.plan))
    assert plans == [(68, EAGLE), (69, EAGLE), (138, EAGLE_COPY), (139, EAGLE_COPY)]
    for _ in range(3):
        c.observe(RoundTiming(seconds=0.08, width=12, depth=1, copies=True, tokens=5.0))
    while c.rest or (k := c.choose()) == 0:
        c.observe(RoundTiming(seconds=0.05))
    assert k == 1 and c.plan == EAGLE_COPY


def test_a_batch_times_its_plans_rounds_as_their_kind_whatever_its_rows_drafted():
    """A round of copy branches alone where no row found a match is a plain round: it is timed as a round of
    copies alone (the plan's rate), else copies alone would be judged on their lucky rounds only (batched math_word:
    copies alone were preferred over the drafter with copies, and the default fell from 1.25x to 1.13x plain)."""
    c = _batch_told_drafting_loses()
    for _ in range(30):
        c.observe(RoundTiming(seconds=0.06, width=8, copies=True, tokens=3.0))
    lucky = c.measured_gains()[0, True]
    for _ in range(30):
        c.observe(RoundTiming(seconds=0.05, kind=(0, True)))  # (no row found a match)
    assert c.measured_gains()[0, True] < 0.5 * lucky and c.budget.plain_seconds == 0.05


def test_a_batch_tries_a_kind_at_one_depth():
    """A try's rounds are what the kind's verdict needs, and a batch times its rounds per depth: the try keeps the
    depth it started at, though the acceptance (and the best depth) moves between its rounds."""
    c = DraftLengthController(CostModel(verify=[1.0 + 0.05 * i for i in range(33)], draft_step=0.01,
                                        base_seconds=0.1), max_draft=4, rows=4)
    for _ in range(20):
        c.update(4, 4)
    c.choose()
    c.observe(RoundTiming(seconds=0.1))
    first = c.choose()
    assert first == 4 and c.plan == EAGLE  # (the drafter's own rounds: never tried)
    for _ in range(20):
        c.update(4, 1)
    assert c.best()[0] < first and c.choose() == first and c.plan == EAGLE


def test_a_batch_without_copy_branches_drafts_its_drafter_alone():
    """EAGLE alone in a batch (no copy source): its drafter's own rounds are its only kind, none other is tried (a
    try of copy branches alone would be a plain round)."""
    c = DraftLengthController(CostModel(verify=[1.0] * 33, draft_step=0.01, base_seconds=0.1), max_draft=4, rows=4,
                              copying=False)
    for _ in range(20):
        c.update(4, 4)
    c.choose()
    c.observe(RoundTiming(seconds=0.1))
    plans = [(c.choose(), c.plan) for _ in range(40)]
    assert {plan for k, plan in plans if k} == {EAGLE}
    assert all(k > 0 for k, plan in plans if plan is not None)  # (the rest: timed plain rounds)


def test_a_batch_times_its_resting_drafters_retries_as_regular_rounds():
    """A resting drafter's retry catches it up on the plain rounds' rows first: 0.5 s, 0.45 s of it catching up,
    where a regular round's catch-up takes half a one-token forward (0.005 s) a row. The retry is timed as the
    regular round it would have been (0.07 s), so that retries alone can tell a batch its drafter pays again."""
    c = _batch_told_drafting_loses()
    c.costs.round_overhead = 0.5
    for _ in range(2):
        c.observe(RoundTiming(seconds=0.5, catch_up=0.45, width=9, depth=2, drafting_rows=4, tokens=1.5,
                              drafter_prefill=True))
    assert c.measured_gains()[2, False] == pytest.approx(1.5 / 0.07 * 0.05)
    assert c.costs.cycle_overhead == 0.0  # (the loop's cost model learns from regular rounds only)


def test_a_batch_drafts_until_its_drafters_rounds_were_timed():
    """A batch's verdict is measured: a drafter its model calls a loss drafts until two of its rounds were timed
    (before, one untimed try and then retries 16, 32, 64 rounds apart left a batch of 4 questions plain for a
    third of its call), and rests once they say it loses."""
    c = DraftLengthController(CostModel(verify=[1.0 + 0.4 * i for i in range(33)], draft_step=0.05,
                                        base_seconds=0.01), max_draft=4, rows=4)
    for _ in range(20):
        c.update(4, 0)
    assert c.best()[1] < 0.95
    c.observe(RoundTiming(seconds=0.05))
    assert [c.choose() for _ in range(2)] == [1, 1] and c.plan == EAGLE  # (its own rounds first: never tried)
    for _ in range(2):
        c.observe(RoundTiming(seconds=0.1, width=5, depth=1, tokens=1.0))
    assert c.choose() == 0 and c.copy_branches(0) == "draft"  # it rests (copy branches draft: not timed yet)


def _batch_told_drafting_loses() -> DraftLengthController:
    c = DraftLengthController(CostModel(verify=[1.0 + 0.4 * i for i in range(33)], draft_step=0.05,
                                        base_seconds=0.01), max_draft=4, rows=4)
    for _ in range(20):
        c.update(4, 0)
    assert c.best()[1] < 0.95  # the model alone: drafting loses
    c.observe(RoundTiming(seconds=0.05))
    for _ in range(3):
        c.observe(RoundTiming(seconds=0.06, width=5, depth=1, tokens=1.5))
    for _ in range(2):  # (and copy branches alone: 1 token a row in 0.06 s)
        c.observe(RoundTiming(seconds=0.06, width=8, copies=True, tokens=1.0))
    return c


def test_a_batch_widens_its_rounds_only_within_its_loss_budget():
    """A batch's wide round that emits what a plain round does in three times its time loses 0.2 s: its loss budget
    (3% of its time) is spent, and every source rests, however good the model says drafting is, until plain rounds
    have earned it back. Wide rounds that gain leave the budget alone: the batch rests only to time plain rounds."""
    c = DraftLengthController(CostModel(verify=[1.0] * 33, draft_step=0.01, base_seconds=0.1), max_draft=4, rows=8,
                              plain_every=16)
    for _ in range(20):
        c.update(4, 4)  # the model: every draft accepted, drafting pays
    assert c.choose() == 0 and c.rest  # first a timed plain round: losses are counted against it
    c.observe(RoundTiming(seconds=0.1))
    c.budget.account(0.1, 1.0, wide=False)
    assert c.choose() > 0 and not c.rest
    c.budget.account(0.3, 1.0, wide=True)
    rests = 0
    while c.choose() == 0:
        assert c.rest
        c.budget.account(0.1, 1.0, wide=False)
        rests += 1
    assert rests == 63  # 0.2 s lost is 3% of 6.7 s: 0.4 s so far and 63 plain rounds
    rests = []
    for _ in range(40):  # wide rounds that gain (3 tokens a row in 0.2 s): no rest but the timed plain rounds
        c.choose()  # (the drafter's rounds, or copy branches alone: wide rounds both)
        rests.append(c.rest)
        c.budget.account(0.1 if c.rest else 0.2, 1.0 if c.rest else 3.0, wide=not c.rest)
    assert [i for i, rest in enumerate(rests) if rest] == [15, 32]


def test_first_cycles_move_the_estimate_fast():
    c = DraftLengthController(CPU_LIKE, max_draft=8)
    c.update(4, 0)
    c.update(4, 0)
    assert c.acceptance.values[0] == 0.5 * (2 / 3) * (3 / 4)  # the prior counts as two observations
    c = DraftLengthController(MEASURED_CPU, max_draft=8)
    cycles = 0
    while (k := c.choose()) > 0:
        c.update(k, 0)
        cycles += 1
    assert 1 <= cycles <= 3  # a drafter that misses its first cycles is dropped within three


def test_tree_cycles_cost_their_verified_nodes():
    c = DraftLengthController(CPU_LIKE, max_draft=5, tree=(4, 16))
    assert c.costs.cycle_cost(1) == CPU_LIKE.forward(5) + CPU_LIKE.draft_step  # the root and its top-4 children
    assert c.costs.cycle_cost(2) == CPU_LIKE.forward(16) + 2 * CPU_LIKE.draft_step  # 4 + 16 candidates: the best 15 kept
    assert c.costs.cycle_cost(5) == CPU_LIKE.forward(16) + 5 * CPU_LIKE.draft_step
    assert CPU_LIKE.forward(12) == pytest.approx(1.5 + 3 * (1.5 - 1.15) / 5)  # past the measured range: linear,
    # along the secant of its upper half (a flat last step, where times were made monotone, must not stop the growth)
    assert CostModel(verify=[1.0, 1.2, 1.2], draft_step=0.0).forward(5) == pytest.approx(1.4)


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
    assert c.acceptance.expected_tokens(3) == 1 + 0.5 + 0.25 + 0.125


def test_the_cost_model_starts_from_its_prior_and_learns_from_timed_forwards():
    cost = CostModel.prior("cpu")
    assert not cost.observed and cost.forward(1) == 1.0 and cost.forward(16) > cost.forward(4) > 1.0
    assert CostModel.prior("cuda").forward(64) < 1.3 < cost.forward(64)  # a GPU verifies 64 tokens for about 1
    cost.observe_forward(16, 0.30)  # the first timed forward is a tree's: the base follows the prior down to it
    assert cost.forward(16) == pytest.approx(CostModel.prior("cpu").forward(16))
    cost.observe_forward(1, 0.10)  # a plain round: the base is timed
    assert cost.base_seconds == 0.10 and cost.forward(16) == pytest.approx(3.0)
    assert cost.forward(6) == pytest.approx(1 + 5 * 2 / 15)  # between timed sizes: linear
    assert cost.forward(31) == pytest.approx(5.0)  # beyond: along the secant from the size nearest half of it
    cost.observe_forward(16, 0.60)  # a round slowed down by another process: the fastest recent one counts
    assert cost.forward(16) == pytest.approx(3.0)
    for _ in range(8):  # ... until the slower time is all that is recent
        cost.observe_forward(16, 0.40)
    assert cost.forward(16) == pytest.approx(4.0)
    cost.observe_draft_step(0.02)
    assert cost.draft_step_cost == pytest.approx(0.2)
    kept = CostModel.from_dict(cost.as_dict())  # what a later process starts from
    assert kept.forward(16) == pytest.approx(4.0) and kept.draft_step_cost == pytest.approx(0.2)


def test_learnt_costs_are_kept_per_model_and_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_HF_CACHE", str(tmp_path))
    target = tiny_target("llama")
    target.name_or_path = target.config._name_or_path = "tiny/llama"  # a named model: its costs are kept on disk
    cost = costs.cost_model(target)
    assert costs.cost_model(target) is cost and not cost.observed  # nothing measured: the prior
    cost.observe_forward(1, 0.01)
    cost.observe_forward(8, 0.02)
    costs.keep_costs(target)
    costs._COSTS.clear()  # a new process
    again = costs.cost_model(target)
    assert again is not cost and again.forward(8) == pytest.approx(2.0)
    monkeypatch.setenv(costs.COST_CACHE_ENV, "off")
    costs._COSTS.clear()
    assert not costs.cost_model(target).observed


def test_nothing_is_measured_before_the_first_token():
    """The first call of a process runs no forward of its own before the prefill: costs are learnt from the
    rounds that run (the prefill is the first target forward; later ones verify the rounds' drafts)."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    costs._COSTS.pop(target, None)
    shapes = []
    forward = target.forward
    target.forward = lambda *a, **k: (shapes.append(tuple(k["input_ids"].shape)), forward(*a, **k))[1]
    ids = torch.randint(1, 96, (1, 6))
    target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter)
    assert shapes[0] == (1, 6)
    assert costs.cost_model(target, drafter).observed  # the call's own forwards taught the model


def test_a_calls_acceptance_is_the_next_calls_start():
    """What a call learnt of its drafter's acceptance starts the process's next call of the same kind, worth one
    observation per depth (a new text moves it within a round or two), and no longer seeded by the drafter's
    confidences; another kind of call (sampling, another shape) starts afresh."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    greedy = eagle_hf.DraftSettings()
    first = costs.controller_for(target, drafter, greedy)
    assert not first.acceptance.seeded and not first._tried  # nothing known: a flat prior, and a first try
    for _ in range(6):  # the drafter's first draft is accepted, its second never
        first.update(5, 1, [0.9] * 5)
    costs.keep_acceptance(drafter, greedy, first)
    second = costs.controller_for(target, drafter, greedy)
    a = second.acceptance
    assert a.values == first.acceptance.values and a.seen == [1, 1, 0, 0, 0]
    assert second._tried  # known: drafted only where its rounds are expected to pay, no first try
    second.update(5, 0, [0.99] * 5)  # one miss moves it by a quarter; the confidences seed nothing
    assert a.values[0] == pytest.approx(first.acceptance.values[0] * 0.75) and a.values[1] == first.acceptance.values[1]
    assert first.acceptance.seen[0] == 6  # (the kept call's own estimate is not touched)
    assert not costs.controller_for(target, drafter, greedy, sampling=True).acceptance.seeded
    assert not costs.controller_for(target, drafter, eagle_hf.DraftSettings(mode="chain")).acceptance.seeded
    assert not costs.controller_for(target, drafter, eagle_hf.DraftSettings(draft_sources="eagle")).acceptance.seeded
    costs.keep_acceptance(drafter, greedy, costs.controller_for(target, drafter, greedy, sampling=True), sampling=True)
    assert not costs.controller_for(target, drafter, greedy, sampling=True).acceptance.seeded  # (never drafted:
    # nothing kept)


def test_generate_carries_the_acceptance_to_the_next_call():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids = torch.randint(1, 96, (1, 6))
    target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter)
    (key, kept), = costs._ACCEPTANCE[drafter].items()
    assert key[-1] is False and kept.seeded  # (greedy)
    target.generate(ids, max_new_tokens=12, do_sample=True, assistant_model=drafter)
    assert sorted(k[-1] for k in costs._ACCEPTANCE[drafter]) == [False, True]


@pytest.mark.parametrize("family,mode", [("llama", "chain"), ("gemma3", "chain"), ("llama", "tree"), ("qwen3", "tree")])
def test_adaptive_default_is_exact_and_stats_add_up(family, mode):
    target = tiny_target(family)
    drafter = tiny_drafter(target)  # random: acceptance ~0, so the controller falls back
    for seed in range(3):
        torch.manual_seed(seed)
        ids = torch.randint(1, 96, (1, 6))
        ref = target.generate(ids, max_new_tokens=40, do_sample=False)
        events = []
        out = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=drafter, draft_mode=mode,
                              draft_listeners=[lambda drafts, n, last, events=events: events.append((list(drafts), n, last))])
        assert torch.equal(out, ref)
        s = eagle_hf.last_stats()
        assert s.fallback_steps > 0
        assert s.steps == s.cycles + s.fallback_steps + s.final_steps
        # every round yields tokens: 1 from the prefill, accepted+1 per cycle, 1 per plain step
        assert 1 + s.accepted + s.cycles + s.fallback_steps + s.final_steps == s.new_tokens
        assert 0 < s.fallback_ratio <= 1
        # listeners hear every round after the prefill; plain steps come with no drafts
        assert len(events) == s.steps and sum(1 for d, _, _ in events if not d) == s.fallback_steps + s.final_steps
        assert [last for _, _, last in events] == _round_ends(ref[0, 6:].tolist(), s, events)


def test_switches_off():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids = torch.randint(1, 96, (1, 6))
    target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=drafter, num_assistant_tokens=4)
    s = eagle_hf.last_stats()
    assert s.fallback_steps == 0 and set(s.draft_length_per_cycle) <= {4, 3, 2, 1}


def test_tree_size_follows_the_verify_curve():
    from eagle_hf.speculation.schedule import choose_tree_size

    flat = CostModel(verify=[1.0] * 32, draft_step=0.0)
    steep = CostModel(verify=[1.0 + 0.1 * i for i in range(32)], draft_step=0.0)
    assert choose_tree_size(flat) == 32
    assert choose_tree_size(steep) == 8


def _round_ends(new_tokens: list[int], stats, events) -> list[int]:
    """The last token of every round after the prefill (1 token), from the per-round accepted counts."""
    ends, i = [], 1
    for drafts, n, _ in events:
        i += n + 1
        ends.append(new_tokens[i - 1])
    return ends


def test_drafter_costs_are_remeasured_in_the_loop():
    cost = CostModel(verify=[1.0] + [1.1] * 8, draft_step=0.05, base_seconds=0.01)
    c = DraftLengthController(cost, max_draft=8)
    before = c.costs.cycle_cost(4)
    for _ in range(30):  # rounds whose drafter work really costs 0.2 (catch-up) + 0.1 per step
        c.observe(RoundTiming(catch_up=0.002, draft=0.004, width=9, drafting_rows=1, levels=4))
    assert abs(c.costs.draft_step - 0.1) < 1e-3 and abs(c.costs.round_overhead - 0.2) < 1e-3
    assert abs(c.costs.cycle_cost(4) - (1.1 + 0.4 + 0.2)) < 1e-2 and c.costs.cycle_cost(4) > before
    # without an absolute base time the prior stays
    cost = CostModel(verify=[1.0, 1.1], draft_step=0.05)
    c = DraftLengthController(cost, max_draft=2)
    c.observe(RoundTiming(catch_up=1.0, draft=1.0, width=2, drafting_rows=1, levels=1))
    assert c.costs.draft_step == 0.05 and c.costs.round_overhead == 0.0


def test_the_drafters_confidence_replaces_the_flat_prior():
    c = DraftLengthController(MEASURED_CPU, max_draft=8)
    c.update(3, 0, [1e-4, 1e-4, 1e-4])  # an untrained drafter: its drafts have probability ~1/vocabulary
    assert c.choose() == 0  # dropped after one cycle
    c = DraftLengthController(MEASURED_CPU, max_draft=8)
    c.update(3, 3, [0.9, 0.8, 0.7])  # a confident drafter that was right
    assert c.acceptance.values[0] > 0.9 and c.acceptance.values[5] == 0.7 and c.choose() >= 3
    c.update(3, 0, [1e-4, 1e-4, 1e-4])  # later confidences do not reset what was observed
    assert c.acceptance.values[0] > 0.5


def test_tree_confidences_follow_the_best_path():
    import math

    from eagle_hf.speculation.tree import DraftTree

    tree = DraftTree(torch.tensor([5, 1, 2, 3]), torch.tensor([-1, 0, 0, 1]),
                     torch.tensor([0.0, math.log(0.6), math.log(0.3), math.log(0.6 * 0.5)]))
    assert [round(x, 6) for x in tree.confidences()] == [0.9, 0.5]  # siblings 0.6 + 0.3, then the child of 0.6


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_recorded_rounds_label_every_generated_token(mode):
    from unittest import mock

    from eagle_hf.tools.visualize import DraftRecorder

    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids = torch.randint(1, 96, (1, 6))
    ref = target.generate(ids, max_new_tokens=30, do_sample=False)
    decisions = iter([2, 0, 0, 3, 0, 1] * 20)  # a scripted schedule: drafting rounds between plain steps
    with mock.patch("eagle_hf.speculation.schedule.DraftLengthController.choose", lambda self: next(decisions)):
        recorder = DraftRecorder()
        out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=drafter, draft_mode=mode,
                              draft_listeners=[recorder])
    assert torch.equal(out, ref)  # plain steps in between: the drafter caught up on their rows
    s = eagle_hf.last_stats()
    events = recorder.events(out[0, 6:].tolist())
    assert [e.token_id for e in events if e.label != "rejected"] == out[0, 6:].tolist()
    labels = [e.label for e in events]
    assert labels.count("accepted") == s.accepted and labels.count("plain") == s.fallback_steps + s.final_steps
    assert labels.count("target") == 1 + s.cycles  # the prefill's token and one per cycle


def test_the_decoding_loops_own_cost_counts_for_plain_rounds_too():
    cost = CostModel(verify=[1.0] + [1.1] * 8, draft_step=0.1, base_seconds=0.01)
    c = DraftLengthController(cost, max_draft=8, acceptance=[0.3] * 8)
    c.costs.loop_overhead = 0.0
    lean = c.best()[1]
    for _ in range(40):
        c.observe(RoundTiming(seconds=0.015))  # a plain round takes 1.5 target forwards: the loop costs 0.5
    assert abs(c.costs.loop_overhead - 0.5) < 1e-3
    assert c.best()[1] > lean  # a cost paid by every round makes rounds that yield more tokens worth more


def test_one_slow_round_moves_no_in_loop_overhead():
    """The in-loop overheads are medians of recent rounds: a round timed at a noisy moment does not steer the
    schedule (issue 35: decisions the same from process to process)."""
    cost = CostModel(verify=[1.0] + [1.1] * 8, draft_step=0.1, base_seconds=0.01)
    c = DraftLengthController(cost, max_draft=8, acceptance=[0.5] * 8)
    for _ in range(9):
        c.observe(RoundTiming(seconds=0.012))
    steady, choice = c.costs.loop_overhead, c.choose()
    c.observe(RoundTiming(seconds=0.2))  # one round twenty times slower (another process took the cores)
    assert c.costs.loop_overhead == pytest.approx(steady) and c.choose() == choice


# ------------------------------------------------------------------------------------------ the cost store, untrusted
BASE, STEP, ACCEPTED = 0.01, 0.003, 3  # this simulated device's one-token forward and drafter step (seconds), and
# the drafts its drafter has accepted per round


def _simulated_call(target, drafter, rounds: int = 40) -> list[int]:
    """One call's schedule against a deterministic clock: each round's timings are what the simulated device
    takes (a forward over n tokens costs BASE * (1 + 0.05 (n - 1)), a drafter step STEP), the drafter's
    acceptance the same every round; a drafting round after a plain one catches up on its rows, as in the loop.
    The call starts and ends as `generate()` does (`controller_for`, `keep_acceptance`, `keep_costs`)."""
    settings = eagle_hf.DraftSettings()
    c = costs.controller_for(target, drafter, settings)

    def forward(n):
        return BASE * (1 + 0.05 * (n - 1))

    depths, behind = [], True
    for _ in range(rounds):
        k = c.choose()
        depths.append(k)
        if k == 0:
            c.observe(RoundTiming(seconds=forward(1) + 0.001, verify=forward(1)))
            behind = True
            continue
        width = c.costs.verified(k)
        c.observe(RoundTiming(seconds=0.001 + STEP * k + forward(width) + 0.001, catch_up=0.001, draft=STEP * k,
                              verify=forward(width), width=width, drafting_rows=1, levels=k, depth=k,
                              tokens=min(k, ACCEPTED) + 1, drafter_prefill=behind))
        c.update(k, min(k, ACCEPTED), [0.8] * k)
        behind = False
    costs.keep_acceptance(drafter, settings, c)
    costs.keep_costs(target)
    return depths


def _new_process(target, drafter) -> None:
    costs._COSTS.pop(target, None)
    costs._ACCEPTANCE.pop(drafter, None)
    costs._WARNED.clear()


@pytest.fixture
def named_target(tmp_path, monkeypatch):
    """A named tiny target (its learnt costs are kept in eagle_hf's cache folder, here a temporary one) and a
    drafter for it."""
    monkeypatch.setenv("EAGLE_HF_CACHE", str(tmp_path))
    monkeypatch.delenv(costs.COST_CACHE_ENV, raising=False)
    target = tiny_target("llama")
    target.name_or_path = target.config._name_or_path = "tiny/llama"
    drafter = tiny_drafter(target)
    _new_process(target, drafter)
    yield target, drafter
    _new_process(target, drafter)


def _poison(entry: dict, how: str):
    """A cost file's content, from a genuine entry `entry` (the file's one entry) poisoned `how`."""
    entry = json.loads(json.dumps(entry))
    if how in ("[]", "42", "null", '{"costs": ', ""):
        return how
    if how == "verify: [NaN, ...]":
        entry["verify"][0] = math.nan
    elif how == "verify: []":
        entry["verify"] = []
    elif how == "seconds: [1, 2]":
        entry["seconds"] = [1, 2]
    elif how == "seconds: {'1': 'x'}":
        entry["seconds"]["1"] = "x"
    elif how == "draft_step_seconds ten times too high":  # what a first process under heavy load can learn
        entry["draft_step_seconds"] *= 10
    elif how == "forwards ten times too slow":
        entry["seconds"] = {t: s * 10 for t, s in entry["seconds"].items()}
    elif how == "the widest forward nearly free":
        widest = max(entry["seconds"], key=int)
        entry["seconds"][widest] = 1e-6
    return entry


POISONS = ["[]", "42", "null", '{"costs": ', "", "verify: [NaN, ...]", "verify: []", "seconds: [1, 2]",
           "seconds: {'1': 'x'}", "draft_step_seconds ten times too high", "forwards ten times too slow",
           "the widest forward nearly free"]


def test_a_poisoned_cost_file_drafts_again_within_two_calls_where_a_clean_one_drafts(named_target):
    """A cost file is untrusted input: one that is not what eagle_hf writes is ignored (and replaced), and learnt
    costs that this process's timings contradict are learnt again. With any of these files a process's second
    call drafts as a process with a clean cache does, and its first call drafts in all but a round or two of
    the rounds where that one drafts."""
    target, drafter = named_target
    clean = [_simulated_call(target, drafter) for _ in range(2)]
    assert sum(k > 0 for k in clean[1]) > 30  # drafting pays on this device
    path = costs._cost_file(target)
    (key, genuine), = json.loads(path.read_text()).items()
    assert key == costs._cost_key(target, drafter)
    for how in POISONS:
        _new_process(target, drafter)
        poisoned = _poison(genuine, how)
        path.write_text(poisoned if isinstance(poisoned, str) else json.dumps({key: poisoned}))
        calls = [_simulated_call(target, drafter) for _ in range(2)]
        assert calls[1] == clean[1], how
        assert sum(k == 0 for k in calls[0]) <= sum(k == 0 for k in clean[0]) + 2, how  # (a round or two plain)
        kept = json.loads(path.read_text())  # replaced by what this process learnt
        assert set(kept) == {key} and CostModel.from_dict(kept[key]).observed, how
    assert not list(path.parent.glob("*.tmp"))


@pytest.mark.parametrize("how", ["draft_step_seconds 1000 s", "draft_step_seconds 3x", "forwards 3x",
                                 "forwards and draft_step_seconds 3x", "forwards and draft_step_seconds 3x too fast"])
def test_a_cost_store_taught_by_a_busy_machine_costs_at_most_one_calls_schedule(named_target, how):
    """Every cost kept across processes is a claim this process checks: one its own timings contradict (too high
    or too low) is replaced after the first rounds that time it. A store learnt on a machine three times slower
    (a busy one), or poisoned, leaves the third call's schedule within one round of a clean store's."""
    target, drafter = named_target
    clean = [_simulated_call(target, drafter) for _ in range(3)]
    path = costs._cost_file(target)
    (key, entry), = json.loads(path.read_text()).items()
    scale = 1 / 3 if "too fast" in how else 3
    if "forwards" in how:
        entry["seconds"] = {t: s * scale for t, s in entry["seconds"].items()}
    if "draft_step" in how:
        entry["draft_step_seconds"] = 1000.0 if "1000" in how else entry["draft_step_seconds"] * scale
    _new_process(target, drafter)
    path.write_text(json.dumps({key: entry}))
    calls = [_simulated_call(target, drafter) for _ in range(3)]
    assert sum(a != b for a, b in zip(calls[2], clean[2])) <= 1, (calls, clean)


def test_a_schedule_that_stopped_drafting_still_tries_a_draft_now_and_then():
    """Exploration priced in the schedule: whatever the costs say, a dropped drafter's try is priced at most
    `MOST_TRY_COST` plain rounds, so a drafter whose kept step cost is absurd (1000 s) is timed again within that
    many retry waits; the try's timing contradicts the kept cost, and drafting resumes."""
    from eagle_hf.speculation.schedule import MOST_TRY_COST

    kept = {"verify": [1.0 + 0.05 * i for i in range(16)], "draft_step": 0.1, "seconds": {"1": 0.01},
            "draft_step_seconds": 1000.0}
    c = DraftLengthController(CostModel.from_dict(kept), max_draft=4, probe_every=16)
    c.update(4, 4)  # the drafter is known to be right (its last call's acceptance): only its cost keeps it out
    plain = rounds_until_a_try(c)
    assert 0 < plain <= 16 * MOST_TRY_COST
    k = c.costs.verified(4)
    c.observe(RoundTiming(seconds=0.02, catch_up=0.001, draft=0.004, verify=0.012, width=k, drafting_rows=1,
                          levels=4, depth=4, tokens=5, drafter_prefill=True))  # (a try after plain rounds)
    c.update(4, 4)
    assert c.choose() > 0  # the kept step is forgotten: drafting pays


def test_generate_with_a_bad_cost_file_warns_once_decodes_exactly_and_replaces_it(named_target, caplog, one_thread):
    target, drafter = named_target
    path = costs._cost_file(target)
    path.parent.mkdir(parents=True)
    ids = torch.randint(1, 96, (1, 6), generator=torch.Generator().manual_seed(0))
    ref = target.generate(ids, max_new_tokens=8, do_sample=False)
    for content in ["[]", json.dumps({costs._cost_key(target, drafter): {"verify": [math.nan], "draft_step": 0.1}})]:
        _new_process(target, drafter)
        path.write_text(content)
        with caplog.at_level("WARNING", logger="eagle_hf"):
            caplog.clear()
            for _ in range(2):
                assert torch.equal(target.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=drafter), ref)
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warned) == 1 and str(path) in warned[0], warned
        assert costs._read_store(path) == json.loads(path.read_text())  # replaced: every entry valid
    assert not list(path.parent.glob("*.tmp"))


def test_cost_writers_leave_no_partial_file_and_no_temporary_file(named_target, monkeypatch):
    """Writers of one cost file (threads here, processes alike) each write a temporary file of their own that
    replaces the file at once; a write that fails removes its temporary file."""
    import threading

    target, drafter = named_target
    costs.cost_model(target, drafter).observe_forward(1, 0.01)
    path = costs._cost_file(target)
    threads = [threading.Thread(target=lambda: [costs.keep_costs(target) for _ in range(20)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kept = json.loads(path.read_text())
    assert CostModel.from_dict(kept[costs._cost_key(target, drafter)]).observed
    monkeypatch.setattr(costs.os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    costs.keep_costs(target)  # (logged: the costs stay in memory)
    assert json.loads(path.read_text()) == kept and not list(path.parent.glob("*.tmp"))


def test_cost_entries_are_checked_field_by_field():
    good = {"verify": [1.0, 1.05], "draft_step": 0.1, "seconds": {"1": 0.01, "8": 0.012}, "draft_step_seconds": 0.002}
    assert CostModel.from_dict(good).forward(8) == pytest.approx(1.2)
    for field_, value, message in [
        (None, [], "the entry is a list"), ("verify", [1.0, math.inf], r"verify\[1\] is inf"),
        ("verify", [-1.0], r"verify\[0\] is -1.0"), ("verify", "1", "verify is a str"),
        ("draft_step", None, "draft_step is None"), ("draft_step", True, "draft_step is True"),
        ("seconds", {"-1": 0.01}, "seconds has the key '-1'"), ("seconds", {"1": 1e9}, r"seconds\['1'\] is 1000000000.0"),
        ("seconds", {"1": math.nan}, r"seconds\['1'\] is nan"), ("draft_step_seconds", "0.002", "draft_step_seconds is '0.002'"),
    ]:
        entry = value if field_ is None else {**good, field_: value}
        with pytest.raises(ValueError, match=message):
            CostModel.from_dict(entry)


def test_costs_read_back_that_this_process_contradicts_are_learnt_again():
    kept = {"verify": [1.0] * 16, "draft_step": 0.1, "seconds": {"1": 0.01, "16": 0.02}, "draft_step_seconds": 0.02}
    cost = CostModel.from_dict(kept)
    cost.observe_forward(8, 0.014)  # within a factor DRIFT of what was read back: kept
    assert cost.forward(16) == pytest.approx(2.0) and cost.draft_step_cost == pytest.approx(2.0)
    cost.check_draft_step(0.002)  # a drafter step (even in a catch-up round) ten times faster than read back
    assert cost.draft_step_cost == pytest.approx(0.1)  # the prior until a regular round is timed
    assert cost.forward(8) == pytest.approx(1.0) and cost.base_seconds == pytest.approx(0.014)  # this process's own
    cost = CostModel.from_dict(kept)
    cost.observe_forward(1, 0.1)  # a forward ten times slower: a first round's one-off costs, maybe
    assert cost.forward(16) == pytest.approx(2.0)
    cost.observe_forward(1, 0.1)
    cost.observe_forward(16, 0.2)  # every forward ten times slower now (another load): the file's costs go
    assert cost.forward(16) == pytest.approx(2.0) and cost.base_seconds == pytest.approx(0.1)
    assert cost.draft_step_cost == pytest.approx(0.1)


def test_a_draft_program_s_time_is_split_over_its_drafter_forwards():
    """The catch-up and the levels as one program leave no mark between them: the catch-up's share is one of its
    drafter forwards (the catch-up's and each level's); marks between them are read as they are."""
    marks = {"start": 0.0, "draft": 1.0, "drafted": 6.0, "verify": 6.5, "verified": 9.0, "end": 9.5}
    t = RoundTiming.from_marks(marks, levels=4)
    assert (t.catch_up, t.draft, t.verify, t.seconds) == (1.0, 4.0, 2.5, 9.5)
    t = RoundTiming.from_marks(dict(marks, caught_up=3.0), levels=4)
    assert (t.catch_up, t.draft) == (2.0, 3.0)


def test_a_retry_prices_the_drafter_s_catch_up_until_a_regular_round_does():
    """A drafter that rests between its retries times no regular round: every round it drafts in catches up on
    the rounds it sat out. A retry's catch-up of a few rows (at most `RETRY_ROWS`) prices the drafter's catch-up
    until a regular round's is timed; without it each retry is priced at no catch-up at all (on a GPU's flat verify
    a never-right drafter's modelled gain then sits just under 1 and its retries come every round or two). The
    prompt's catch-up, or a long rest's, prices nothing, and a regular round's has the last word."""
    from eagle_hf.speculation.schedule import RETRY_ROWS

    c = DraftLengthController(CostModel(verify=[1.0] * 9, draft_step=0.01, base_seconds=0.01), max_draft=4)
    retry = dict(drafting_rows=1, width=2, depth=1, drafter_prefill=True)
    c.observe(RoundTiming(catch_up=0.004, caught_up=RETRY_ROWS + 1, **retry))  # (the prompt, or a long rest)
    assert c.costs.round_overhead == 0.0
    before = c.best()[1]
    c.observe(RoundTiming(catch_up=0.002, caught_up=3, **retry))
    assert c.costs.round_overhead == pytest.approx(0.2) and c.best()[1] < before
    c.observe(RoundTiming(catch_up=0.005, caught_up=2, **retry))  # (one estimate is enough until a regular round)
    assert c.costs.round_overhead == pytest.approx(0.2)
    for _ in range(2):
        c.observe(RoundTiming(catch_up=0.001, drafting_rows=1, width=2, depth=1, caught_up=1))
    assert c.costs.round_overhead == pytest.approx(0.1)  # (the median of the regular rounds and the retry's)
