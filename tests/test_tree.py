"""Tree mode: hand-computed tree tensors, greedy equality, KV compaction, lossless sampling over trees."""

from unittest import mock

import pytest
import torch
from conftest import patch_drafts, tiny_drafter, tiny_target, tree_attention_mask
from reference_acceptance import accept_sampling, verify

import eagle_hf
from eagle_hf.hf.version import cache_kwarg, output_cache
from eagle_hf.speculation.drafting import TreeRequest, laid_out, with_copies
from eagle_hf.speculation.tree import DraftTree, accept_greedy, accept_paths

#      0 (root)
#     / \
#    1   2
#   / \   \
#  3   4   5
#  |
#  6
TREE = DraftTree(tokens=torch.tensor([10, 11, 12, 13, 14, 15, 16]), parents=torch.tensor([-1, 0, 0, 1, 1, 2, 3]),
                 scores=torch.tensor([0.0, -0.1, -0.5, -0.3, -0.9, -0.8, -0.6]))


def test_tree_tensors_by_hand():
    assert TREE.depths().tolist() == [0, 1, 1, 2, 2, 2, 3]
    ancestors = laid_out([TREE], 7, [3], "cpu")[0].ancestors[0]  # [7, 7] node i sees node j
    assert ancestors.int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ]
    assert TREE.retrieve_indices().tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]
    mask = tree_attention_mask(ancestors[None], None, 3, dtype=torch.float32)
    assert mask.shape == (1, 1, 7, 10)
    assert (mask[0, 0, :, :3] == 0).all()  # the prefix is visible to every node
    assert ((mask[0, 0, :, 3:] == 0) == ancestors).all()


def test_batched_tree_mask_hides_holes_and_padding_nodes():
    """Two rows: a hole in row 1's cache, and row 1's one-node tree padded to the other row's 7 nodes (the layout
    the verify reads: `laid_out`)."""
    valid = torch.tensor([[True, True, True], [True, False, True]])
    root_only = DraftTree.root(5)
    ancestors = laid_out([TREE, root_only], 7, [3, 2], "cpu")[0].ancestors
    mask = tree_attention_mask(ancestors, valid, 3, dtype=torch.float32) == 0  # [2, 1, 7, 10] visible
    assert mask.shape == (2, 1, 7, 10)
    assert (mask[1, 0, :, :3] == valid[1]).all()  # the hole is hidden from every node of row 1
    assert mask[1, 0, 0, 3:].tolist() == [True] + [False] * 6  # the root sees itself
    assert (mask[1, 0, 1:, 4:] == torch.eye(6, dtype=torch.bool)).all()  # padding nodes: themselves ...
    assert mask[1, 0, 1:, 3].all()  # ... and the root


def _with_copies(laid, positions, copies, roots, width, first=None):
    """`with_copies` over the host's copy rows (`TreeRequest.copy_rows`), as a round lays them out: the layout
    and its verify positions."""
    request = TreeRequest(laid.tokens.shape[1], roots, [0] * len(roots), [1] * len(roots), copies, width)
    tokens, bits, _ = request.copy_rows()
    rows = len(roots)
    layout = with_copies(laid, torch.tensor(tokens).view(rows, width), torch.tensor(bits).view(rows, width, -1),
                         None if first is None else torch.tensor(first))
    return layout, positions[:, :1] + layout.depths


def test_copy_branches_are_laid_out_after_the_drafters_nodes():
    """A drafter's chain (root 7, then 1 and 2) and the copy branches [3, 4] and [5] beside it, in 4 columns (one a
    padding node): each copy node sees the root, its own ancestors and itself, never a drafter node."""
    chain = DraftTree.of_lists([7, 1, 2], [-1, 0, 1], [0.0, -0.1, -0.2])
    copies = DraftTree.of_lists([7, 3, 4, 5], [-1, 0, 1, 0], [0.0, -0.1, -0.2, -0.3])
    laid, positions = laid_out([chain], 3, [10], "cpu")
    layout, positions = _with_copies(laid, positions, [copies], [7], 4)
    assert layout.tokens.tolist() == [[7, 1, 2, 3, 4, 5, 7]]
    assert layout.depths.tolist() == [[0, 1, 2, 1, 2, 1, 0]]
    assert positions.tolist() == [[10, 11, 12, 11, 12, 11, 10]]
    assert layout.ancestors.int().tolist() == [[
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 0, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 1, 0, 0],
        [1, 0, 0, 0, 0, 1, 0],
        [1, 0, 0, 0, 0, 0, 1],
    ]]
    layout, _ = _with_copies(laid, positions, [None], [7], 2)  # a row without copies
    assert layout.tokens.tolist() == [[7, 1, 2, 7, 7]] and layout.depths.tolist() == [[0, 1, 2, 0, 0]]
    assert layout.ancestors[0, 3:].int().tolist() == [[1, 0, 0, 1, 0], [1, 0, 0, 0, 1]]  # padding: root, itself


