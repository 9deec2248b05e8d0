"""Batched speculative decoding: left-padded batches, ragged acceptance per row, rows finishing on their own.

The oracle is plain `generate()` of the same padded batch, and of each row alone (float32, greedy); sampling is
checked per row against the target's exact distribution.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import patch_drafts, tiny_drafter, tiny_target
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

import eagle_hf
from eagle_hf.errors import EagleCompatibilityError
from eagle_hf.hf import tree_loop
from eagle_hf.speculation import ragged
from eagle_hf.speculation.tree import DraftTree

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = (3, 9, 5, 12, 7)
NEW = 24


def left_padded(lengths=LENGTHS, seed=0, vocab=96):
    """Random prompts of the given lengths, left-padded with 0: (input_ids, attention_mask) [B, max length]."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, width - n :] = torch.randint(1, vocab, (n,), generator=g)
        mask[b, width - n :] = 1
    return ids, mask


def batch_oracle(truths: list[list[int]]):
    """Patch draft_tree: for the row whose true continuation (prompt + greedy output) has the root at the
    drafter's position, a chain that follows the truth with a wrong token at a depth that varies per row,
    beside a wrong sibling; so rows accept different lengths every round."""

    calls = []

    def fake(pos, root_token, depth, total_tokens):
        row = next(b for b, t in enumerate(truths) if len(t) > pos and t[pos] == root_token)
        cont = truths[row][pos + 1 : pos + 1 + depth]
        calls.append(row)
        wrong_at = 1 + (len(calls) + row) % 4  # which row accepts the most changes from round to round
        if len(cont) > wrong_at:
            cont = cont[:wrong_at] + [(cont[wrong_at] + 1) % 96] + cont[wrong_at + 1 :]
        if not cont:
            return DraftTree.root(root_token)
        toks = [root_token, (cont[0] + 7) % 96] + cont
        parents = [-1, 0, 0] + list(range(2, 2 + len(cont) - 1))
        return DraftTree(torch.tensor(toks[:total_tokens]), torch.tensor(parents[:total_tokens]),
                         torch.zeros(min(len(toks), total_tokens)))

    return patch_drafts(fake)


def truths_of(ids, mask, ref):
    """Each row's real tokens (prompt without padding, then its greedy output) for the oracle."""
    return [ids[b][mask[b].bool()].tolist() + ref[b, ids.shape[1] :].tolist() + [0] * 8 for b in range(len(ids))]


MODES = {
    "tree": dict(draft_mode="tree", tree_depth=4, tree_top_k=3, tree_total_tokens=10,
                 num_assistant_tokens_schedule="constant"),
    "tree adaptive": dict(draft_mode="tree", tree_depth=4, tree_top_k=2, tree_total_tokens=8),
    "chain": dict(draft_mode="chain", num_assistant_tokens=4, num_assistant_tokens_schedule="constant"),
    "eagle+copy": dict(draft_sources="eagle+copy", tree_depth=3, tree_top_k=2, tree_total_tokens=6),
}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batch_greedy_equals_the_plain_batch_and_each_row_alone(family):
    target = tiny_target(family)
    drafter = tiny_drafter(target)
    ids, mask = left_padded()
    plain = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    ref = target.generate(ids, **plain)
    for name, kwargs in MODES.items():
        out = target.generate(ids, assistant_model=drafter, **plain, **kwargs)
        assert torch.equal(out, ref), name
    with batch_oracle(truths_of(ids, mask, ref)):  # long, ragged accepted paths
        out = target.generate(ids, assistant_model=drafter, **plain, **MODES["tree"])
    assert torch.equal(out, ref)
    stats = eagle_hf.last_stats()
    assert stats.mean_acceptance_length > 2.0, stats.summary()
    assert len(stats.per_row) == len(LENGTHS) and stats.cycles == sum(s.cycles for s in stats.per_row)
    assert stats.new_tokens == len(LENGTHS) * NEW
    for b in range(len(LENGTHS)):  # each row alone, unpadded
        alone = target.generate(ids[b : b + 1][:, mask[b].bool()], max_new_tokens=NEW, do_sample=False)
        assert alone[0, -NEW:].tolist() == ref[b, -NEW:].tolist(), b


