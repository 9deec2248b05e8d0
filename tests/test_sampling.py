"""Speculative *sampling* with an EAGLE drafter is lossless: a statistical test against the exact distribution.

A tiny target with a 12-token vocabulary keeps the enumeration cheap and lets random drafts be accepted often.
We sample a few new tokens many times with the drafter, enumerate the exact distribution of pairs of generated
tokens under the target alone (with the very logits processors ``generate()`` built: temperature, then top-k or
top-p), and run a chi-square goodness-of-fit test.

A negative control proves the test has power: a drafter that samples from one distribution but reports another
as ``candidate_logits`` (the q of rejection sampling) breaks losslessness, and the same test must reject it.
"""

from __future__ import annotations

from collections import Counter
from unittest import mock

import pytest
import torch
from conftest import tiny_drafter, tiny_target

import eagle_hf
from eagle_hf.hf import EagleCandidateGenerator

scipy_stats = pytest.importorskip("scipy.stats")

VOCAB = 12
PROMPT = torch.tensor([[3, 7, 1, 5]])
NEW = 4  # prefill gives token 1; one round drafts tokens 2-3 (a chain of two), then the rest
ALPHA = 1e-3
TOP_K = (dict(temperature=0.9, top_k=6), ["TemperatureLogitsWarper", "TopKLogitsWarper"])
TOP_P = (dict(temperature=0.9, top_k=0, top_p=0.8), ["TemperatureLogitsWarper", "TopPLogitsWarper"])
CASES = {
    # name: (generate kwargs, expected processor classes, draft vocabulary, number of samples, seed)
    "top_k": (*TOP_K, None, 1500, 1234),
    "top_p": (*TOP_P, None, 1000, 4321),
    # a reduced draft vocabulary (8 of 12 ids, d2t mapping): q is -inf outside it
    "top_k_draft_vocab": (*TOP_K, 8, 800, 2468),
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    model = tiny_target("llama", vocab=VOCAB)
    with torch.no_grad():  # sharpen the near-uniform random logits so that p has structure
        model.model.norm.weight.mul_(6.0)
    return model


@pytest.fixture(scope="module")
def drafter(target):
    return tiny_drafter(target)


def _capture_processors():
    seen = []
    init = EagleCandidateGenerator.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen.append(self.logits_processor)

    return seen, mock.patch.object(EagleCandidateGenerator, "__init__", __init__)


def sample(target, drafter, n: int, seed: int, **kwargs):
    """n speculative samples of NEW tokens; returns (new-token tuples, total accepted, total drafted, processors)."""
    seen, patch = _capture_processors()
    torch.manual_seed(seed)
    rows, accepted, drafted = [], 0, 0
    with patch:
        for _ in range(n):
            out = target.generate(
                PROMPT, assistant_model=drafter, do_sample=True, max_new_tokens=NEW, num_assistant_tokens=5, **kwargs
            )
            rows.append(tuple(out[0, PROMPT.shape[1] :].tolist()))
            stats = eagle_hf.last_stats()
            accepted += stats.accepted
            drafted += stats.drafted
    assert all(len(r) == NEW for r in rows)
    return rows, accepted, drafted, seen[0]


@torch.no_grad()
def exact_distribution(target, processors, length: int, prompt: torch.Tensor = PROMPT) -> dict[tuple[int, ...], float]:
    """P(first `length` new tokens after `prompt`) under the target alone, applying `processors` with the full
    prefix."""
    dist: dict[tuple[int, ...], float] = {}

    def walk(prefix: torch.Tensor, tokens: tuple[int, ...], prob: float):
        if len(tokens) == length:
            dist[tokens] = prob
            return
        logits = target(prefix).logits[:, -1].float()
        probs = torch.softmax(processors(prefix, logits), dim=-1)[0].double()
        for t in torch.nonzero(probs > 0).flatten().tolist():
            walk(torch.cat([prefix, torch.tensor([[t]], device=prefix.device)], 1), tokens + (t,), prob * float(probs[t]))

    walk(prompt.to(target.device), (), 1.0)
    total = sum(dist.values())
    assert abs(total - 1.0) < 1e-6
    return dist


def marginal(dist: dict[tuple[int, ...], float], positions: tuple[int, ...]) -> dict[tuple[int, ...], float]:
    out: dict[tuple[int, ...], float] = Counter()
    for key, p in dist.items():
        out[tuple(key[i] for i in positions)] += p
    return dict(out)


def chi_square(rows, expected_probs: dict[tuple[int, ...], float], positions: tuple[int, ...]) -> float:
    """p-value of a chi-square goodness-of-fit test; bins with expected count < 5 are pooled."""
    n = len(rows)
    observed = Counter(tuple(r[i] for i in positions) for r in rows)
    impossible = {k: c for k, c in observed.items() if expected_probs.get(k, 0.0) <= 0.0}
    if impossible:  # a sample the target can never produce: certainly not lossless
        return 0.0
    bins = sorted(expected_probs, key=expected_probs.get)
    obs, exp = [], []
    pool_o, pool_e = 0, 0.0
    for key in bins:
        e = expected_probs[key] * n
        if e < 5:
            pool_o, pool_e = pool_o + observed.get(key, 0), pool_e + e
        else:
            obs.append(observed.get(key, 0))
            exp.append(e)
    if pool_e > 0:
        if pool_e >= 5 or not exp:
            obs.append(pool_o)
            exp.append(pool_e)
        else:  # still too small: merge it into the smallest regular bin
            obs[0] += pool_o
            exp[0] += pool_e
    assert len(exp) >= 5, "too few bins for a meaningful test"
    scale = n / sum(exp)  # float32 softmax: make the totals agree exactly
    return float(scipy_stats.chisquare(obs, [e * scale for e in exp]).pvalue)


def _check_processors(processors, expected_names):
    assert [type(p).__name__ for p in processors] == expected_names


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_is_lossless(target, drafter, case):
    kwargs, names, draft_vocab, n, seed = CASES[case]
    if draft_vocab is not None:
        drafter = tiny_drafter(target, draft_vocab=draft_vocab)
        assert drafter.d2t is not None and int(drafter.t2d.sum()) == draft_vocab
    rows, accepted, drafted, processors = sample(target, drafter, n, seed, **kwargs)
    _check_processors(processors, names)
    exact = exact_distribution(target, processors, 3)
    p12 = chi_square(rows, marginal(exact, (0, 1)), (0, 1))  # token 2: first draft of the chain
    p23 = chi_square(rows, marginal(exact, (1, 2)), (1, 2))  # token 3: second draft, or resampled, or next round
    rate = accepted / drafted
    print(f"\n{case}: N={n} p(t1,t2)={p12:.4g} p(t2,t3)={p23:.4g} acceptance={rate:.3f} ({accepted}/{drafted})")
    assert accepted > 0.1 * n, "the drafter should have had drafts accepted, or the test exercises nothing"
    assert accepted < drafted, "some drafts must be rejected too (the residual distribution path)"
    assert p12 > ALPHA and p23 > ALPHA, (p12, p23)


def _raw_q(self, original, draft_logits, prefix, drafted):
    """Draws the draft from the processed (temperature, top-k) distribution but reports the raw logits."""
    token, q, prob = original(self, draft_logits, prefix, drafted)
    assert q is not None  # sampling mode returns the processed logits the token was drawn from
    return token, self.drafter.target_logits(draft_logits.float()), prob


def _greedy_draft(self, original, draft_logits, prefix, drafted):
    """Takes the argmax draft (a one-hot distribution) but reports the processed soft q (transformers #32867)."""
    _, q, prob = original(self, draft_logits, prefix, drafted)
    return q.argmax(-1), q, prob


@pytest.mark.parametrize("broken", [_raw_q, _greedy_draft], ids=["raw_q", "greedy_draft"])
def test_negative_control_wrong_q_is_detected(target, drafter, broken):
    """A drafter whose reported q differs from the distribution its draft was actually drawn from breaks
    losslessness: rejection sampling "corrects" for the wrong q and the output is biased. The same chi-square
    test must reject it, so it would catch a real q bug."""
    kwargs = TOP_K[0]
    original = EagleCandidateGenerator._choose

    def choose(self, draft_logits, prefix, drafted):
        return broken(self, original, draft_logits, prefix, drafted)

    n = 300
    with mock.patch.object(EagleCandidateGenerator, "_choose", choose):
        rows, accepted, drafted, processors = sample(target, drafter, n, 99, **kwargs)
    exact = exact_distribution(target, processors, 3)
    p12 = chi_square(rows, marginal(exact, (0, 1)), (0, 1))
    p23 = chi_square(rows, marginal(exact, (1, 2)), (1, 2))
    print(f"\nnegative control {broken.__name__}: N={n} p(t1,t2)={p12:.3g} p(t2,t3)={p23:.3g} "
          f"acceptance={accepted / drafted:.3f}")
    assert min(p12, p23) < ALPHA, (p12, p23)


def test_harness_fits_plain_sampling(target):
    """Sanity of the harness itself: plain sampling (no drafter) fits the enumerated distribution, built here
    from transformers' warpers directly rather than captured from generate()."""
    kwargs = TOP_K[0]
    seen, patch = _capture_processors()
    torch.manual_seed(7)
    with patch:
        rows = [tuple(target.generate(PROMPT, do_sample=True, max_new_tokens=1, **kwargs)[0, -1:].tolist())
                for _ in range(300)]
    assert not seen  # plain sampling: no EAGLE generator
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

    processors = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(6)])
    exact = exact_distribution(target, processors, 1)
    assert chi_square(rows, exact, (0,)) > ALPHA
    assert sum(1 for p in exact.values() if p > 0) == 6  # top-k support