def test_copy_branches_are_laid_out_first_where_the_row_says():
    """Row 0 puts its copy branches right after the root, row 1 after its drafter's nodes: each is the other's
    layout with its columns reordered, and the host's tree of the row (`_beside`) reads its nodes at those columns.
    An accepted copy path is then the first columns: the cache's commit moves nothing."""
    from eagle_hf.speculation.drafting import _beside

    chain = DraftTree.of_lists([7, 1, 2], [-1, 0, 1], [0.0, -0.1, -0.2])
    copies = DraftTree.of_lists([7, 3, 4, 5], [-1, 0, 1, 0], [0.0, -0.1, -0.2, -0.3])
    laid, positions = laid_out([chain, chain], 3, [10, 10], "cpu")
    after, _ = _with_copies(laid, positions, [copies, copies], [7, 7], 4)
    layout, positions = _with_copies(laid, positions, [copies, copies], [7, 7], 4, first=[1, 0])
    assert layout.tokens.tolist() == [[7, 3, 4, 5, 7, 1, 2], [7, 1, 2, 3, 4, 5, 7]]
    assert positions.tolist() == [[10, 11, 12, 11, 10, 11, 12], [10, 11, 12, 11, 12, 11, 10]]
    order = [0, 3, 4, 5, 6, 1, 2]  # row 0's columns: the root, the copy nodes (one a padding node), the chain
    assert torch.equal(layout.ancestors[0], after.ancestors[0][order][:, order])
    assert torch.equal(layout.ancestors[1], after.ancestors[1])
    tree, columns = _beside([7, 1, 2], [-1, 0, 1], [0.0, -0.1, -0.2], copies, width=3, copy_width=4)
    assert columns == [0, 1, 2, 3, 5, 6]
    assert [layout.tokens[0, c].item() for c in columns] == tree.host.tokens == [7, 3, 4, 5, 1, 2]
    for node, column in enumerate(columns):  # each node sees its ancestors at their columns
        seen = {columns[n] for n in tree.host.path(node)}
        assert {c for c in range(7) if layout.ancestors[0, column, c]} == seen
    assert accept_greedy(tree, [3, 4, 0, 9, 0, 0]) == [0, 1, 2]  # the copy path 3, 4: columns 0, 1, 2
    tree, columns = _beside([7, 3, 8], [-1, 0, 1], [0.0, -0.1, -0.2], copies, width=3, copy_width=4)
    assert accept_greedy(tree, [3, 9, 0, 0, 9, 0]) == [0, 1]  # drafted by both: the copy's node, column 1


def test_copy_branches_of_more_than_one_words_bits_are_laid_out_as_the_host_lays_out_a_tree():
    """Copy trees of 70 and 5 nodes (a row's ancestor bits take two 63-bit words) beside two rows' chains: each
    copy node's ancestors and depth are those of the copy tree laid out alone (`laid_out`, the host's layout)."""
    gen = torch.Generator().manual_seed(0)
    parents = [-1, 0] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(2, 71)]
    big = DraftTree.of_lists(list(range(100, 171)), parents, [0.0] * 71)
    small = DraftTree.of_lists([8, 1, 2, 3, 4, 5], [-1, 0, 1, 0, 3, 4], [0.0] * 6)
    chains = [DraftTree.of_lists([100, 1, 2], [-1, 0, 1], [0.0] * 3), DraftTree.of_lists([8, 1], [-1, 0], [0.0] * 2)]
    laid, positions = laid_out(chains, 3, [10, 20], "cpu")
    layout, positions = _with_copies(laid, positions, [big, small], [100, 8], 72)
    for b, copy in enumerate([big, small]):
        alone = laid_out([copy], 73, [0], "cpu")[0]  # root, the copy nodes, padding nodes
        assert layout.tokens[b, 3:].tolist() == alone.tokens[0, 1:].tolist()
        assert layout.depths[b, 3:].tolist() == alone.depths[0, 1:].tolist()
        assert torch.equal(layout.ancestors[b, 3:, 3:], alone.ancestors[0, 1:, 1:])
        assert layout.ancestors[b, 3:, 0].all() and not layout.ancestors[b, 3:, 1:3].any()
        assert positions[b, 3:].tolist() == [[10, 20][b] + d for d in alone.depths[0, 1:].tolist()]