def test_rows_finish_on_their_own_at_eos_and_leave_the_batch():
    """An EOS each row reaches at a different step; finished rows are padded, and the others go on."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids, mask = left_padded(seed=3)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    for step in (0, 3, 11):  # the token row 1 emits at that step ends every row that emits it
        eos = int(free[1, ids.shape[1] + step])
        plain = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=0)
        ref = target.generate(ids, **plain)
        end = ids.shape[1] + free[1, ids.shape[1] :].tolist().index(eos)  # row 1 ends at its first EOS
        assert (ref[1, end + 1 :] == 0).all()
        for name in ("tree", "chain"):
            out = target.generate(ids, assistant_model=drafter, **plain, **MODES[name])
            assert torch.equal(out, ref), (step, name)
        with batch_oracle(truths_of(ids, mask, free)):
            out = target.generate(ids, assistant_model=drafter, **plain, **MODES["tree"])
        assert torch.equal(out, ref), step


@pytest.mark.parametrize("full_batch_cheaper", [True, False])
def test_finished_rows_stay_as_padding_where_the_full_batch_is_cheaper(monkeypatch, full_batch_cheaper):
    """float32 on this project's CPU: a forward of 7 rows costs more than one of 8. A finished row leaves the batch
    only where the cost model knows the smaller batch as cheaper; otherwise it stays as a padding row. Outputs are the
    same either way."""
    class Costs:  # what the cost model knows of plain rounds of each batch size
        def forward(self, n):
            return 1 / n if full_batch_cheaper else float(n)

        def observe(self, timing):
            pass

    monkeypatch.setattr(tree_loop, "cost_model", lambda target, drafter=None, compiled=False: Costs())
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids, mask = left_padded(seed=3)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    eos = int(free[1, ids.shape[1] + 3])  # row 1 (at least) ends early
    plain = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=0)
    ref = target.generate(ids, **plain)
    assert (ref[:, -1] == 0).any() and (ref[:, -1] != 0).any()  # some rows finish early, some run to the end
    rows = []
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: (rows.append(k["input_ids"].shape[0]), forward(*a, **k))[1])
    for name in ("tree", "chain"):
        rows.clear()
        out = target.generate(ids, assistant_model=drafter, **plain, **MODES[name])
        assert torch.equal(out, ref), name
        assert (min(rows) == len(ids)) == full_batch_cheaper, rows


@pytest.mark.parametrize("drafting", ["eager", "programs"])
def test_holes_are_compacted_without_changing_the_output(monkeypatch, drafting):
    """Holes in both caches, compacted often: the output is plain decoding's, with the drafter's levels run eagerly
    or as its fixed-shape programs (their validity buffer copied in again after each compaction)."""
    from eagle_hf.speculation.drafting import DraftState

    monkeypatch.setenv("EAGLE_HF_DRAFTER_GRAPHS", "on" if drafting == "programs" else "off")
    monkeypatch.setattr(ragged, "MIN_HOLES_TO_COMPACT", 2)
    monkeypatch.setattr(ragged, "HOLE_FRACTION", 0.0)
    drafter_compactions = []
    compact = DraftState.compact
    monkeypatch.setattr(DraftState, "compact", lambda self: (drafter_compactions.append(
        self.ragged.worth_compacting()), compact(self))[1])
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids, mask = left_padded(lengths=(6, 6, 6), seed=5)
    plain = dict(attention_mask=mask, max_new_tokens=40, do_sample=False)
    ref = target.generate(ids, **plain)
    compactions = []
    from eagle_hf.hf import cache as tree_cache

    original = tree_cache.regather_cache
    monkeypatch.setattr(tree_cache, "regather_cache", lambda c, i: (compactions.append(i.shape), original(c, i)))
    with batch_oracle(truths_of(ids, mask, ref)):
        out = target.generate(ids, assistant_model=drafter, **plain, **MODES["tree"])
    assert torch.equal(out, ref)
    assert compactions, "the ragged rounds should have left holes to compact"
    assert any(drafter_compactions), "... in the drafter's cache too"


def test_the_drafting_programs_grow_over_holes_and_compactions(monkeypatch):
    """A random drafter's trees in a left-padded batch (rows accept different lengths: holes in the drafter's cache,
    compacted often), grown by the fixed-shape programs over the validity buffer: plain decoding's output."""
    from eagle_hf.speculation import drafting

    monkeypatch.setenv("EAGLE_HF_DRAFTER_GRAPHS", "on")
    monkeypatch.setattr(ragged, "MIN_HOLES_TO_COMPACT", 2)
    monkeypatch.setattr(ragged, "HOLE_FRACTION", 0.0)
    launched, compactions = [], []
    compact = drafting.DraftState.compact
    monkeypatch.setattr(drafting.DraftState, "compact", lambda self: (compactions.append(
        self.ragged.worth_compacting()), compact(self))[1])
    grow = drafting.DraftPrograms.grow
    monkeypatch.setattr(drafting.DraftPrograms, "grow", lambda self, *a: (launched.append(
        drafting.DraftPrograms), grow(self, *a))[1])
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    with torch.no_grad():
        drafter.lm_head.weight.mul_(30.0)  # peaky: trees reach their depth, and some of their drafts are right
    ids, mask = left_padded(lengths=(9, 6, 4), seed=5)
    plain = dict(attention_mask=mask, max_new_tokens=40, do_sample=False)
    ref = target.generate(ids, **plain)
    for mode in ("tree", "chain"):
        launched.clear()
        compactions.clear()
        out = target.generate(ids, assistant_model=drafter, **plain, **MODES[mode])
        assert torch.equal(out, ref), mode
        assert launched, mode
        assert any(compactions) or mode == "chain"  # (the chain's rows part less: holes, not enough to compact)


