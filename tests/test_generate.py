"""End-to-end tests of ``target.generate(..., assistant_model=drafter)``: exactness against plain ``generate()``.

Two kinds of drafter are used:

* a *random* drafter (``tiny_drafter``): its drafts are almost always rejected, so every round exercises the
  rejection path, the one-row feature slices and the full-length KV crop;
* an *oracle*: the drafts are replaced by the true greedy continuation (taken from plain ``generate()``) except
  at a few deliberately wrong positions. Most drafts are accepted, which exercises multi-token acceptance, the
  target KV crop after partial acceptance and the slicing of ``n_last_matches + 1`` feature rows. The drafter
  still reads every verified row; only its proposals are replaced.

A greedy one-row chain runs in eagle_hf's loop (a tree with one child per node); transformers' assisted loop
runs it where eagle_hf's loop cannot (`transformers_loop` forces it), and is tested here too.

All models are tiny, random and float32. Greedy output must be token-for-token identical to plain ``generate()``.
"""

from __future__ import annotations

import contextlib
import threading
from unittest import mock

import pytest
import torch
from conftest import VOCAB, patch_drafts, tiny_drafter, tiny_target
from transformers import StoppingCriteria, StoppingCriteriaList

import eagle_hf
from eagle_hf import EagleCompatibilityError
from eagle_hf.drafter.capture import default_aux_layer_ids, gather_aux, hidden_state_request
from eagle_hf.hf import EagleCandidateGenerator, routing
from eagle_hf.hf.version import CACHE_KEY, output_cache
from eagle_hf.speculation.tree import DraftTree

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]
DRAFT_LENGTHS = [1, 3, 5, 8]
#: (prompt length, max_new_tokens); gemma3's sliding window is 8, so the longer prompts cross it
CASES = [(1, 10), (4, 24), (13, 17), (7, 1), (9, 2), (20, 6)]
#: new-token indices (0 = the prefill's token, never drafted) at which the oracle proposes a wrong token
WRONG_NEW = (3, 4, 11, 19)


pytestmark = pytest.mark.usefixtures("one_thread")


_MODELS: dict = {}


def models(family: str, layers: int = 6):
    """Cached (target, drafter) pairs; generate() never changes their weights."""
    key = (family, layers)
    if key not in _MODELS:
        target = tiny_target(family, layers=layers)
        _MODELS[key] = (target, tiny_drafter(target))
    return _MODELS[key]


def prompt(length: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 17 * seed + length)
    return torch.randint(1, vocab, (1, length), generator=g)  # no pad id 0: generate() would mask it


def plain(target, ids, **kwargs):
    return target.generate(ids, do_sample=False, **kwargs)


@contextlib.contextmanager
def oracle(reference: torch.Tensor, wrong_positions=(), vocab: int = VOCAB):
    """Make the drafter propose ``reference`` (a full greedy sequence ``[1, T]``), except at absolute positions in
    ``wrong_positions`` where it proposes a different token, in whichever loop runs the chain: eagle_hf's (its
    tree growth patched) or transformers' (the adapter's token choice patched). Yields the list of proposals
    ``(position, token)``."""
    ref = reference[0]
    proposals: list[tuple[int, int]] = []

    def propose(pos: int) -> int:
        token = int(ref[pos])
        if pos in wrong_positions:
            token = (token + 1) % vocab
        proposals.append((pos, token))
        return token

    def _choose(self, draft_logits, prefix, drafted):
        assert prefix.shape[0] == 1 and draft_logits.shape[0] == 1
        n = prefix.shape[1]
        assert torch.equal(prefix[0].cpu(), ref[:n].cpu()), "the accepted prefix left the greedy path"
        token = propose(n + drafted.shape[-1])  # drafted: [1, d] the drafts so far
        return torch.tensor([token]), None, torch.zeros(1)  # (target id, q logits, log-probability)

    def chain(position, root_token, depth, total_tokens):  # the root is the token at `position`
        assert int(ref[position]) == root_token, "the accepted prefix left the greedy path"
        tokens = [root_token] + [propose(p) for p in range(position + 1, min(position + depth + 1, len(ref)))]
        tokens = tokens[:total_tokens]
        return DraftTree(torch.tensor(tokens), torch.arange(-1, len(tokens) - 1), torch.zeros(len(tokens)))

    with mock.patch.object(EagleCandidateGenerator, "_choose", _choose), patch_drafts(chain):
        yield proposals