def test_greedy_acceptance_takes_the_longest_matching_path():
    # target's choice after each node: after root -> 11 (node 1), after 1 -> 13 (node 3), after 3 -> 99 (no child)
    target_tokens = torch.tensor([11, 13, 0, 16, 0, 0, 0])
    assert accept_greedy(TREE, target_tokens) == [0, 1, 3, 6]
    assert accept_greedy(TREE, torch.tensor([12, 0, 15, 0, 0, 0, 0])) == [0, 2, 5]
    assert accept_greedy(TREE, torch.tensor([99, 0, 0, 0, 0, 0, 0])) == [0]


def test_greedy_acceptance_from_a_row_or_from_a_batch_layout_agree():
    """`accept_paths` reads a row's own values (the target's token after each node) or a batch's layout (`width`
    values a row, each node at its column): the path and bonus of the reference's acceptance from the logits, and
    a plain step accepts its root alone."""
    logits = torch.randn(7, 20, generator=torch.Generator().manual_seed(1))
    logits[0, 11], logits[1, 13], logits[3, 16], logits[6, 4] = 9.0, 9.0, 9.0, 9.0  # the path 0-1-3-6, bonus 4
    chosen = logits.argmax(-1).tolist()
    assert verify(TREE, logits, do_sample=False) == ([0, 1, 3, 6], 4)
    assert accept_paths([TREE], chosen, sampled=False) == [([0, 1, 3, 6], 4)]
    batch = [8] + [0] * 7 + [chosen[0], -1, *chosen[1:]]  # width 8: a root alone, then TREE after a padding column
    assert accept_paths([DraftTree.root(5), TREE], batch, sampled=False, width=8,
                        columns=[[0], [0, 2, 3, 4, 5, 6, 7]]) == [([0], 8), ([0, 1, 3, 6], 4)]


def test_tree_sampling_acceptance_is_lossless_at_each_node():
    """First emitted token ~ P(root) and the second ~ P(node 1) given the first is 11, whatever the tree."""
    scipy_stats = pytest.importorskip("scipy.stats")
    vocab = 20
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(7, vocab, generator=g) * 2, -1)
    tree = DraftTree(tokens=torch.tensor([0, 11, 12, 13, 14, 15, 16]), parents=TREE.parents, scores=TREE.scores)
    n = 6000
    first, second = [], []
    for _ in range(n):
        path, bonus = accept_sampling(tree, probs, generator=g)
        emitted = [int(tree.tokens[i]) for i in path[1:]] + [bonus]
        first.append(emitted[0])
        if emitted[0] == 11 and len(emitted) > 1:
            second.append(emitted[1])
    for sample, p in ((first, probs[0]), (second, probs[1])):
        obs = torch.bincount(torch.tensor(sample), minlength=vocab).double()
        exp = p.double() * len(sample)
        keep = exp >= 5
        o = torch.cat([obs[keep], obs[~keep].sum()[None]])
        e = torch.cat([exp[keep], exp[~keep].sum()[None]])
        assert scipy_stats.chisquare(o.numpy(), e.numpy() * o.sum().item() / e.sum().item()).pvalue > 1e-3


def oracle_tree(truth: list[int]):
    """Patch draft_tree: one branch follows the true greedy continuation (with a wrong token at depth 3),
    a sibling branch is wrong from the start."""

    def fake(position, root_token, depth, total_tokens):
        seq_len = position + 1  # real drafter rows pair features t with token t+1: the root is token `position`
        assert truth[seq_len - 1] == root_token
        cont = truth[seq_len : seq_len + depth]
        if len(cont) >= 3:
            cont = cont[:2] + [(cont[2] + 1) % 96] + cont[3:]
        if not cont:
            return DraftTree(torch.tensor([root_token]), torch.tensor([-1]), torch.zeros(1))
        toks = [root_token, (cont[0] + 7) % 96] + cont  # node 1: a wrong sibling; nodes 2..: the (mostly) true chain
        parents = [-1, 0, 0] + list(range(2, 2 + len(cont) - 1))
        toks, parents = toks[:total_tokens], parents[:total_tokens]
        return DraftTree(torch.tensor(toks), torch.tensor(parents), torch.zeros(len(toks)))

    return patch_drafts(fake)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "qwen2", "mistral_window", "qwen2_window", "gemma3",
                                    "gemma2", "gpt_oss", "llama4", "deepseek_v32"])