def test_sampling_warpers_process_a_tree_without_building_its_ids():
    """Temperature and top-p read only the scores: a tree's nodes are processed in one call, with no ids built
    from the context (a copy proportional to its length every round); a processor that reads the ids still gets
    each node's own."""
    from transformers import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopPLogitsWarper,
    )

    from eagle_hf.speculation.tree import process_logits

    prefix, paths = torch.tensor([[5, 6, 7]]), [[], [3], [3, 4], [9]]
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(0))

    def one_by_one(processors):
        return torch.cat([processors(torch.tensor([[5, 6, 7, *p]]), logits[i : i + 1]) for i, p in enumerate(paths)])

    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9)])
    with mock.patch("eagle_hf.speculation.tree.pack") as pack:
        torch.testing.assert_close(process_logits(warpers, prefix, paths, logits), one_by_one(warpers))
    pack.assert_not_called()
    mixed = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), *warpers])
    torch.testing.assert_close(process_logits(mixed, prefix, paths, logits), one_by_one(mixed))


def test_draw_samples_each_row_from_its_weights():
    """The two-level inverse transform: every row (unnormalised weights, a vocabulary that is no multiple of the
    block, mass in the last partial block) drawn in proportion to its weights; a weight-0 token never."""
    from eagle_hf.speculation.tree import DRAW_BLOCK, draw

    v = 2 * DRAW_BLOCK + 88
    weights = torch.zeros(3, v)
    weights[0, [1, 300, v - 1]] = torch.tensor([2.0, 1.0, 1.0])  # unnormalised, one token in the partial block
    weights[1, :] = 1.0  # uniform
    weights[2, 7] = 0.3  # a single token
    g = torch.Generator().manual_seed(0)
    drawn = torch.stack([draw(weights, g) for _ in range(4000)])  # [4000, 3]
    assert set(drawn[:, 2].tolist()) == {7}
    assert set(drawn[:, 0].tolist()) == {1, 300, v - 1}
    share = torch.bincount(drawn[:, 0], minlength=v)[[1, 300, v - 1]] / 4000
    torch.testing.assert_close(share, torch.tensor([0.5, 0.25, 0.25]), atol=0.03, rtol=0)
    assert drawn[:, 1].unique().numel() > 0.95 * v  # uniform: the whole vocabulary is reached (~99.9% expected)
    assert abs(drawn[:, 1].double().mean().item() - (v - 1) / 2) < 0.05 * v