@contextlib.contextmanager
def transformers_loop():
    """Run one-row greedy chains in transformers' assisted loop (through the `CandidateGenerator` adapter), as
    calls eagle_hf's loop cannot take do (a model or input it does not support)."""
    with mock.patch.object(routing, "_own_loop_for_chain", lambda *args: None):
        yield


@contextlib.contextmanager
def capture_generators():
    """Keep a reference to every EagleCandidateGenerator built inside the block, plus the length of the
    ``input_ids`` each (non-prefill) ``get_candidates`` call saw."""
    made: list[EagleCandidateGenerator] = []
    init, get = EagleCandidateGenerator.__init__, EagleCandidateGenerator.get_candidates

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.seen_lengths = []
        made.append(self)

    def get_candidates(self, input_ids, *args, **kwargs):
        out = get(self, input_ids, *args, **kwargs)
        if self.state.length > 0:
            self.seen_lengths.append(input_ids.shape[1])
        return out

    with mock.patch.object(EagleCandidateGenerator, "__init__", __init__), mock.patch.object(
        EagleCandidateGenerator, "get_candidates", get_candidates
    ):
        yield made


def check_stats(stats, prompt_len: int, out: torch.Tensor) -> None:
    """Internal consistency of SpecDecodeStats for one finished call."""
    assert stats is not None
    assert stats.cycles == len(stats.accepted_per_cycle) == len(stats.draft_length_per_cycle)
    assert stats.accepted == sum(stats.accepted_per_cycle) <= stats.drafted == sum(stats.draft_length_per_cycle)
    assert all(0 <= a <= d for a, d in zip(stats.accepted_per_cycle, stats.draft_length_per_cycle))
    assert sum(stats.drafted_per_position) == stats.drafted
    assert sum(stats.accepted_per_position) == stats.accepted
    if stats.cycles:
        assert stats.mean_acceptance_length == pytest.approx((stats.accepted + stats.cycles) / stats.cycles)
    assert stats.new_tokens == out.shape[-1] - prompt_len
    # every cycle yields accepted + 1 tokens; the prefill yields one; a last round with no budget left for a
    # draft (one token to go) yields one more without being a cycle
    assert stats.new_tokens - (1 + stats.accepted + stats.cycles) in (0, 1) or stats.new_tokens == 0
    assert 0.0 <= stats.drafter_time <= stats.total_time
    assert stats.timed_drafter_rounds <= stats.timed_rounds <= stats.steps  # (rounds that compiled: not timed)


# --------------------------------------------------------------------------------------- greedy exactness
@pytest.mark.parametrize("family,loop", [(family, "eagle_hf") for family in FAMILIES]
                         + [("llama", "assisted"), ("gemma3", "assisted")])
def test_greedy_equals_plain_generate(family, loop):
    target, drafter = models(family)
    with transformers_loop() if loop == "assisted" else contextlib.nullcontext():
        _greedy_equals_plain_generate(target, drafter, family)


def _greedy_equals_plain_generate(target, drafter, family):
    total_accepted = 0
    for case_index, (plen, max_new) in enumerate(CASES):
        ids = prompt(plen, seed=case_index)
        expected = plain(target, ids, max_new_tokens=max_new)
        assert expected.shape[1] == plen + max_new  # no EOS configured
        wrong = {plen + i for i in WRONG_NEW}
        for k in DRAFT_LENGTHS:
            out = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new, num_assistant_tokens=k)
            assert torch.equal(out, expected), f"random drafter, {family} k={k} prompt={plen} new={max_new}"
            check_stats(eagle_hf.last_stats(), plen, out)
            assert max(eagle_hf.last_stats().draft_length_per_cycle, default=0) <= k

            with oracle(expected, wrong):
                out = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new, num_assistant_tokens=k)
            assert torch.equal(out, expected), f"oracle drafter, {family} k={k} prompt={plen} new={max_new}"
            stats = eagle_hf.last_stats()
            check_stats(stats, plen, out)
            # an oracle draft is only rejected at a deliberately wrong position
            rejected_cycles = sum(a < d for a, d in zip(stats.accepted_per_cycle, stats.draft_length_per_cycle))
            assert rejected_cycles <= sum(plen < p < plen + max_new for p in wrong)
            if max_new >= 10 and k >= 3:
                assert stats.mean_acceptance_length >= 2.0, stats.summary()
                assert stats.accepted >= max_new // 2, stats.summary()
            total_accepted += stats.accepted
    assert total_accepted > 100