def test_tree_mode_greedy_equals_plain_generate(family):
    """Every family's tree verify equals plain decoding; DeepSeek V3.2's indexer picks each node's top 4 keys
    (the 8-token prompts are longer) among the committed slots and its ancestors, and keeps its own keys."""
    target = tiny_target(family)
    for seed, draft_vocab in ((0, None), (1, 48)):
        drafter = tiny_drafter(target, draft_vocab=draft_vocab)
        torch.manual_seed(seed)
        ids = torch.randint(1, 96, (1, 8))
        ref = target.generate(ids, max_new_tokens=32, do_sample=False)
        for schedule in ("constant", "adaptive"):
            out = target.generate(ids, max_new_tokens=32, do_sample=False, assistant_model=drafter, draft_mode="tree",
                                  tree_depth=4, tree_top_k=3, tree_total_tokens=10, num_assistant_tokens_schedule=schedule)
            assert torch.equal(out, ref), schedule
        # with an oracle tree: long accepted paths, same output, and a cache equal to a plain forward's
        truth = ref[0].tolist() + [0] * 8
        with oracle_tree(truth):
            res = target.generate(ids, max_new_tokens=32, do_sample=False, assistant_model=drafter, draft_mode="tree",
                                  tree_depth=5, tree_top_k=2, tree_total_tokens=8, return_dict_in_generate=True,
                                  num_assistant_tokens_schedule="constant")
        assert torch.equal(res.sequences, ref)
        stats = eagle_hf.last_stats()
        assert stats.mean_acceptance_length > 2.0, stats.summary()
        # KV compaction: the returned cache equals a plain forward over the sequence minus its last token
        seq = res.sequences
        from transformers import DynamicCache

        cache = DynamicCache(config=target.config)
        target(seq[:, :-1].to(target.device), **cache_kwarg(cache), use_cache=True)
        for a, b in zip(output_cache(res).layers, cache.layers):
            assert type(a) is type(b)  # transformers' own layers again (they grew in place during the call)
            assert a.keys.shape == b.keys.shape
            assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)
            if hasattr(b, "indexer_keys"):  # (indexed attention: the indexer's key cache, compacted like the keys)
                assert torch.allclose(a.indexer_keys, b.indexer_keys, atol=1e-5)


def test_a_growing_cache_layer_writes_each_forward_in_place_and_holds_what_concatenation_would():
    """`GrowingLayer` (the dynamic cache during a tree call): each update writes its slots into room after the live
    ones, views of one buffer, as a commit crops the cache and a batch row leaves; the live slots always equal
    transformers' concatenation. One copy of the cache per eighth of growth, not one per forward."""
    from transformers.cache_utils import DynamicLayer

    from eagle_hf.hf.cache import GrowingLayer
    from eagle_hf.speculation.ragged import MIN_ROOM

    g = torch.Generator().manual_seed(0)
    layer, ref = GrowingLayer(), DynamicLayer()
    prompt = torch.randn(2, 3, 40, 8, generator=g)
    layer.update(prompt, -prompt)
    ref.update(prompt, -prompt)
    buffers, batch = set(), 2
    for step in range(150):
        new = torch.randn(batch, 3, 1 + step % 7, 8, generator=g)  # [B, H, N, D] a verify forward's nodes
        keys, values = layer.update(new, -new)
        ref.update(new, -new)
        assert keys is layer.keys and torch.equal(keys, ref.keys) and torch.equal(values, ref.values)
        buffers.add(keys._base.data_ptr())
        keep = step % 3  # a commit: the last nodes rejected, the cache cropped to a view
        if keep:
            layer.keys, layer.values = layer.keys[:, :, :-keep], layer.values[:, :, :-keep]
            ref.crop(-keep)
        if step == 20:  # a batch row leaves: new tensors, a new buffer at the next write
            rows = torch.tensor([1])
            layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)
            ref.batch_select_indices(rows)
            batch = 1
    grown = layer.keys.shape[2] - 40
    assert grown > 4 * MIN_ROOM  # it grew well past the first buffer's room
    assert len(buffers) <= 3 + grown // MIN_ROOM, len(buffers)  # a copy per MIN_ROOM (or an eighth) of growth