def test_copy_alone_and_stop_strings_per_row():
    target = tiny_target("llama")
    ids, mask = left_padded(lengths=(6, 6, 3), seed=7)
    ids[0, :] = torch.tensor([5, 6, 7, 5, 6, 7])  # a repetitive prompt the copy source can follow
    plain = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    ref = target.generate(ids, **plain)
    out = target.generate(ids, draft_sources="copy", **plain)
    assert torch.equal(out, ref)
    # copy branches draft in a batch without a drafter (a batch's plan for its drafter's rounds once rested them)
    assert eagle_hf.last_stats().drafted_by_source.get("copy", 0) > 0


def test_stopping_criteria_cut_each_row_where_plain_decoding_stops():
    from transformers import StoppingCriteria, StoppingCriteriaList

    class EndsWith(StoppingCriteria):
        def __init__(self, token):
            self.token = token

        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == self.token

    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids, mask = left_padded(seed=11)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    stop = int(free[2, ids.shape[1] + 4])
    # plain generate() pads a stopped row only when an EOS is set (without one it keeps decoding it); we always pad
    plain = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=95)
    ref = target.generate(ids, stopping_criteria=StoppingCriteriaList([EndsWith(stop)]), **plain)
    with batch_oracle(truths_of(ids, mask, free)):
        out = target.generate(ids, assistant_model=drafter, stopping_criteria=StoppingCriteriaList([EndsWith(stop)]),
                              **plain, **MODES["tree"])
    assert torch.equal(out, ref)


def test_num_return_sequences_runs_as_a_batch_and_listeners_get_the_row():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids, mask = left_padded(lengths=(4, 7), seed=2)
    rows_seen = set()
    sample = dict(do_sample=True, top_k=1)  # num_return_sequences needs sampling; top-k 1 makes it greedy

    def listener(drafts, accepted, last_token, row):
        rows_seen.add(row)

    out = target.generate(ids, attention_mask=mask, max_new_tokens=8, num_return_sequences=3, **sample,
                          assistant_model=drafter, draft_listeners=[listener], return_dict_in_generate=True,
                          output_scores=True)
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=8, num_return_sequences=3, **sample)
    assert torch.equal(out.sequences, ref)
    assert rows_seen == set(range(6))
    assert len(out.scores) == 8 and out.scores[0].shape == (6, 96)
    assert len(eagle_hf.last_stats().per_row) == 6


# ---------------------------------------------------------------------------------------------- sampling
VOCAB = 12
ALPHA = 1e-3