def test_shallow_target_gets_a_matching_drafter():
    """A target with < 5 layers has fewer than three distinct default taps; for_target must follow."""
    target, drafter = models("llama", layers=3)
    assert drafter.config.num_aux_hidden_states == len(default_aux_layer_ids(3))
    ids = prompt(6)
    expected = plain(target, ids, max_new_tokens=12)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=12, num_assistant_tokens=4)
    assert torch.equal(out, expected)
    # a drafter that reads three taps cannot serve it: a clear error, not a shape error deep inside fc_norm
    _, six_layer_drafter = models("llama")
    with pytest.raises(EagleCompatibilityError, match="captured layers"):
        target.generate(ids, assistant_model=six_layer_drafter, max_new_tokens=3)


# --------------------------------------------------------------------------------- KV / feature bookkeeping
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k", [3, 8])
def test_drafter_cache_equals_recomputation(family, k):
    target, drafter = models(family)
    plen, max_new = 11, 26
    ids = prompt(plen, seed=5)
    expected = plain(target, ids, max_new_tokens=max_new)
    wrong = {plen + i for i in WRONG_NEW}
    with transformers_loop(), capture_generators() as made, oracle(expected, wrong):
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new, num_assistant_tokens=k)
    assert torch.equal(out, expected)
    assert eagle_hf.last_stats().accepted >= max_new // 2  # multi-token acceptance happened
    (generator,) = made
    state = generator.state

    # Only rows whose features came from verified target forwards exist: after the last drafting round the
    # cache covers every position of that round's input except its newest token (whose features the target
    # had not produced yet). The final round's own forward is never fed back.
    rows = state.length
    assert rows == generator.seen_lengths[-1] - 1
    assert rows < out.shape[1] - 1

    num_layers = target.config.num_hidden_layers
    aux_ids = default_aux_layer_ids(num_layers)
    assert generator.aux_ids == aux_ids
    with torch.no_grad():
        out = out.to(target.device)
        hs = target(out, output_hidden_states=hidden_state_request(aux_ids)).hidden_states
        aux_full = gather_aux(hs, aux_ids)  # [1, T, A*H]
        # real row t pairs the features of position t with token t + 1, at position t
        ref = drafter.step(
            drafter.fuse(aux_full[:, :rows]), out[:, 1 : rows + 1], torch.arange(rows, device=out.device)[None]
        )
    assert ref.kv.keys.shape == state.kv.keys.shape
    assert torch.allclose(state.kv.keys, ref.kv.keys, atol=1e-5), (state.kv.keys - ref.kv.keys).abs().max()
    assert torch.allclose(state.kv.values, ref.kv.values, atol=1e-5), (state.kv.values - ref.kv.values).abs().max()


# ------------------------------------------------------------------------------------------ stop conditions
class Recorder:
    """A minimal streamer (TextStreamer's put/end protocol) that keeps the token ids it is given."""

    def __init__(self):
        self.chunks: list[list[int]] = []
        self.ended = 0

    def put(self, value):
        assert not self.ended
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended += 1


def _eos_case(target, plen=8, max_new=30, min_index=4):
    """A prompt and a token its greedy continuation first produces at new-token index >= min_index."""
    for seed in range(20):
        ids = prompt(plen, seed=100 + seed)
        full = plain(target, ids, max_new_tokens=max_new)
        new = full[0, plen:].tolist()
        for i in range(min_index, max_new - 6):
            if new[i] not in new[:i]:
                return ids, full, new[i], i
    raise AssertionError("no suitable EOS candidate")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_eos_inside_an_accepted_chunk(family):
    target, drafter = models(family)
    plen = 8
    ids, full, eos, index = _eos_case(target, plen)
    expected = plain(target, ids, max_new_tokens=30, eos_token_id=eos)
    assert torch.equal(expected, full[:, : plen + index + 1])  # plain generate stops right after the EOS

    out = target.generate(ids, assistant_model=drafter, max_new_tokens=30, eos_token_id=eos, num_assistant_tokens=4)
    assert torch.equal(out, expected)
    check_stats(eagle_hf.last_stats(), plen, out)

    streamer = Recorder()
    with oracle(full):  # drafts run past the EOS: the loop must cut the accepted chunk there
        out = target.generate(
            ids, assistant_model=drafter, max_new_tokens=30, eos_token_id=eos, num_assistant_tokens=8, streamer=streamer
        )
    assert torch.equal(out, expected)
    last_chunk = streamer.chunks[-1]
    assert last_chunk[-1] == eos and len(last_chunk) >= 2, streamer.chunks  # the EOS was an accepted draft
    stats = eagle_hf.last_stats()
    check_stats(stats, plen, out)
    assert stats.accepted_per_cycle[-1] < stats.draft_length_per_cycle[-1]  # the drafts after the EOS are dropped