def test_a_growing_layer_writes_only_into_its_own_buffers_and_keeps_to_its_limit():
    """A cache passed in (say the one an earlier call returned, views of a buffer with room) is copied once, never
    written in place; the room stops at the call's slot limit; a cache without layers yet (`DynamicCache()`
    without a config) gets growing layers from the prefill on; the call's end gives transformers' layers back."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from eagle_hf.hf.cache import GrowingLayer, grow_in_place, stop_growing_in_place

    foreign = torch.randn(1, 3, 100, 8)  # [B, H, capacity, D] someone else's buffer
    kept = foreign.clone()
    layer = GrowingLayer()
    layer.is_initialized, layer.keys, layer.values = True, foreign[:, :, :50], foreign[:, :, :50]
    layer.slot_limit = 60
    new = torch.randn(1, 3, 4, 8)
    keys, _ = layer.update(new, new)
    assert torch.equal(foreign, kept)  # the earlier buffer untouched
    assert torch.equal(keys, torch.cat([kept[:, :, :50], new], dim=2))
    assert keys._base.shape[2] == 60  # the room ends at the limit
    keys, _ = layer.update(new, new)
    assert keys._base.shape[2] == 60 and torch.equal(keys[:, :, 54:], new)  # its own buffer: written in place

    cache = DynamicCache()
    grow_in_place(cache, slot_limit=None)
    cache.update(torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8), 0)
    cache.update(torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8), 0)
    assert type(cache.layers[0]) is GrowingLayer and cache.layers[0].keys._base is not None
    stop_growing_in_place(cache)
    assert type(cache.layers[0]) is DynamicLayer and cache.layer_class_to_replicate is DynamicLayer
    assert "_buffers" not in cache.layers[0].__dict__


def unmaskable_target():
    """A stand-in for a target whose layers a tree cannot keep exact (every layout of the tests' families keeps
    the tree): DeepSeek V3.2 relabelled as a model whose indexer eagle_hf has not checked (`eagle_hf.hf.indexed`:
    such indexers keep the chain fallback). Its attention is DeepSeek V3.2's, so the chain decodes it exactly."""
    target = tiny_target("deepseek_v32", layers=2)
    target.config.model_type = "unchecked_indexer"
    return target


def padded_pair(seed: int, length: int, padding: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two random prompts [2, length], the second left-padded by `padding` tokens, and their attention mask."""
    torch.manual_seed(seed)
    ids = torch.randint(1, 96, (2, length))
    mask = torch.ones_like(ids)
    ids[1, :padding], mask[1, :padding] = 0, 0
    return ids, mask


@pytest.mark.parametrize("family", ["qwen2_window", "gemma3"])
def test_sliding_window_layers_keep_the_tree_in_a_batch(family):
    """Rows of different lengths (left padding, then holes where their accepted paths differ): each layer's
    window counts a row's tokens, not its slots; plain steps with holes get the windowed masks too."""
    target = tiny_target(family)
    drafter = tiny_drafter(target)
    ids, mask = padded_pair(seed=3, length=14, padding=5)
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
    for mode in (dict(draft_mode="tree", tree_depth=4, tree_top_k=3, tree_total_tokens=10,
                      num_assistant_tokens_schedule="constant"), {}):
        out = target.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, assistant_model=drafter,
                              **mode)
        assert torch.equal(out, ref), mode
        assert eagle_hf.last_stats().cycles > 0


def test_window_masks_hide_keys_by_position():
    from eagle_hf.hf.cache import Window, key_positions, window_masks

    valid = torch.tensor([[True, True, True, True], [False, True, False, True]])  # row 1: two holes
    keys = torch.cat([key_positions(valid, 2, 4, "cpu"), torch.tensor([[4, 5], [2, 3]])], 1)  # [B, L + N]
    assert keys[1, [1, 3, 4, 5]].tolist() == [0, 1, 2, 3]  # (its real slots hold tokens 0 and 1, then nodes 2, 3)
    mask = torch.zeros(2, 1, 2, 6)
    out = window_masks(mask, {"full_attention": None, "sliding_attention": Window(3)}, keys, torch.tensor([[4, 5], [2, 3]]))
    assert out["full_attention"] is mask
    hidden = out["sliding_attention"][:, 0] < 0  # [B, N, L + N]
    assert hidden[0].tolist() == [[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]]  # position 5 reads 3, 4, 5
    assert hidden[1, 1].tolist() == [1, 1, 1, 0, 0, 0]  # position 3 reads 1, 2, 3: token 0 (slot 1) is out, and
    # the holes (slots 0 and 2: the tree mask hides them anyway)
    assert window_masks(mask, {"": Window(3)}, keys, torch.tensor([[4, 5], [2, 3]])).shape == mask.shape
    chunks = window_masks(mask, {"chunked_attention": Window(4, chunked=True)}, keys, torch.tensor([[4, 5], [2, 3]]))
    assert (chunks["chunked_attention"][:, 0] < 0)[0].tolist() == [[1, 1, 1, 1, 0, 0]] * 2  # chunk 1: 4, 5
    assert (chunks["chunked_attention"][:, 0] < 0)[1].tolist() == [[1, 0, 0, 0, 0, 0]] * 2  # chunk 0 (the hole
    # before its first token counts as position -1)