def test_batch_sampling_is_lossless_per_row():
    """Two prompts of different lengths (one left-padded), 400 samples each of the first two new tokens, drawn
    as rows of batches; each row's pairs fit the target's exact distribution for its prompt."""
    from test_sampling import chi_square, exact_distribution

    target = tiny_target("llama", vocab=VOCAB)
    with torch.no_grad():
        target.model.norm.weight.mul_(6.0)
    drafter = tiny_drafter(target)
    ids = torch.tensor([[0, 0, 3, 7], [4, 1, 9, 2]])
    mask = (torch.arange(4) >= torch.tensor([[2], [0]])).long()
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(6)])
    torch.manual_seed(99)
    rows = {0: [], 1: []}
    for _ in range(8):  # 8 calls x 2 prompts x 50 sequences
        out = target.generate(ids, attention_mask=mask, do_sample=True, temperature=0.9, top_k=6, max_new_tokens=3,
                              num_return_sequences=50, assistant_model=drafter, draft_mode="tree", tree_depth=2,
                              tree_top_k=2, tree_total_tokens=5, num_assistant_tokens_schedule="constant")
        for r in range(out.shape[0]):
            rows[r // 50].append(tuple(out[r, 4:].tolist()))
    for b in (0, 1):
        prompt = ids[b : b + 1][:, mask[b].bool()]
        dist = exact_distribution(target, processors, 2, prompt=prompt)
        assert chi_square(rows[b], dist, (0, 1)) > ALPHA, b


# ---------------------------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def pair():
    target = tiny_target("llama")
    return target, tiny_drafter(target)


def test_right_padding_is_refused_with_the_fix(pair):
    target, drafter = pair
    ids, mask = left_padded(lengths=(3, 5))
    right = torch.stack([torch.roll(m, -int((m == 0).sum())) for m in mask])
    with pytest.raises(EagleCompatibilityError, match="right-padded.*padding_side='left'"):
        target.generate(ids, attention_mask=right, assistant_model=drafter, max_new_tokens=4)


def test_padding_without_attention_mask_is_refused(pair):
    target, drafter = pair
    ids, _ = left_padded(lengths=(3, 5))
    with pytest.raises(EagleCompatibilityError, match="no attention_mask"):
        target.generate(ids, assistant_model=drafter, max_new_tokens=4, pad_token_id=0)


def test_a_list_of_prompts_is_refused_with_the_fix(pair):
    target, drafter = pair
    with pytest.raises(EagleCompatibilityError, match="left-padded tensor"):
        target.generate([[1, 2, 3], [4, 5]], assistant_model=drafter, max_new_tokens=4)


@pytest.mark.parametrize("option", ["output_hidden_states", "streamer"])
def test_batch_options_without_a_per_row_meaning_are_refused(pair, option):
    target, drafter = pair
    ids, mask = left_padded(lengths=(3, 5))
    value = True if option == "output_hidden_states" else object()
    kwargs = dict(return_dict_in_generate=True) if option == "output_hidden_states" else {}
    with pytest.raises(EagleCompatibilityError, match="once per prompt"):
        target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4, **{option: value}, **kwargs)


# ------------------------------------------------------------------------------------------------ batched drafter
def _taps(target, drafter, lengths, seed):
    """Each row's target taps [1, n, A] and the token after each [1, n], for rows of the given lengths."""
    from eagle_hf.drafter.capture import gather_aux
    from eagle_hf.hf import check_compatible

    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(1, 96, (1, n + 1), generator=g).to(target.device)
        out = target(ids, output_hidden_states=True)
        rows.append((gather_aux(out.hidden_states, check_compatible(target, drafter))[:, :-1], ids[:, 1:]))
    return rows


def _padded(rows):
    width = max(t.shape[1] for _, t in rows)
    device = rows[0][0].device
    aux = torch.zeros(len(rows), width, rows[0][0].shape[-1], device=device)
    tokens = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    for b, (a, t) in enumerate(rows):
        aux[b, : t.shape[1]], tokens[b, : t.shape[1]] = a[0], t[0]
    return aux, tokens, [t.shape[1] for _, t in rows]