def test_max_new_tokens_and_max_length_exact():
    target, drafter = models("qwen3")
    plen = 5
    ids = prompt(plen, seed=3)
    full = plain(target, ids, max_new_tokens=40)
    for max_new in (1, 2, 3, 4, 7, 9, 16):
        for k in (1, 8):
            out = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new, num_assistant_tokens=k)
            assert out.shape[1] == plen + max_new and torch.equal(out, full[:, : plen + max_new])
            with oracle(full):
                out = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new, num_assistant_tokens=k)
            assert out.shape[1] == plen + max_new and torch.equal(out, full[:, : plen + max_new])
            check_stats(eagle_hf.last_stats(), plen, out)
    with oracle(full):
        out = target.generate(ids, assistant_model=drafter, max_length=plen + 11, num_assistant_tokens=6)
    assert torch.equal(out, full[:, : plen + 11])


class StopAtLength(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool,
                          device=input_ids.device)


def _custom_stop_runs():
    target, drafter = models("llama")
    plen = 6
    ids = prompt(plen, seed=7)
    full = plain(target, ids, max_new_tokens=30)
    stop_at = plen + 4  # the prefill gives plen + 1; the next accepted chunk (up to 7 tokens) crosses plen + 4
    expected = plain(target, ids, max_new_tokens=30, stopping_criteria=StoppingCriteriaList([StopAtLength(stop_at)]))
    with oracle(full):
        out = target.generate(
            ids,
            assistant_model=drafter,
            max_new_tokens=30,
            num_assistant_tokens=6,
            stopping_criteria=StoppingCriteriaList([StopAtLength(stop_at)]),
        )
    return full, expected, out, stop_at


def test_custom_stopping_criteria_behaviour():
    """transformers' assisted loop (utils.py, step 3 of ``_assisted_decoding``) crops an accepted chunk only at
    EOS and max_length; other StoppingCriteria are evaluated once per round, after the whole chunk. The chunk
    with an oracle drafter does cross the stop length, and eagle_hf trims the output back to where plain
    ``generate()`` stops (streamers have already received the overshoot)."""
    full, expected, out, stop_at = _custom_stop_runs()
    assert expected.shape[1] == stop_at
    assert torch.equal(out, expected)
    assert torch.equal(out, full[:, :stop_at])


def test_custom_stopping_criteria_matches_plain_generate():
    """eagle_hf re-evaluates the user's criteria on every prefix after generation, so the output matches."""
    _, expected, out, _ = _custom_stop_runs()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("use_oracle", [False, True])
def test_streamer_receives_exactly_the_new_tokens(use_oracle):
    target, drafter = models("mistral")
    plen = 9
    ids = prompt(plen, seed=11)
    plain_streamer = Recorder()
    expected = plain(target, ids, max_new_tokens=20, streamer=plain_streamer)
    streamer = Recorder()
    ctx = oracle(expected, {plen + 5}) if use_oracle else contextlib.nullcontext()
    with ctx:
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=20, num_assistant_tokens=5, streamer=streamer)
    assert torch.equal(out, expected)
    assert streamer.ended == 1
    assert streamer.chunks[0] == ids[0].tolist()  # generate() first puts the prompt
    streamed = [t for chunk in streamer.chunks[1:] for t in chunk]
    assert streamed == out[0, plen:].tolist()
    assert streamed == [t for chunk in plain_streamer.chunks[1:] for t in chunk]
    if use_oracle:
        assert max(len(c) for c in streamer.chunks[1:]) > 1  # accepted chunks are streamed as one put()