def test_layer_windows_by_layer_type():
    from types import SimpleNamespace

    from eagle_hf.hf.cache import Window, layer_windows, windows_unsupported_reason

    assert layer_windows(tiny_target("llama4", layers=4)) == {"chunked_attention": Window(8, chunked=True),
                                                             "full_attention": None}
    assert layer_windows(tiny_target("mistral_window", layers=2)) == {"": Window(8)}
    assert layer_windows(tiny_target("llama", layers=2)) is None
    text = SimpleNamespace(layer_types=["full_attention", "linear_attention"], sliding_window=None)
    odd = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text))
    assert "linear_attention layers cannot take a tree mask" in windows_unsupported_reason(odd)
    assert windows_unsupported_reason(tiny_target("llama4", layers=4)) is None


def test_unmaskable_layers_fall_back_to_chain(caplog):
    target = unmaskable_target()
    drafter = tiny_drafter(target)
    ids = torch.randint(1, 96, (1, 6))
    with caplog.at_level("WARNING", logger="eagle_hf"):
        out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=drafter, draft_mode="tree")
    assert "falling back to chain" in caplog.text
    assert "select keys with an indexer that eagle_hf has not checked" in caplog.text  # (the warning says why)
    assert torch.equal(out, target.generate(ids, max_new_tokens=20, do_sample=False))


def test_indexed_layers_keep_the_tree_where_the_indexer_is_checked():
    """DeepSeek V3.2's indexed layers read the whole context under the tree mask (its indexer selects among the
    keys the mask lets through); an indexer eagle_hf has not checked (one scoring compressed blocks of keys)
    keeps the chain fallback, and says so."""
    from types import SimpleNamespace

    from eagle_hf.hf.cache import layer_windows
    from eagle_hf.hf.indexed import indexed_unsupported_reason
    from eagle_hf.hf.routing import unsupported_reason

    target = tiny_target("deepseek_v32", layers=2)
    assert layer_windows(target) == {"indexed_attention": None}
    assert unsupported_reason(target, {}) is None
    text = SimpleNamespace(layer_types=["indexed_attention"], model_type="qwen4_exp")
    other = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text))
    assert "(qwen4_exp) select keys with an indexer that eagle_hf has not checked" in indexed_unsupported_reason(other)


def test_route_returns_the_settings_it_chose_and_leaves_the_callers_alone():
    """`route` settles the settings a call's loop runs with as a new object: a batch's chain runs in eagle_hf's
    loop as a tree with top_k 1, a tree of size -1 gets its size from the costs, and the settings asked for stay
    as they were."""
    from eagle_hf.hf.routing import route

    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids = torch.ones(2, 4, dtype=torch.long)
    for asked, mode, top_k in [(eagle_hf.DraftSettings(mode="chain"), "tree", 1),
                               (eagle_hf.DraftSettings(mode="tree", total_tokens=-1), "tree", None)]:
        before = asked.to_dict()
        chosen = route(target, drafter, asked, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        assert chosen.loop == "eagle_hf" and chosen.settings.mode == mode and chosen.settings.total_tokens > 0
        assert top_k is None or chosen.settings.top_k == top_k
        assert asked.to_dict() == before and chosen.settings is not asked


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("qwen2_window", {"sliding_window": 3})])
def test_tree_mode_sampling_is_lossless(family, overrides):
    """The tree's rejection sampling draws plain decoding's distribution; on sliding windows of 3 too (the
    4-token prompt and the 3 tokens after it cross them)."""
    from test_sampling import PROMPT, VOCAB, chi_square, exact_distribution, marginal
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

    target = tiny_target(family, vocab=VOCAB, **overrides)
    with torch.no_grad():
        target.model.norm.weight.mul_(6.0)
    drafter = tiny_drafter(target)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(7)
    rows, accepted = [], 0
    try:
        for _ in range(1200):
            out = target.generate(PROMPT, assistant_model=drafter, do_sample=True, temperature=0.9, top_k=6,
                                  max_new_tokens=4, draft_mode="tree", tree_depth=3, tree_top_k=2, tree_total_tokens=6,
                                  num_assistant_tokens_schedule="constant")
            rows.append(tuple(out[0, PROMPT.shape[1]:].tolist()))
            accepted += eagle_hf.last_stats().accepted
    finally:
        torch.set_num_threads(threads)
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(6)])
    exact = exact_distribution(target, processors, 3)
    assert accepted > 100  # drafts were accepted: the tree path is exercised
    assert chi_square(rows, marginal(exact, (0, 1)), (0, 1)) > 1e-3
    assert chi_square(rows, marginal(exact, (1, 2)), (1, 2)) > 1e-3