@pytest.mark.parametrize("top_k", [1, 3])
def test_batched_drafting_grows_each_rows_tree_as_drafted_alone(top_k):
    """Rows of different lengths catch up in one padded drafter forward and grow their trees together (holes in
    the drafter's cache, padded frontiers): every tree equals the row's drafted alone, over two rounds."""
    from reference_growth import device_trees

    from eagle_hf.speculation.drafting import DraftState, draft_tree

    target, drafter = tiny_target("llama"), None
    drafter = tiny_drafter(target, seed=3)
    drafter.bind_target_embedding(target.get_input_embeddings())
    with torch.no_grad():
        drafter.lm_head.weight.mul_(30.0)  # peaky: confident drafts, so trees reach their depth
    rounds = [_taps(target, drafter, [9, 4, 6], seed=1), _taps(target, drafter, [1, 3, 2], seed=2)]
    alone = [DraftState.for_drafter(drafter) for _ in range(3)]
    batch = DraftState.for_drafter(drafter, 3)
    for taps in rounds:
        roots = [int(t[0, -1]) for _, t in taps]
        logits, hidden = batch.extend(drafter, *_padded(taps))
        trees = device_trees(drafter, batch, roots, logits, hidden, [4, 4, 3], top_k, [8, 8, 8])
        for b, (a, t) in enumerate(taps):
            own_logits, own_hidden = alone[b].extend(drafter, a, t)
            torch.testing.assert_close(logits[b : b + 1], own_logits, rtol=1e-4, atol=1e-4)
            mine = draft_tree(drafter, alone[b], roots[b], own_logits, own_hidden, [4, 4, 3][b], top_k, 8)
            assert trees[b].tokens.tolist() == mine.tokens.tolist()
            assert trees[b].parents.tolist() == mine.parents.tolist()
            torch.testing.assert_close(trees[b].scores, mine.scores, rtol=1e-4, atol=1e-4)
    assert batch.valid is not None and batch.positions == [a.positions[0] for a in alone]


def test_a_long_catch_up_in_chunks_equals_one_pass(monkeypatch):
    """A long prompt's catch-up runs `CATCH_UP_CHUNK` rows per drafter forward (a bounded peak: ~0.7 GiB less at
    8k tokens on an 8B shape): rows ending inside a chunk, on its boundary and in the last one get the logits,
    hidden state and cache of one pass, and draft the same trees over two rounds."""
    from reference_growth import device_trees

    from eagle_hf.speculation import drafting
    from eagle_hf.speculation.drafting import DraftState

    target = tiny_target("llama")
    drafter = tiny_drafter(target, seed=3)
    drafter.bind_target_embedding(target.get_input_embeddings())
    with torch.no_grad():
        drafter.lm_head.weight.mul_(30.0)  # peaky: confident drafts, so trees reach their depth
    rounds = [_taps(target, drafter, [11, 4, 6], seed=1), _taps(target, drafter, [1, 3, 2], seed=2)]
    states, steps = {}, []
    original = type(drafter).step
    monkeypatch.setattr(type(drafter), "step", lambda self, hidden, *a, **k: (steps.append(hidden.shape[1]),
                                                                             original(self, hidden, *a, **k))[1])
    for chunk in (4, drafting.CATCH_UP_CHUNK):
        monkeypatch.setattr(drafting, "CATCH_UP_CHUNK", chunk)
        state, trees = DraftState.for_drafter(drafter, 3), []
        for taps in rounds:
            logits, hidden = state.extend(drafter, *_padded(taps))
            roots = [int(t[0, -1]) for _, t in taps]
            trees.append((logits, hidden, device_trees(drafter, state, roots, logits, hidden, [4, 4, 3], 3, [8] * 3)))
        states[chunk] = (state, trees)
    (chunked, a), (_, b) = states.values()
    assert steps[:3] == [4, 4, 3]  # the first prompt: three chunks (11 rows)
    for (la, ha, ta), (lb, hb, tb) in zip(a, b):
        torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ha, hb, rtol=1e-4, atol=1e-4)
        assert [t.tokens.tolist() for t in ta] == [t.tokens.tolist() for t in tb]
        assert [t.parents.tolist() for t in ta] == [t.parents.tolist() for t in tb]
    assert chunked.positions == states[drafting.CATCH_UP_CHUNK][0].positions