@pytest.mark.parametrize("use_oracle", [False, True])
def test_return_dict_with_scores(use_oracle):
    target, drafter = models("qwen2")
    plen, max_new = 7, 15
    ids = prompt(plen, seed=13)
    expected = target.generate(
        ids, do_sample=False, max_new_tokens=max_new, return_dict_in_generate=True, output_scores=True
    )
    ctx = oracle(expected.sequences, {plen + 6}) if use_oracle else contextlib.nullcontext()
    with ctx:
        out = target.generate(
            ids,
            assistant_model=drafter,
            max_new_tokens=max_new,
            num_assistant_tokens=4,
            return_dict_in_generate=True,
            output_scores=True,
        )
    assert torch.equal(out.sequences, expected.sequences)
    assert len(out.scores) == out.sequences.shape[1] - plen == max_new
    for mine, theirs in zip(out.scores, expected.scores):
        assert mine.shape == theirs.shape == (1, VOCAB)
        assert torch.allclose(mine, theirs, atol=1e-4)
    check_stats(eagle_hf.last_stats(), plen, out.sequences)


# ------------------------------------------------------------------------------------------------- stats
def test_stats_fields_consistent():
    target, drafter = models("llama")
    plen, max_new = 10, 25
    ids = prompt(plen, seed=21)
    expected = plain(target, ids, max_new_tokens=max_new)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new, num_assistant_tokens=3)
    random_stats = eagle_hf.last_stats()
    check_stats(random_stats, plen, out)
    assert random_stats.cycles > 0 and random_stats.drafted > 0
    # nothing compiles or captures on the CPU's eager path: every round's times reach the schedule
    assert random_stats.timed_rounds == random_stats.steps and random_stats.timed_drafter_rounds > 0
    with oracle(expected, {plen + 3}):
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new, num_assistant_tokens=3)
    stats = eagle_hf.last_stats()
    assert stats is not random_stats  # a fresh object per call
    check_stats(stats, plen, out)
    assert stats.accepted > stats.drafted // 2 and stats.acceptance_rate > 0.5
    assert stats.acceptance_per_position[0] > 0.5
    assert stats.to_dict()["new_tokens"] == max_new
    assert "cycles" in stats.summary()


def test_stats_are_per_thread():
    pairs = [models("llama"), models("gemma3")]
    lengths = [(7, 13, 4), (5, 9, 17)]  # max_new_tokens of each thread's successive calls
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)
    main_before = eagle_hf.last_stats()

    with transformers_loop(), capture_generators() as made:

        def work(index):
            try:
                target, drafter = pairs[index]
                ids = prompt(6, seed=30 + index)
                barrier.wait()
                mine = []
                for max_new in lengths[index]:
                    out = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new, num_assistant_tokens=3)
                    stats = eagle_hf.last_stats()
                    generator = next(g for g in made if g.stats is stats)  # the stats of this call's generator
                    assert generator.drafter is drafter
                    assert stats.new_tokens == max_new == out.shape[1] - 6
                    check_stats(stats, 6, out)
                    mine.append(stats)
                results[index] = mine
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    assert len(made) == 6
    assert {id(s) for s in results[0]}.isdisjoint(id(s) for s in results[1])
    assert eagle_hf.last_stats() is main_before  # the main thread's value is untouched


# ---------------------------------------------------------------------------------------------- schedule
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_heuristic_schedule_is_exact(family):
    target, drafter = models(family)
    plen, max_new = 8, 30
    ids = prompt(plen, seed=41)
    expected = plain(target, ids, max_new_tokens=max_new)
    for schedule in ("heuristic", "heuristic_transient"):
        out = target.generate(
            ids, assistant_model=drafter, max_new_tokens=max_new, num_assistant_tokens=3,
            num_assistant_tokens_schedule=schedule,
        )
        assert torch.equal(out, expected)
        check_stats(eagle_hf.last_stats(), plen, out)
        with oracle(expected, {plen + 20}):
            out = target.generate(
                ids, assistant_model=drafter, max_new_tokens=max_new, num_assistant_tokens=2,
                num_assistant_tokens_schedule=schedule,
            )
        assert torch.equal(out, expected)
        stats = eagle_hf.last_stats()
        check_stats(stats, plen, out)
        lengths = stats.draft_length_per_cycle
        assert lengths[:3] == [2, 4, 6], lengths  # +2 after every fully accepted round
    # the constant schedule never changes the draft length (except for the final budget cap)
    with oracle(expected):
        target.generate(ids, assistant_model=drafter, max_new_tokens=max_new, num_assistant_tokens=2)
    assert set(eagle_hf.last_stats().draft_length_per_cycle) <= {1, 2}