def test_custom_generate_folder_and_callable(tmp_path):
    import importlib.metadata

    from eagle_hf import write_custom_generate

    try:  # the folder's requirements.txt names eagle-hf, which transformers checks against installed packages
        importlib.metadata.distribution("eagle-hf")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("eagle-hf is imported from a path, not installed (as on the lent GPU machine)")

    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids = torch.randint(1, 96, (1, 6))
    ref = target.generate(ids, max_new_tokens=20, do_sample=False)
    folder = write_custom_generate(tmp_path / "repo")
    out = target.generate(ids, custom_generate=folder, trust_remote_code=True, drafter=drafter, max_new_tokens=20,
                          do_sample=False, tree_depth=3, tree_top_k=2, tree_total_tokens=6,
                          num_assistant_tokens_schedule="constant")  # drafts every round, however busy the machine
    assert torch.equal(out, ref)
    assert eagle_hf.last_stats().cycles > 0
    # the drafter can also be given as a folder
    drafter.save_pretrained(tmp_path / "drafter")
    out = target.generate(ids, custom_generate=folder, trust_remote_code=True, drafter=str(tmp_path / "drafter"),
                          max_new_tokens=20, do_sample=False, draft_mode="chain")
    assert torch.equal(out, ref)


def test_confidence_threshold_prunes_tree_branches():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids = torch.randint(1, 96, (1, 6))
    ref = target.generate(ids, max_new_tokens=24, do_sample=False)
    fixed = dict(draft_mode="tree", tree_depth=4, tree_top_k=3, tree_total_tokens=10,
                 num_assistant_tokens_schedule="constant", draft_sources="eagle")  # the drafter's threshold alone
    out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter, **fixed)
    full = eagle_hf.last_stats()
    out_pruned = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                                 assistant_confidence_threshold=0.02, **fixed)
    pruned = eagle_hf.last_stats()
    assert torch.equal(out, ref) and torch.equal(out_pruned, ref)
    assert pruned.drafted < full.drafted  # a random drafter is rarely confident: most branches go
    out_none = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                               assistant_confidence_threshold=1.0, **fixed)
    s = eagle_hf.last_stats()
    assert torch.equal(out_none, ref)
    assert s.cycles == 0 and s.fallback_steps == s.steps - s.final_steps  # nothing drafted: every round was plain


def test_pruned_tree_is_the_full_tree_above_the_threshold():
    import math

    from eagle_hf.speculation.drafting import DraftState, draft_tree

    target = tiny_target("llama")
    drafter = tiny_drafter(target, seed=3)
    drafter.bind_target_embedding(target.get_input_embeddings())
    with torch.no_grad():
        drafter.lm_head.weight.mul_(30.0)  # a peaky drafter: some branches are confident, others not
    ids = torch.randint(1, 96, (1, 9)).to(target.device)
    from eagle_hf.drafter.capture import gather_aux
    from eagle_hf.hf import check_compatible

    out = target(ids, output_hidden_states=True)
    aux = gather_aux(out.hidden_states, check_compatible(target, drafter))[:, :-1]  # [1, 8, A]
    trees = {}
    for threshold in (0.0, 0.05):
        state = DraftState.for_drafter(drafter)
        logits, hidden = state.extend(drafter, aux, ids[:, 1:])
        trees[threshold] = draft_tree(drafter, state, int(ids[0, -1]), logits, hidden, 4, 3, 1000, threshold)
    full, pruned = trees[0.0], trees[0.05]
    keep = [i for i in range(full.size) if float(full.scores[i]) >= math.log(0.05)]
    assert 1 < len(keep) < full.size  # the threshold bites, but not everywhere
    # (scores to float32 precision: a level's drafter pass over fewer frontier nodes rounds differently)
    got = sorted(zip(pruned.tokens.tolist(), pruned.scores.tolist()))
    want = sorted(zip(full.tokens[keep].tolist(), full.scores[keep].tolist()))
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [s for _, s in got] == pytest.approx([s for _, s in want], abs=1e-5)
    assert all(int(pruned.parents[i]) < i for i in range(1, pruned.size))  # parents before children