@pytest.mark.parametrize("mode", ["tree", "chain"])
@pytest.mark.parametrize("programs", ["off", "on"])
def test_generate_with_chunked_prompt_catch_ups_is_unchanged(monkeypatch, mode, programs):
    """Prompts longer than `CATCH_UP_CHUNK` (patched to 5 here): a left-padded batch and one row give plain
    output and draft exactly as with one pass (same accepted counts), with fixed-shape drafting too (a prompt's
    last short chunk is not a round's catch-up)."""
    from eagle_hf.speculation import drafting

    monkeypatch.setenv("EAGLE_HF_DRAFTER_GRAPHS", programs)
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids, mask = left_padded()
    plain = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    ref = target.generate(ids, **plain)
    runs = []
    for chunk in (drafting.CATCH_UP_CHUNK, 5):
        monkeypatch.setattr(drafting, "CATCH_UP_CHUNK", chunk)
        for rows in (slice(None), slice(0, 1)):
            out = target.generate(ids[rows], assistant_model=drafter, **dict(plain, attention_mask=mask[rows]),
                                  **MODES[mode])
            assert torch.equal(out, ref[rows]), (chunk, rows)
            runs.append(eagle_hf.last_stats().accepted)
    assert runs[:2] == runs[2:]


def test_a_chunked_prompt_keeps_the_drafters_dtype_with_fixed_shape_drafting(monkeypatch):
    """A bf16 prompt one token longer than a chunk, with fixed-shape drafting (as on a GPU): the last short chunk
    runs eagerly like the others, so the row's logits keep one dtype (it once took the programs' float32 buffer
    and failed to merge)."""
    from eagle_hf.speculation import drafting

    monkeypatch.setenv("EAGLE_HF_DRAFTER_GRAPHS", "on")
    chunk = drafting.FIXED_CATCH_UP + 4  # a first chunk too long for the programs, a last one short enough
    monkeypatch.setattr(drafting, "CATCH_UP_CHUNK", chunk)
    target = tiny_target("llama").to(torch.bfloat16)
    drafter = tiny_drafter(target).to(torch.bfloat16)
    ids = torch.randint(3, 96, (1, chunk + 1), generator=torch.Generator().manual_seed(0))  # (the vocabulary: 96)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, chunk + 7)
    assert eagle_hf.last_stats().cycles > 0


def test_the_batch_drafts_with_one_drafter_forward_per_level(monkeypatch):
    """A batch of 4 rows: one catch-up forward and one forward per level in each drafting round, not one per row."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    calls = []
    original = type(drafter).step
    monkeypatch.setattr(type(drafter), "step", lambda self, hidden, *a, **k: (calls.append(hidden.shape[0]),
                                                                             original(self, hidden, *a, **k))[1])
    ids, mask = left_padded([5, 9, 3, 7], seed=4)
    target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=12,
                    draft_mode="tree", tree_depth=3, tree_top_k=2, tree_total_tokens=6,
                    num_assistant_tokens_schedule="constant")
    rounds = max(r.cycles + r.fallback_steps + r.final_steps for r in eagle_hf.last_stats().per_row)
    assert calls[:3] == [4, 4, 4]  # the first round: the prompts' catch-up, then 2 levels, for all 4 rows
    assert len(calls) <= 3 * rounds  # not 3 per row


@pytest.mark.cpu_only  # on a GPU a round's timings reach the schedule one round late: these events interleave
def test_rounds_that_catch_the_drafter_up_do_not_teach_the_controller_their_catch_up(monkeypatch):
    """The first drafting round reads the prompts, a retry after plain rounds reads their rows: neither is a regular
    drafting round. Timing one as a plain round once made drafting look cheap next to plain decoding; left out of
    the batch's timed drafting rounds, a resting drafter's retries taught it nothing. Such a round teaches the
    batch's timed rounds as the regular round it would have been (its catch-up's time replaced by a regular one's),
    never the loop's cost model, and counts against the loss budget as it was (what drafting costs)."""
    from eagle_hf.speculation.costs import RoundCosts
    from eagle_hf.speculation.schedule import DraftLengthController, LossBudget

    events = []
    draft = tree_loop.TreeLoop.draft

    def logged_draft(self, active, batch, marks=None):
        out = draft(self, active, batch, marks)
        events.append("drafter_prefill" if any(r.sp.drafter_prefill for r in active) else "round")
        return out

    monkeypatch.setattr(tree_loop.TreeLoop, "draft", logged_draft)
    plan_of_rounds = iter([2, 2, 0, 0, 2, 2, 0, 2] * 4)  # drafting, plain rounds, then a retry after them
    monkeypatch.setattr(DraftLengthController, "choose", lambda self: next(plan_of_rounds))
    watched = [(LossBudget, "observe_plain"), (LossBudget, "observe_cycle"), (LossBudget, "account"),
               (RoundCosts, "observe_cycle")]
    for owner, name in watched:  # what the batch's verdict and the loop's cost model read
        original, label = getattr(owner, name), f"{owner.__name__}.{name}"
        monkeypatch.setattr(owner, name,
                            lambda self, *a, _o=original, _n=label, **k: (events.append(_n), _o(self, *a, **k))[1])
    target = tiny_target("llama")
    ids, mask = left_padded([5, 9, 3, 7], seed=2)
    target.generate(input_ids=ids, attention_mask=mask, assistant_model=tiny_drafter(target), max_new_tokens=12,
                    do_sample=False, draft_sources="eagle", **MODES["tree adaptive"])  # (copy rounds rest the drafter)
    assert events[0] == "drafter_prefill"
    assert events.count("drafter_prefill") >= 3  # the prompts, then two retries after plain rounds
    rounds = [i for i, e in enumerate(events) if e in ("drafter_prefill", "round")] + [len(events)]
    taught = {tuple(events[a + 1 : b]) for a, b in itertools.pairwise(rounds) if events[a] == "drafter_prefill"}
    assert taught == {("LossBudget.observe_cycle", "LossBudget.account")}
    assert ("LossBudget.observe_cycle", "RoundCosts.observe_cycle", "LossBudget.account") in {
        tuple(events[a + 1 : b]) for a, b in itertools.pairwise(rounds) if events[a] == "round"}
    assert "LossBudget.observe_plain" in events
    assert events.count("LossBudget.account") == events.count("drafter_prefill") + events.count("round")  # every round