def test_confidence_threshold_and_reduced_draft_vocabulary_are_exact():
    target, _ = models("qwen2")
    drafter = tiny_drafter(target, draft_vocab=40, seed=3)
    allowed = set(torch.nonzero(drafter.t2d).flatten().tolist())
    plen, max_new = 6, 20
    ids = prompt(plen, seed=51)
    expected = plain(target, ids, max_new_tokens=max_new)
    drafts: list[list[int]] = []
    out = target.generate(
        ids, assistant_model=drafter, max_new_tokens=max_new, num_assistant_tokens=4,
        draft_listeners=[lambda tokens, accepted, last: drafts.append(list(tokens))],
    )
    assert torch.equal(out, expected)
    assert drafts and max(len(d) for d in drafts) == 4
    assert {t for d in drafts for t in d} <= allowed  # drafts map through d2t into the draft vocabulary
    # a random drafter's top probability is ~1/40: a 0.5 confidence threshold ends every chain after one draft
    out = target.generate(
        ids, assistant_model=drafter, max_new_tokens=max_new, num_assistant_tokens=4,
        assistant_confidence_threshold=0.5,
    )
    assert torch.equal(out, expected)
    assert set(eagle_hf.last_stats().draft_length_per_cycle) == {1}


def test_time_based_criteria_are_not_replayed():
    """max_time cannot be re-evaluated on prefixes after the fact: the output must not be cut short."""
    target, drafter = models("llama")
    ids = prompt(6, seed=3)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=30, num_assistant_tokens=3, max_time=60.0)
    assert torch.equal(out, plain(target, ids, max_new_tokens=30))


def test_user_hidden_states_are_kept():
    target, drafter = models("llama")
    ids = prompt(6, seed=4)
    res = target.generate(ids, assistant_model=drafter, max_new_tokens=10, num_assistant_tokens=3,
                          return_dict_in_generate=True, output_hidden_states=True)
    assert torch.equal(res.sequences, plain(target, ids, max_new_tokens=10))
    assert len(res.hidden_states) > 0 and all(h is not None for h in res.hidden_states[0])


def test_the_loop_decodes_in_inference_mode_and_hands_back_normal_tensors():
    """eagle_hf's loop runs its rounds in inference mode (no autograd bookkeeping on a round's small operations);
    what it returns is made of normal tensors, as plain generate()'s: written in place, used under autograd."""
    target, drafter = models("llama")
    ids = prompt(6, seed=4)
    modes = []
    hook = target.register_forward_pre_hook(lambda module, args: modes.append(torch.is_inference_mode_enabled()))
    try:
        res = target.generate(ids, assistant_model=drafter, max_new_tokens=10, tree_depth=3, do_sample=False,
                              return_dict_in_generate=True, output_scores=True, output_logits=True,
                              output_hidden_states=True)
    finally:
        hook.remove()
    assert modes and all(modes)  # the prefill and every verify forward
    assert torch.equal(res.sequences, plain(target, ids, max_new_tokens=10))
    outputs = [res.sequences, *res.scores, *res.logits, *(h for step in res.hidden_states for h in step)]
    assert not any(t.is_inference() for t in outputs)
    weight = torch.ones((), requires_grad=True)
    (weight * res.scores[0]).sum().backward()  # (an inference tensor cannot be saved for backward)
    res.sequences[:, -1] = 0  # (nor written in place outside inference mode)


def test_plain_generate_continues_a_cache_the_loop_wrote():
    """The cache eagle_hf's loop hands back (its new tensors made in inference mode) continues in transformers' own
    decoding, outside inference mode, as a cache plain generate() wrote."""
    target, drafter = models("llama")
    ids = prompt(6, seed=5)
    res = target.generate(ids, assistant_model=drafter, max_new_tokens=8, tree_depth=3, do_sample=False,
                          return_dict_in_generate=True)
    follow = torch.cat([res.sequences, prompt(3, seed=6)], 1)
    out = target.generate(follow, max_new_tokens=6, do_sample=False, **{CACHE_KEY: output_cache(res)})
    assert torch.equal(out, plain(target, follow, max_new_tokens=6))