@pytest.mark.parametrize("sources", ["eagle", "eagle+copy"])
def test_drafter_catches_up_after_plain_steps(sources):
    """With plain steps between cycles (a scripted adaptive schedule), the drafter's rows stay aligned with the
    sequence: the oracle tree asserts that its root is the token after the drafter's last real row. With copy
    drafting, rounds of copy branches alone (the drafter resting) come between them too."""

    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids = torch.randint(1, 96, (1, 8))
    ref = target.generate(ids, max_new_tokens=40, do_sample=False)
    decisions = iter([3, 0, 0, 2, 0, 4, 0, 0, 0, 1] * 10)
    with oracle_tree(ref[0].tolist() + [0] * 8), \
            mock.patch("eagle_hf.speculation.schedule.DraftLengthController.choose", lambda self: next(decisions)):
        out = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=drafter, draft_mode="tree",
                              tree_depth=5, tree_top_k=2, tree_total_tokens=8, draft_sources=sources)
    assert torch.equal(out, ref)
    s = eagle_hf.last_stats()
    assert s.accepted > 5 and s.accepted_by_source["eagle"] > 0
    if sources == "eagle":
        assert s.fallback_steps > 5
    else:  # copy branches filled some of the drafter's rest rounds
        assert s.drafted_by_source["copy"] > 0


@pytest.mark.parametrize("family", ["gemma3", "mistral_window", "llama4"])
def test_sliding_and_chunked_layers_keep_the_tree_in_a_static_cache(family):
    """transformers' static cache rolls its sliding layers' buffers; during a call they hold every key (full
    static layers), and the verify masks apply the windows: outputs equal plain decoding on the same cache kind,
    a batch with holes too, and a static cache passed in without room for every prompt."""
    from transformers import StaticCache

    from eagle_hf.hf.version import cache_kwarg

    target = tiny_target(family)
    drafter = tiny_drafter(target)
    ids, mask = padded_pair(seed=5, length=12, padding=4)
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    assert torch.equal(target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                       cache_implementation="static"), ref)
    for mode in (dict(draft_mode="tree", tree_depth=4, tree_top_k=3, tree_total_tokens=10,
                      num_assistant_tokens_schedule="constant"), {}):
        out = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                              cache_implementation="static", **mode)
        assert torch.equal(out, ref), mode
        assert eagle_hf.last_stats().cycles > 0
    cache = StaticCache(config=target.config, max_cache_len=ref.shape[1] + 8)
    out = target.generate(ids[:1], max_new_tokens=24, do_sample=False, assistant_model=drafter, **cache_kwarg(cache))
    assert torch.equal(out, target.generate(ids[:1], max_new_tokens=24, do_sample=False))


def test_llama4_query_scale_steps_do_not_split_a_tree():
    """Llama 4's NoPE layers scale queries by cache slot, a step every `floor_scale` slots; a tree's nodes sit at
    slots past their positions, so a tree stops short of a step. With steps every 8 slots and long accepted
    paths (an oracle tree), outputs equal plain decoding (without the stop, 2 of these 8 prompts differ)."""
    target = tiny_target("llama4", floor_scale=8, attn_scale=50.0)
    drafter = tiny_drafter(target)
    for seed in range(8):
        torch.manual_seed(seed)
        ids = torch.randint(1, 96, (1, 9))
        ref = target.generate(ids, max_new_tokens=40, do_sample=False)
        with oracle_tree(ref[0].tolist() + [0] * 8):
            out = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=drafter,
                                  draft_mode="tree", tree_depth=5, tree_top_k=2, tree_total_tokens=8,
                                  num_assistant_tokens_schedule="constant")
        assert torch.equal(out, ref), seed