def test_the_head_computes_logits_only_for_real_tree_nodes(monkeypatch):
    """Trees padded to the widest: the output head runs on the real nodes alone, the padded ones come out 0, and
    the head is itself again afterwards."""
    from eagle_hf.hf.models import head_on_positions

    target = tiny_target("llama")
    head = target.get_output_embeddings()
    hidden = torch.randn(3, 5, target.config.hidden_size).to(target.device)
    keep = (torch.arange(5) < torch.tensor([5, 2, 1])[:, None]).to(target.device)  # [3, 5]
    seen, linear = [], torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, *a: (seen.append(x.shape[:-1]), linear(x, *a))[1])
    with head_on_positions(target, keep.reshape(-1).nonzero()[:, 0], (3, 5)):  # flat indices of the real nodes
        out = head(hidden)
        other = head(hidden[:, :1])  # another shape: unchanged
    monkeypatch.undo()
    assert seen == [torch.Size([1, 8]), torch.Size([3, 1])]  # the matrix product ran on the 8 real nodes of 15
    full = head(hidden)
    torch.testing.assert_close(out[keep], full[keep])
    assert bool((out[~keep] == 0).all())
    torch.testing.assert_close(other, full[:, :1])
    assert "forward" not in head.__dict__


def test_per_step_outputs_are_kept_only_when_asked_for(monkeypatch):
    """Every step's [1, V] float scores, kept for a return nobody asked for, add up (49k floats per token)."""
    kept = []
    run = tree_loop.TreeLoop.run
    monkeypatch.setattr(tree_loop.TreeLoop, "run", lambda self, *a: (out := run(self, *a), kept.append(out[1]))[0])
    target = tiny_target("llama")
    ids, mask = left_padded([5, 9], seed=1)
    for scores in (False, True):
        out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=tiny_drafter(target),
                              max_new_tokens=6, do_sample=False, output_scores=scores, return_dict_in_generate=True,
                              **MODES["tree"])
        assert (out.scores is not None) == scores
    assert all(not r.emitted.scores and not r.emitted.logits for r in kept[0])
    assert all(len(r.emitted.scores) == 6 for r in kept[1])


def test_the_kept_verify_mask_equals_one_built_from_scratch(monkeypatch):
    """The tree cache keeps the verify mask between rounds (only the new slots' columns and the tree block are
    written, never the whole context): through rounds of commits with holes, a row leaving and a compaction, it
    equals the mask built from the rows' validity every round."""
    from conftest import tree_attention_mask
    from transformers import DynamicCache

    from eagle_hf.hf.cache import TreeCache
    from eagle_hf.hf.version import cache_kwarg
    from eagle_hf.speculation.ragged import Ragged

    monkeypatch.setattr(ragged, "MIN_HOLES_TO_COMPACT", 4)
    monkeypatch.setattr(ragged, "HOLE_FRACTION", 0.1)
    target = tiny_target("llama")
    g = torch.Generator().manual_seed(0)
    rows, prompt = 3, 6
    cache = DynamicCache(config=target.config)
    dev = target.device
    target(torch.randint(1, 96, (rows, prompt), generator=g).to(dev), **cache_kwarg(cache), use_cache=True)
    tc = TreeCache(cache, Ragged([prompt] * rows, prompt))
    compacted = False
    for step in range(24):
        width = int(torch.randint(1, 7, (1,), generator=g))
        b = tc.ragged.rows
        tree = (torch.rand(b, width, width, generator=g).lt(0.5).tril() | torch.eye(width, dtype=torch.bool)).to(dev)
        if width > 1:
            kept = tc.tree_mask(tree, torch.float32)
            assert torch.equal(kept, tree_attention_mask(tree, tc.ragged.valid, tc.length, torch.float32)), step
        past = tc.length
        target(torch.randint(1, 96, (b, width), generator=g).to(dev), **cache_kwarg(cache), use_cache=True,
               attention_mask=kept if width > 1 else tc.padding_mask())
        lengths = [int(torch.randint(1, width + 1, (1,), generator=g)) for _ in range(tc.ragged.rows)]
        k = max(lengths)
        valid = None if all(n == k for n in lengths) else torch.tensor([[i < n for i in range(k)] for n in lengths],
                                                                       device=dev)
        tc.commit(past, None, lengths, valid, dev)
        if step == 6:  # a row leaves
            tc.select_rows([0, 2], torch.tensor([0, 2], device=dev))
        if tc.ragged.worth_compacting():
            tc.compact()
            compacted = True
    assert compacted


def test_the_drafters_kept_level_mask_equals_one_built_from_scratch(monkeypatch):
    """The drafter's level mask is kept between levels and rounds (the new real rows' columns and each level's
    tree block are written, never the whole context): through catch-ups with holes, a row leaving and a compaction,
    it equals the mask built from the rows' validity."""
    from eagle_hf.speculation.drafting import DraftState

    monkeypatch.setattr(ragged, "MIN_HOLES_TO_COMPACT", 2)
    monkeypatch.setattr(ragged, "HOLE_FRACTION", 0.1)
    target = tiny_target("llama")
    drafter = tiny_drafter(target, seed=3)
    drafter.bind_target_embedding(target.get_input_embeddings())
    state = DraftState.for_drafter(drafter, 3)
    g = torch.Generator().manual_seed(0)
    compacted = False
    for step, counts in enumerate([[1, 4, 6], [6, 1, 1], [1, 1, 6], [3, 1, 1], [1, 2, 3], [1, 1, 4]]):
        counts = counts[: state.rows]
        before = state.length
        state.extend(drafter, *_padded(_taps(target, drafter, counts, seed=step)))
        compacted |= state.length < before + max(counts)
        for k, fed in ((2, 0), (3, 2)):
            anc = (torch.rand(state.rows, k, fed + k, generator=g) < 0.5).to(target.device)
            real = state.valid if state.ragged.holes else torch.ones(state.rows, state.length, dtype=torch.bool,
                                                                     device=target.device)
            expected = torch.cat([real[:, None, :].expand(-1, k, -1), anc], 2)[:, None]
            assert torch.equal(state.level_mask(anc, k, fed), expected), (step, k)
        if step == 3:
            state.select([0, 2])
    assert compacted


def test_a_row_done_at_its_first_token_leaves_the_drafter_s_empty_cache(graphs_on_the_cpu):
    """A row whose first token ends it leaves the batch before the drafter has read any row: the drafter's cache,
    still empty, keeps the other rows. Its storage comes from the fixed-shape levels', which rounds an empty
    cache's room up (a random soak of greedy equality found it crashing where plain generate() runs)."""
    target = tiny_target("llama", layers=2)
    drafter = tiny_drafter(target)
    for seed in range(50):  # two prompts whose first new tokens differ, the second row's in no later step of the first
        ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(seed))
        first = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)[:, 6:]
        if first[0, 0] != first[1, 0] and int(first[1, 0]) not in first[0].tolist():
            break
    run = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, eos_token_id=int(first[1, 0]))
    expected = target.generate(ids, **run)
    assert torch.equal(target.generate(ids, assistant_model=drafter, **run), expected)
