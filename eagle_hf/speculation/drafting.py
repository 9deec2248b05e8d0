"""Drafting with an EAGLE head, for every call: the drafter's cache of real rows, the growth of a round's draft
trees and their layout for the verify, and how that runs (eagerly, or as fixed-shape programs).

Real rows (prompt and accepted tokens) are always computed from the target's own hidden states; speculative
rows live only for one round and are dropped before the next (eagle_spec.md §5.4). A chain is the tree with
``top_k = 1``; with a sampling chooser its drafts keep the exact distributions they were drawn from.

The module reads top to bottom as a round drafts:

* **the growth** (`grow_levels`): from each row's last real row, the root's children, then each level's forward
  over k frontier nodes a row, its top-k (or a sampler's choice), the next frontier (the k best children by
  cumulative log-probability, float64, a stable sort) and the ancestors each node sees, all on the device;
* **the layout** (`tree_layout`): each row's tree as the verify forward reads it (`TreeLayout`: tokens, depths,
  ancestor mask), the best nodes closed under ancestors, the greedy chain first, with a float64 part the host
  reads once, with the target's choices, after the verify; the copy branches the host knew before the round
  beside them (`with_copies`, from their tokens and ancestor bits: `TreeRequest.copy_rows`), in the same launch,
  first where the row's last accepted draft was a copy's (an accepted copy path then needs no move in the cache);
  trees the host holds (`laid_out`) are laid out the same way;
* **the drafter's cache** (`DraftState`): its real rows, their catch-up (`DraftState.extend`), ragged rows of a
  batch (`eagle_hf.speculation.ragged`);
* **the launch** (`draft_trees`): eagerly at the round's shapes (the CPU's default, and a sampling chain's chooser,
  each level under the kept mask), or as programs over the drafter cache's whole storage ``[B, kv_heads, C, d]``
  and its validity ``[B, C]`` (a batch's holes) (`eagle_hf.programs`: a CUDA graph on a GPU, a compiled call where
  the target's forward is compiled), kept with the storage between calls (`LevelGraphs`): the **catch-up program**
  (n rows a row, a power of two: the target's taps fused and written under each row's causal mask over the C
  columns) and the **levels program** (`grow_trees`: the growth and the layout). A round's catch-up is *staged*
  and runs first in the levels' launch (`catch_up_then_grow`): one program a drafting round. It stands alone where
  its outputs are read before any level (the host choosing the children: sampling) or the storage grows under it.
  The host writes each launch's integers in one copy and the target's taps in one; nothing inside reads the host.
"""

from __future__ import annotations

import math
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..drafter.modeling import KV, DraftStep, EagleDrafter, KVWriter
from ..programs import Ints, Program, pack, to_device
from .ragged import KeptMask, Ragged, SlotBuffers, new_buffers
from .tree import COPY, EAGLE, DraftTree

#: catch-ups of at most this many rows per row use the kept attention mask (a prompt's build their own)
KEPT_MASK_ROWS = 64
#: a catch-up of at most this many rows a row runs at fixed shapes where the levels do (`DraftState.graphs`): a
#: round's, and a short prompt's (eagerly, a 48-token prompt's took a 2-core CPU about 1 ms, compiled 0.24 ms)
FIXED_CATCH_UP = 64
#: a catch-up of at most this many rows a row is staged to run first in the next levels' program; a longer one (a
#: prompt's, a long accepted copy's) runs in a program of its own, so that the levels' programs are made for a
#: round's few sizes of catch-up only
STAGED_CATCH_UP = 16
#: a staged catch-up of at most this many rows a row (the drafts of the round before mostly rejected) is not padded
#: to a regular round's rows: a CPU program with a catch-up over 8 rows costs about a seventh more than over 2
#: (docs/results/round_regime.md, "The drafting program's launch")
FEW_CATCH_UP = 2
#: a prompt's catch-up reads at most this many rows per drafter forward: its activations (the drafter's MLP has
#: the target's width) over 8k rows added ~0.7 GiB to the peak of a Llama-3.1-8B-shaped call (H200 device check)
CATCH_UP_CHUNK = 1024
#: bits of an int64 word a copy node's ancestors take (`TreeRequest.copy_rows`, `with_copies`): the sign bit stays
#: clear
COPY_BITS = 63


# ------------------------------------------------------------------ the growth and the layout
@dataclass
class Choice:
    """Children chosen for k expanded nodes, c each (device tensors: `tree_layout` lays them out on the device)."""

    tokens: torch.Tensor  # [k, c] target-vocabulary ids
    logp: torch.Tensor  # [k, c] log-probability of each child under the distribution it was chosen from


def top_k_choice(drafter: EagleDrafter, logits: torch.Tensor, top_k: int) -> Choice:
    """The deterministic choice of EAGLE-2 trees (and greedy chains): the top_k drafts by probability, for logits
    of any leading shape ``[..., Vd]`` (a batch's frontiers at once)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.max(dim=-1, keepdim=True) if top_k == 1 else torch.topk(logp, top_k, dim=-1)  # [..., top_k] (a
    # chain's: a reduction that compiles into the kernels around it)
    return Choice(drafter.draft_to_target(top.indices), top.values)


#: a level's drafter forward: (feed [B, k, H], tokens [B, k], level, tail [B, k, fed + k] the nodes' ancestors
#: among the fed tree rows and themselves, fed) -> its `DraftStep`
LevelForward = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, int], DraftStep]


#: chooses the children of a level's frontier nodes from their draft logits [B, k, Vd] and the nodes' draft tokens
#: below the root [B, k, level] (for logits processors that read the prefix): a `Choice` of [B, k, k]
Chooser = Callable[[torch.Tensor, torch.Tensor], Choice]


def grow_levels(drafter: EagleDrafter, forward: LevelForward, logits: torch.Tensor, hidden: torch.Tensor, k: int,
                levels: int, depth: torch.Tensor, min_logp: float, prune: bool,
                choose: Chooser | None = None) -> list[tuple]:
    """The host's level-by-level tree growth with its decisions taken on the device, at fixed shapes: each level
    keeps k frontier nodes a row; a node the host would prune (its row's depth reached, or below `min_logp`) stays
    in place as a node nobody descends from, its children scored -inf; the next frontier is the k best children by
    cumulative log-probability (float64, a stable sort: the host's order); each node's ancestors are its parent's
    plus itself. logits [B, Vd], hidden [B, 1, H]: each row's last real row's; depth [B, 1] each row's levels.

    `choose`: the children's choice (default: the drafter's top k, `top_k_choice`); a sampling chain's chooser
    draws them (its distributions are its own to keep).

    Returns per level: the root's children (tokens, logp) [B, k], then per level (children's tokens [B, k, k],
    their cumulative scores [B, k*k] (-inf below a node that did not grow), the next frontier's places among them
    [B, k], None for a chain): what `tree_layout` lays out."""
    rows, width = hidden.shape[0], hidden.shape[-1]
    flags = hidden.new_zeros(rows, k, dtype=torch.bool)  # (factories from a device tensor: on its device)
    paths = None if choose is None else hidden.new_zeros(rows, 1, 0, dtype=torch.long)  # [B, k, level]
    pick = choose or (lambda lg, _paths: top_k_choice(drafter, lg, k))
    first = pick(logits[:, None], paths)  # [B, 1, k]
    tokens, own = first.tokens[:, 0], first.logp[:, 0].double()  # [B, k] the first level's nodes, the root's order
    score, slot = own, flags.long()[..., None]  # slot [B, k, 1]: the parent's output row
    own_metric = not prune and min_logp > -math.inf  # (a draft's own probability is tested against the threshold)
    eye = flags.new_zeros(k, k).fill_diagonal_(True).expand(rows, k, k)
    ancestors = flags.new_zeros(rows, k, 0)  # [B, k, fed] among the fed tree rows
    alive = ~flags  # not below a pruned node
    parent_out, fed = hidden, 0
    kept = [(first.tokens[:, 0], first.logp[:, 0])]
    for level in range(1, levels):
        grows = alive & (level < depth)  # [B, k] the host's `_Growth.prune`
        if min_logp > -math.inf:
            grows = grows & ((score if prune else own) >= min_logp)
        tail = torch.cat([ancestors & grows[..., None], eye], 2)  # [B, k, fed + k]: its ancestors and itself
        feed = parent_out if k == 1 else parent_out.gather(1, slot.expand(rows, k, width))  # [B, k, H]
        out = forward(feed, tokens, level, tail, fed)
        if paths is not None:  # each frontier node's drafts below the root
            paths = torch.cat([paths.expand(rows, k, -1), tokens[..., None]], 2)
        children = pick(out.logits, paths)  # [B, k, k]
        logp = children.logp.double()
        scores = torch.where(grows[..., None], score[..., None] + logp, -math.inf).flatten(1)
        # [B, k] the next frontier's places among the k*k children (a chain's one child: in place, no sort)
        order = None if k == 1 else torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
        kept.append((children.tokens, scores, order))
        if order is None:  # (a chain: no gathers either)
            tokens, score = children.tokens.flatten(1), scores
            own = logp.flatten(1) if own_metric else None
            alive, ancestors, parent_out, fed = score > -math.inf, tail, out.hidden, fed + k
            continue
        slot = (order // k)[..., None]  # [B, k, 1] each next frontier node's parent's output row
        if paths is not None:
            paths = paths.gather(1, slot.expand(-1, -1, paths.shape[2]))
        tokens = children.tokens.flatten(1).gather(1, order)
        own = logp.flatten(1).gather(1, order) if own_metric else None
        score = scores.gather(1, order)
        alive = score > -math.inf
        ancestors = tail.gather(1, slot.expand(rows, k, fed + k))  # the parent's, itself included
        parent_out, fed = out.hidden, fed + k
    return kept


@dataclass
class TreeLayout:
    """Each row's draft tree as the verify forward reads it, built on the device from `grow_levels`' result (no
    read between drafting and verifying), W nodes a row (node 0 the root; nodes after a row's tree are padding
    nodes that see the root and themselves, their outputs never read):

    the tree's nodes are the best ``W - 1`` candidates by cumulative log-probability (a stable sort: ties go to
    the earlier candidate, so a parent, never below its child, always comes first: the choice is closed under
    ancestors, as the host's reference growth's in the tests), the drafter's greedy chain first, then in the
    order they were drafted (the reference's order too)."""

    tokens: torch.Tensor  # [B, W] the verify input (the roots first)
    depths: torch.Tensor | None  # [B, W] each node's depth (positions: the root's plus these); None: W = 1
    ancestors: torch.Tensor | None  # [B, W, W] bool: node i sees node j (its ancestors, itself); None: W = 1
    host: torch.Tensor | None  # [B, 3 (W - 1) + 1] float64 for the host: tokens, parents, scores below the root,
    # size (None: the host holds the trees, `laid_out`)
    parents: torch.Tensor | None = None  # [B, W] each node's parent (the root's -1), where sampling draws need it
    real: torch.Tensor | None = None  # [R] the real nodes' flat positions in [B, W], where the verify's head may
    # skip the padding nodes' logits (host trees of different sizes; None: every node's are computed)


@dataclass
class TreeRequest:
    """What a round asks of the trees' layout: W nodes a row (the verify's width for the drafter's trees), and per
    row of the drafter's cache, in its slot order: the root token, the root's verify position, its most nodes
    (the root included; 1: the row does not draft); and where the verify reads copy branches beside the drafter's
    trees, each row's copy tree (the host knows it before the round; None: none), laid out in `copy_width` (C)
    nodes beside the W (`with_copies`): after them, or right after the root where the row's `copies_first` says
    so (None: after them in every row)."""

    width: int
    roots: list[int]
    positions: list[int]
    sizes: list[int]
    copies: list[DraftTree | None] | None = None
    copy_width: int = 0
    copies_first: list[bool] | None = None

    def copy_rows(self) -> tuple[list[int], list[int], list[int]]:
        """The copy branches as the layout takes them (`with_copies`), flat over the rows: each copy node's token
        (a padding node's: its row's root), then each node's ancestors among the copy nodes, itself included, as
        `copy_words` words of `COPY_BITS` bits a node (bit j: copy node j + 1; a padding node's: none), then each
        row's order (1: its copy nodes first). Host lists; nothing when there are no copy branches to lay out."""
        c = self.copy_width
        if not c:
            return [], [], []
        tokens, bits, words = [], [], copy_words(c)
        for tree, root in zip(self.copies, self.roots):
            h = tree.host if tree is not None else None
            n = len(h.tokens) - 1 if h is not None else 0
            seen = [0] * (n + 1)  # node -> its ancestors' bits (the root's: none)
            for j in range(1, n + 1):
                seen[j] = seen[h.parents[j]] | 1 << (j - 1)
            tokens += (h.tokens[1:] if h is not None else []) + [root] * (c - n)
            if words == 1:
                bits += seen[1:] + [0] * (c - n)
            else:
                mask = (1 << COPY_BITS) - 1
                bits += [b >> (COPY_BITS * w) & mask for b in seen[1:] + [0] * (c - n) for w in range(words)]
        first = [int(f) for f in self.copies_first] if self.copies_first is not None else [0] * len(self.roots)
        return tokens, bits, first


def copy_words(width: int) -> int:
    """Words of `COPY_BITS` bits a copy node's ancestor bits take in a layout of `width` copy nodes."""
    return -(-width // COPY_BITS)


def tree_layout(kept: list[tuple], roots: torch.Tensor, k: int, width: int, min_logp: float,
                sizes: torch.Tensor) -> TreeLayout:
    """The `TreeLayout` of `grow_levels`' result `kept` (roots [B] the root tokens): the candidates (the root's k
    children, then each level's k x k, -inf where their parent did not grow), their cumulative scores, parents and
    depths; the best ``width - 1`` eligible ones (score at least `min_logp`) in drafting order; their parents as
    node indices; ancestors by following the parents (one step a level). sizes [B, 1]: each row's most nodes,
    root included (1: the root alone, a row that does not draft)."""
    if k == 1 or len(kept) == 1:
        return prefix_layout(kept, roots, width, min_logp, sizes, chain=k == 1)
    tokens0 = kept[0][0]
    rows, device = tokens0.shape[0], tokens0.device
    tokens, scores = candidates(kept)  # [B, M] each
    index = torch.arange(tokens.shape[1], device=device)  # [M] level l's k^2 candidates from k + (l - 1) k^2 on
    # each level's frontier (its k candidates that grew children): the first level's all, then `order`'s picks
    frontier = torch.cat([index[:k].expand(rows, k)] + [order + (k + (level - 1) * k * k)
                                                        for level, (_, _, order) in enumerate(kept[1:-1], start=1)],
                         1)  # [B, F]
    parents = torch.cat([torch.full_like(tokens0, -1), frontier[..., None].expand(-1, -1, k).flatten(1)],
                        1)  # [B, M] -1: the root
    # on the greedy chain: the first child drafted below a node (a candidate's place among its siblings is its
    # index mod k), first-born all the way up: one level more each pass
    first_born = index % k < 1  # [M]
    greedy, up = first_born & (parents < 0), parents.clamp(min=0)  # [B, M] (the root's first child)
    for _ in range(len(kept) - 1):
        greedy = first_born & greedy.gather(1, up)
    m, n = tokens.shape[1], width - 1  # [B, M] each
    eligible = (scores > -math.inf) & (scores >= min_logp)
    if m < n:  # (fewer candidates than room: padding candidates, never eligible)
        pad = n - m
        tokens, scores, parents, greedy = (torch.nn.functional.pad(t, (0, pad)) for t in (tokens, scores, parents,
                                                                                          greedy))
        eligible = torch.nn.functional.pad(eligible, (0, pad))
        m = n
    number = torch.arange(1, n + 1, device=device)  # [n] a node's number among the root's
    best = torch.sort(torch.where(eligible, scores, -math.inf), dim=1, descending=True, stable=True).indices[:, :n]
    chosen = eligible.gather(1, best) & (number < sizes)  # [B, n] real nodes, within the row's size
    # the chain first, then drafting order, padding last
    order = torch.where(chosen, torch.where(greedy.gather(1, best), best, best + m), 2 * m)
    picked = torch.sort(order, dim=1).values  # [B, n]
    real = picked < 2 * m
    picked = picked % m
    node_of = tokens.new_zeros(rows, m + 1).scatter_(1, torch.where(real, picked, m), number.expand(rows, n))
    parent = parents.gather(1, picked)
    parent = torch.where(real & (parent >= 0), node_of.gather(1, parent.clamp(min=0)), 0)  # [B, n] node indices
    node_tokens = torch.where(real, tokens.gather(1, picked), roots[:, None])
    node_scores = torch.where(real, scores.gather(1, picked), 0.0)
    chain = torch.cat([parent.new_zeros(rows, 1), parent], 1)[..., None]  # [B, W, 1] each node's parent (the
    # root's: itself)
    full = torch.cat([real.new_ones(rows, 1), real], 1)  # [B, W] the root and the real nodes
    seen = torch.eye(width, dtype=torch.bool, device=device).repeat(rows, 1, 1)  # [B, W, W]
    up = torch.where(full[..., None], chain, 0)  # [B, W, 1] padding nodes: below the root
    for _ in range(len(kept)):
        seen.scatter_(2, up, True)
        up = chain.gather(1, up)
    depths = torch.where(full, seen.sum(2) - 1, 0)  # [B, W] a real node's ancestors, the root's included
    host = torch.cat([node_tokens, parent, node_scores, real.sum(1, keepdim=True)], 1)  # (float64: the scores)
    return TreeLayout(torch.cat([roots[:, None], node_tokens], 1), depths, seen, host)


def prefix_layout(kept: list[tuple], roots: torch.Tensor, width: int, min_logp: float, sizes: torch.Tensor,
                  chain: bool) -> TreeLayout:
    """`tree_layout` where the nodes are a prefix of the candidates: a chain (k = 1: a level's one candidate is the
    next node, node i's parent is node i - 1) or a tree of one level (the root's k children, in the top-k's order).
    A score only falls along the candidates (with depth, or down the top-k) and nothing grows below a node that did
    not, so the eligible candidates are a prefix: the same layout, without the sort and the walk up the parents."""
    tokens, scores = candidates(kept)  # [B, M] each
    rows, m, n = tokens.shape[0], tokens.shape[1], width - 1
    if m < n:  # (fewer candidates than room: padding candidates, never eligible)
        tokens, scores = (torch.nn.functional.pad(t, (0, n - m), value=v) for t, v in ((tokens, 0),
                                                                                     (scores, -math.inf)))
    tokens, scores = tokens[:, :n], scores[:, :n]
    number = number_of(tokens)  # [B, n] 1 .. n
    real = (scores > -math.inf) & (scores >= min_logp) & (number < sizes)  # [B, n] a prefix of each row
    node_tokens = torch.where(real, tokens, roots[:, None])
    node_scores = torch.where(real, scores, 0.0)
    eye = torch.eye(width, dtype=torch.bool, device=tokens.device)  # [W, W] (padding nodes: themselves)
    if chain:
        parent = torch.where(real, number - 1, 0)  # [B, n] node j's parent: node j - 1
        depths = torch.where(real, number, 0)
        full = torch.cat([real.new_ones(rows, 1), real], 1)  # [B, W] the root and the real nodes
        seen = torch.ones(width, width, dtype=torch.bool, device=tokens.device).tril() & full[..., None] | eye
    else:
        parent = torch.zeros_like(number)  # [B, n] the root's children
        depths = real.long()
        seen = eye.repeat(rows, 1, 1)  # [B, W, W]
    seen[:, :, 0] = True  # (and the root)
    host = torch.cat([node_tokens.double(), parent.double(), node_scores, real.sum(1, keepdim=True).double()], 1)
    return TreeLayout(torch.cat([roots[:, None], node_tokens], 1), torch.cat([parent.new_zeros(rows, 1), depths], 1),
                      seen, host)


def candidates(kept: list[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
    """`grow_levels`' candidates in drafting order (the root's k children, then each level's k x k): their tokens
    and cumulative scores (float64, -inf below a node that did not grow), [B, M] each."""
    tokens0, logp0 = kept[0]
    return (torch.cat([tokens0] + [children.flatten(1) for children, _, _ in kept[1:]], 1),
            torch.cat([logp0.double()] + [below for _, below, _ in kept[1:]], 1))


def host_trees(values: list[float], roots: list[int]) -> list[tuple[list[int], list[int], list[float]]]:
    """Each row's tree from `TreeLayout.host` read as `values` (rows in order): its root and real nodes' tokens,
    parents and cumulative scores (host lists; node 0 the root)."""
    per = len(values) // len(roots)
    n = (per - 1) // 3
    out = []
    for b, root in enumerate(roots):
        row = values[b * per : (b + 1) * per]
        size = int(row[3 * n])
        out.append(([root] + [int(t) for t in row[:size]], [-1] + [int(p) for p in row[n : n + size]],
                    [0.0] + row[2 * n : 2 * n + size]))
    return out


def laid_out(trees: list[DraftTree], width: int, positions: list[int], device: torch.device,
             parents: bool = False, real: bool = False) -> tuple[TreeLayout, torch.Tensor]:
    """Trees the host holds (a round no drafter grew, or trees read before the verify) laid out as `tree_layout`
    lays out the drafter's: W nodes a row (the root, the tree's nodes, then padding nodes, the root's token at its
    position, that see the root and themselves), in one host-to-device copy; `parents`: with each node's parent
    (sampling's draws); `real`: with the real nodes' flat positions where there are padding nodes. positions: each
    row's root position. Returns the layout and the verify positions [B, W]."""
    pad = [width - t.size for t in trees]
    arrays = {"tokens": [t.host.tokens + t.host.tokens[:1] * p for t, p in zip(trees, pad)],
              "positions": [[r + d for d in t.host.depths] + [r] * p for r, t, p in zip(positions, trees, pad)]}
    if parents:
        arrays["parents"] = [t.host.parents + [0] * p for t, p in zip(trees, pad)]
    if real and any(pad):
        arrays["real"] = [b * width + n for b, t in enumerate(trees) for n in range(t.size)]
    if width > 1:  # (a plain round's root alone: its tokens and positions)
        arrays["depths"] = [t.host.depths + [0] * p for t, p in zip(trees, pad)]
        arrays["ancestors"] = [row for t in trees for row in ancestor_rows(t.host.parents, width)]  # [B*W][W]
    host = pack(torch.device(device), **arrays)
    ancestors = host["ancestors"].view(len(trees), width, width).bool() if width > 1 else None
    return (TreeLayout(host["tokens"], host.get("depths"), ancestors, None, host.get("parents"), host.get("real")),
            host["positions"])


def ancestor_rows(parents: list[int], width: int) -> list[list[int]]:
    """A host tree's ancestor mask as `width` rows of 0/1 (parents before children): node i sees its ancestors
    and itself; the padding nodes after the tree see the root and themselves."""
    rows: list[list[int]] = []
    for i, parent in enumerate(parents):
        row = rows[parent].copy() if parent >= 0 else [0] * width
        row[i] = 1
        rows.append(row)
    for i in range(len(parents), width):
        row = [0] * width
        row[0] = row[i] = 1
        rows.append(row)
    return rows


def with_copies(laid: TreeLayout, tokens: torch.Tensor, bits: torch.Tensor,
                first: torch.Tensor | None = None) -> TreeLayout:
    """The layout `laid` (W nodes a row) with each row's copy branches beside its nodes: C copy nodes a row, their
    tokens [B, C] and ancestor bits [B, C, words] (`TreeRequest.copy_rows`: bit j of a node, copy node j + 1 is
    itself or an ancestor of it), after the W nodes, or, in the rows `first` [B] (0/1) says, right after the root
    (the drafter's nodes then follow them). A copy node sees the root, its ancestors and itself, never a drafter
    node; its depth is its ancestors' count; a padding node (no bits) sees the root and itself, at the root's
    depth. The host part stays the drafter's (the host holds the copies). The same on the host, the device and in
    a program: a few fused operations, no loop."""
    rows, w = laid.tokens.shape
    c = tokens.shape[1]
    column = torch.arange(c, device=tokens.device)  # [C]
    words = bits.gather(2, (column // COPY_BITS).expand(rows, c, c))  # [B, C, C] the word holding copy node j's bit
    own = (words >> (column % COPY_BITS)) & 1  # [B, C, C] node i sees copy node j (its ancestors and itself)
    depths = own.sum(2)  # [B, C]
    seen = own.bool() | torch.eye(c, dtype=torch.bool, device=tokens.device)  # (a padding node: itself)
    root = seen.new_ones(rows, c, 1)  # [B, C, 1] every copy node sees the root ...
    drafted = seen.new_zeros(rows, c, w - 1)  # ... and no drafter node
    ancestors = torch.cat([torch.nn.functional.pad(laid.ancestors, (0, c)), torch.cat([root, drafted, seen], 2)],
                          1)  # [B, W + C, W + C]
    tokens, depths = torch.cat([laid.tokens, tokens], 1), torch.cat([laid.depths, depths], 1)  # [B, W + C] each
    if first is not None:  # row b's columns in its order: [root, copy nodes, drafter nodes] where it puts them first
        after = torch.arange(w + c, device=tokens.device)  # [W + C] the copies after the drafter's nodes
        before = torch.cat([after[:1], after[w:], after[1:w]])  # [W + C] the copies right after the root
        order = torch.where(first.bool()[:, None], before, after)  # [B, W + C]
        tokens, depths = tokens.gather(1, order), depths.gather(1, order)
        ancestors = ancestors.gather(1, order[..., None].expand(-1, -1, w + c)).gather(2, order[:, None, :].expand(
            -1, w + c, -1))  # [B, W + C, W + C]
    return TreeLayout(tokens, depths, ancestors, laid.host, real=laid.real)


@dataclass
class PendingTrees:
    """A round's trees laid out for the verify on the device (`eagle_hf.speculation.drafting.TreeLayout`, W
    nodes a row of the drafter's, then each row's copy branches where the round laid them beside (`with_copies`),
    with the verify positions), read by the host with the verify's result (`settle`), or before the verify where
    the verify needs them on the host (sampling). `copies`: each row's copy branches as a tree of its own (None:
    none). Trees the host holds already (`on_host`) are laid out the same way: the verify reads one kind of
    layout."""

    slots: list[int]  # each row's slot in the drafter's cache (the layout's rows are in slot order)
    roots: list[int]
    layout: TreeLayout
    positions: torch.Tensor  # [B, W (+ C)]
    copies: list[DraftTree | None]
    drafter_width: int  # W
    trees: list[DraftTree] | None = None  # the rows' trees where the host holds them (nothing to read)
    copies_first: list[bool] | None = None  # each row's copy nodes laid out right after its root (None: after
    # the drafter's nodes in every row: `with_copies`)

    @classmethod
    def on_host(cls, trees: list[DraftTree], pad: Callable[[int], int], positions: list[int], device: torch.device,
                parents: bool = False, real: bool = False) -> PendingTrees:
        """The host's trees of the round (a round no drafter grew, or trees read before the verify) laid out for
        the verify, ``pad(n)`` nodes a row for the largest tree's n (`laid_out`: `parents`, `real` as there)."""
        width = pad(max(t.size for t in trees))
        layout, at = laid_out(trees, width, positions, device, parents, real)
        return cls(list(range(len(trees))), [t.host.tokens[0] for t in trees], layout, at, [None] * len(trees),
                   width, trees=trees)

    @property
    def width(self) -> int:
        return self.layout.tokens.shape[1]

    def read(self) -> list[float]:
        """The layout's host part (the round's read where the trees are needed before the verify)."""
        return self.layout.host.flatten().tolist()

    def settle(self, values: list[float], grafted: bool = False) -> tuple[list[DraftTree], list[list[int]] | None]:
        """The rows' trees from the layout's host part read as `values`, each with its copy branches, and each
        tree node's column in the layout (None: the trees' nodes are its first columns). `grafted`: the copies
        are in the layout (`with_copies`: a drafter node a copy branch proposed too stays two nodes there, both
        marked as proposed by both); else they are grafted on the host (shared prefixes are one node). Trees the
        host holds come as they are."""
        if self.trees is not None:
            return self.trees, None
        by_slot = dict(zip(self.slots, self.roots))
        lists = host_trees(values, [by_slot[slot] for slot in sorted(by_slot)])
        trees, columns = [], []
        first = self.copies_first or [False] * len(self.slots)
        for slot, copy, ahead in zip(self.slots, self.copies, first):
            tokens, parents, scores = lists[slot]
            size = len(tokens) - 1
            if copy is not None and grafted:
                tree, cols = _beside(tokens, parents, scores, copy, self.drafter_width,
                                     self.width - self.drafter_width if ahead else None)
            else:
                tree, cols = DraftTree.of_lists(tokens, parents, scores), list(range(size + 1))
                if copy is not None:
                    tree = tree.graft(copy)
            trees.append(tree), columns.append(cols)
        return trees, columns if grafted else None


def _beside(tokens: list[int], parents: list[int], scores: list[float], copy: DraftTree, width: int,
            copy_width: int | None = None):
    """A drafter's tree (host lists) and its copy branches laid out beside its `width` columns, as one tree: (the
    tree, each node's column). A copy node on a path the drafter drafted too marks both nodes as both's. The copy
    nodes come after the drafter's, or, where the layout put its `copy_width` copy columns right after the root
    (None: it did not), before them, in the tree as in the layout (so that of two equally long accepted paths, the
    copy's, needing no move in the cache, is taken)."""
    size, h = len(tokens), copy.host
    sources = [EAGLE] * size
    child = {(parents[i], tokens[i]): i for i in range(1, size)}  # the drafter's nodes by (parent, token)
    same = {0: 0}  # copy node -> the drafter node on the same path
    for j in range(1, len(h.tokens)):
        p = h.parents[j]
        node = child.get((same[p], h.tokens[j])) if p in same else None
        tokens.append(h.tokens[j]), scores.append(h.scores[j]), parents.append(0 if p == 0 else size - 1 + p)
        sources.append(COPY | (EAGLE if node is not None else 0))
        if node is not None:
            same[j] = node
            sources[node] |= COPY
    if copy_width is None:
        columns = list(range(size)) + [width - 1 + j for j in range(1, len(h.tokens))]
        return DraftTree.of_lists(tokens, parents, scores, sources), columns
    order = [0] + list(range(size, len(tokens))) + list(range(1, size))  # the tree's nodes in the layout's order
    place = {node: i for i, node in enumerate(order)}
    columns = list(range(len(h.tokens))) + [copy_width + i for i in range(1, size)]
    return DraftTree.of_lists([tokens[n] for n in order], [place[parents[n]] if n else -1 for n in order],
                              [scores[n] for n in order], [sources[n] for n in order]), columns


def number_of(t: torch.Tensor) -> torch.Tensor:
    """[B, n] 1 .. n along the last dimension (a node's number in a list of n)."""
    return torch.arange(1, t.shape[1] + 1, device=t.device).expand_as(t)


# ------------------------------------------------------------------ the drafter's cache and the launch
@dataclass
class DraftState:
    """The drafter's cache of real rows for the rows of a batch, preallocated: keys and values
    ``[B, kv_heads, capacity, d]`` (`slots`, grown in place: `eagle_hf.speculation.ragged.SlotBuffers`), of which
    the first `length` slots hold real rows; a round's tree rows are written after them and dropped
    (overwritten) by the next round.

    Row b reads the slots `ragged` says (a batch's rows read different numbers of rows per round, and a shorter
    row's extra slots are holes, see `eagle_hf.speculation.ragged`). Row b's next real row sits at position ``positions[b]``
    (> 0 at first when the target's cache already held a prefix the drafter never saw)."""

    positions: list[int] = field(default_factory=lambda: [0])
    slots: SlotBuffers | None = None  # keys and values [B, kv_heads, capacity, d] (None: no drafter; `for_drafter`)
    ragged: Ragged | None = None
    steps: int = 0  # drafter forwards over draft levels so far (catch-ups not counted): what a round's levels cost
    # [B, 1, R, C] bool, the draft levels' attention mask kept between levels and rounds: columns below `length`
    # hold each row's slot validity for every query row (written as real rows arrive), the tree block after them
    # is rewritten per level: O(new slots), never O(context), per level
    _mask: KeptMask = field(default_factory=KeptMask, repr=False)
    #: draft levels at fixed shapes (captured on CUDA; `LevelGraphs`), None: eager
    graphs: LevelGraphs | None = field(default=None, repr=False)
    #: how the fixed-shape programs run (`eagle_hf.programs.how_to_run`): "graph", "compile" or "eager"
    how: str = "eager"
    #: the programs whose validity buffer holds this cache's validity up to `length` (None: none yet)
    _valid_in: DraftPrograms | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.ragged is None:
            self.ragged = Ragged([0] * len(self.positions), 0)

    @classmethod
    def for_drafter(cls, drafter: EagleDrafter, rows: int = 1, graphs: LevelGraphs | None = None,
                    how: str = "eager") -> DraftState:
        """An empty cache for `drafter`'s rows of a batch: its keys and values ``[B, kv_heads, 0, d]`` in the
        drafter's dtype and on its device (the first rows allocate their storage, from `graphs` where the levels
        run at fixed shapes)."""
        state = cls(positions=[0] * rows, graphs=graphs, how=how)
        cfg = drafter.config
        empty = drafter.fc.weight.new_empty(rows, cfg.num_key_value_heads, 0, cfg.head_dim)  # [B, kv_heads, 0, d]
        allocate = new_buffers if graphs is None else _graphs_storage(graphs, weakref.ref(state))
        state.slots = SlotBuffers((empty, empty), allocate=allocate)
        return state

    @property
    def rows(self) -> int:
        return len(self.positions)

    @property
    def length(self) -> int:
        """Slots per row (real rows and holes)."""
        return self.ragged.length

    @property
    def keys(self) -> torch.Tensor | None:
        """The keys' whole storage ``[B, kv_heads, capacity, d]`` (capacity 0 before the first rows; None: a cache
        without a drafter)."""
        return None if self.slots is None else self.slots.buffers[0]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.slots is None else self.slots.buffers[1]

    @property
    def kv(self) -> KV | None:
        """The real rows' keys and values ``[B, kv_heads, length, d]`` (views)."""
        return None if self.slots is None else KV(*self.slots.live(self.length))

    @property
    def valid(self) -> torch.Tensor | None:
        """[B, length] bool: which slots each row reads (None: all)."""
        return self.ragged.valid

    @property
    def next_position(self) -> int:
        """A single row's next position (a batch's rows: `positions`)."""
        return self.positions[0]

    def reserve(self, extra: int) -> None:
        """Room for `extra` slots after the real rows (`SlotBuffers.reserve`: amortised O(1) per slot)."""
        if self.length + extra > self.slots.capacity:
            self.launch_staged()  # (its rows belong in the storage the new one copies)
        self.slots.reserve(self.length, extra)

    def staged(self) -> bool:
        """Whether a catch-up waits to run with the next levels (`extend`'s `staged`: it waits in the programs
        that ran last, `programs`)."""
        return self._valid_in is not None and self._valid_in.staged is not None

    def launch_staged(self) -> None:
        """Run a catch-up staged for the next levels (`extend`'s `staged`) now, on its own."""
        if self._valid_in is not None:
            self._valid_in.launch_staged()

    def level_forward(self, drafter: EagleDrafter, feed: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                      at: int, mask: torch.Tensor | None) -> DraftStep:
        """One draft level: the drafter over feed [B, k, H] with tokens and positions [B, k], its rows written at
        slots ``at ..`` (`reserve` first), `mask` [B|1, 1, k, at+k] (None: the plain causal layout), eagerly at
        the level's shapes."""
        return drafter.step(feed, ids, positions, past=self.writer(at), mask=mask)

    def writer(self, at: int) -> KVWriter:
        """Where a drafter pass writes its rows: slot `at` onwards (`reserve` first)."""
        return KVWriter(self.keys, self.values, at)

    def extend(self, drafter: EagleDrafter, aux: torch.Tensor, next_tokens: torch.Tensor,
               counts: list[int] | None = None, staged: int | None = None):
        """Add real rows: row b reads ``aux[b, :counts[b]]`` (target taps [B, n, A*H_t]), each with the token after
        it (``next_tokens`` [B, n]); default: all n. One drafter forward for the batch (a long prompt: one per
        `CATCH_UP_CHUNK` rows), one host-to-device copy.

        Returns each row's last new row's draft logits ``[B, Vd]`` and fed-back hidden state ``[B, 1, H]``
        (meaningless for a row that read nothing). `staged` = m: a catch-up at fixed shapes (`_extend_fixed`) is
        padded to m rows a row at least and written, not launched: the next draft levels run it first, in their
        program (`DraftPrograms.grow`), and only then are the returned buffers written."""
        rows, n = next_tokens.shape
        counts = [n] * rows if counts is None else counts
        if n > CATCH_UP_CHUNK:
            return self._extend_in_chunks(drafter, aux, next_tokens, counts)
        if self.graphs is not None and n <= FIXED_CATCH_UP:
            return self._extend_fixed(drafter, aux, next_tokens, counts, staged)
        return self._extend_eager(drafter, aux, next_tokens, counts)

    def _extend_eager(self, drafter: EagleDrafter, aux: torch.Tensor, next_tokens: torch.Tensor, counts: list[int]):
        """`extend` as one eager drafter forward at the rows' own shape (a long catch-up, or no fixed-shape programs)."""
        rows, n = next_tokens.shape
        device = next_tokens.device
        full = all(c == n for c in counts)
        self.launch_staged()
        self._valid_in = None  # (rows written outside the programs: their validity is copied in at their next launch)
        host = pack(device, positions=[[p + i for i in range(n)] for p in self.positions],
                    last=[max(c, 1) - 1 for c in counts],
                    **({} if full else {"new_valid": [[i < c for i in range(n)] for c in counts]}))
        new_valid = None if full else host["new_valid"].bool()  # [B, n]
        mask = None  # every slot real and every row full: the plain causal layout
        if self.ragged.holes or not full:
            own = torch.ones(n, n, dtype=torch.bool, device=device).tril().expand(rows, n, n)  # [B, n, n]
            if new_valid is not None:
                own = own & new_valid[:, None, :]
            own = own | torch.eye(n, dtype=torch.bool, device=device)  # a padding row sees itself: no empty softmax
            if n <= KEPT_MASK_ROWS:  # a round's catch-up: [B, 1, n, L + n], a view of the kept mask
                mask = self._mask.view(own, self.length, self.valid, torch.bool)
            else:  # (a prompt's: not worth keeping n query rows)
                past = self.valid if self.ragged.holes else own.new_ones(rows, self.length)  # [B, L]
                mask = torch.cat([past[:, None, :].expand(rows, n, self.length), own], 2)[:, None]
        fused = drafter.fuse(aux)  # [B, n, H]
        self.reserve(n)
        out = drafter.step(fused, next_tokens, host["positions"], past=self.writer(self.length), mask=mask,
                           compute_logits=False)
        self._arrive(counts, n, new_valid)
        last = host["last"][:, None, None]  # [B, 1, 1] each row's last new row
        normed = out.normed.gather(1, last.expand(rows, 1, out.normed.shape[-1]))  # [B, 1, H]
        hidden = out.hidden.gather(1, last.expand(rows, 1, out.hidden.shape[-1]))  # [B, 1, H]
        self.compact()
        return drafter.lm_head(normed[:, 0]), hidden

    def _extend_fixed(self, drafter: EagleDrafter, aux: torch.Tensor, next_tokens: torch.Tensor, counts: list[int],
                      staged: int | None = None):
        """`extend` for a catch-up at fixed shapes (`graphs`): row b reads its first ``counts[b]`` of the n rows,
        in one program (`DraftPrograms.catch_up`: n padded to the next power of two, `staged` rows at least unless
        n is `FEW_CATCH_UP` or fewer; a row's rows past its count are holes the programs' validity hides, the
        padding rows past n are overwritten by the next pass, which never reads them). Staged only up to
        `STAGED_CATCH_UP` rows; a longer one launches now."""
        n = next_tokens.shape[1]
        if n > STAGED_CATCH_UP:
            staged = None
        least = staged or 1
        if n <= FEW_CATCH_UP:  # (after a round whose drafts were rejected: a program of its own, cheaper)
            least = min(least, FEW_CATCH_UP)
        bucket = 1 << (max(n, least) - 1).bit_length()
        self.reserve(bucket)
        logits, hidden, new_valid = self.programs(drafter).catch_up(aux, next_tokens, self.positions, counts,
                                                                    self.length, bucket, stage=staged is not None)
        self._arrive(counts, n, new_valid)
        self.compact()
        return logits, hidden  # [B, Vd], [B, 1, H]

    def _arrive(self, counts: list[int], n: int, new_valid: torch.Tensor | None) -> None:
        """n slots a row were written after the real rows, row b's first ``counts[b]`` real (`new_valid` [B, n] on
        the device; None: all): the kept mask, the validity and the positions take them."""
        self._mask.arrive(self.length, n, new_valid)
        self.ragged.append(counts, n, new_valid, self.keys.device)
        self.positions = [p + c for p, c in zip(self.positions, counts)]

    def programs(self, drafter: EagleDrafter) -> DraftPrograms:
        """The draft programs over the cache's current storage (kept with the drafter's levels: a later call of
        the same shape reuses them), their validity buffer holding this cache's (copied in after rows were
        written outside them: a prompt, a compaction, rows leaving; O(length) where those were)."""
        last, inference = self._valid_in, torch.is_inference_mode_enabled()
        if last is not None and last.keys is self.keys and last.how == self.how and last.inference == inference:
            return last  # (the last launch's: the same storage, its validity this cache's)
        key = ("programs", self.keys.data_ptr(), tuple(self.keys.shape), self.how, inference)
        programs = self.graphs.kept(key, lambda: DraftPrograms(drafter, self.keys, self.values, self.how))
        if self._valid_in is not programs:
            seen = programs.valid[:, : self.length]  # [B, length]
            if self.ragged.holes:
                seen.copy_(self.valid)
            else:
                seen.fill_(True)
            self._valid_in = programs
        return programs

    def _extend_in_chunks(self, drafter: EagleDrafter, aux: torch.Tensor, next_tokens: torch.Tensor,
                          counts: list[int]):
        """`extend` over many rows (a long prompt), `CATCH_UP_CHUNK` at a time: each chunk reads the rows cached
        before it, so the cache and each row's result are those of one pass, with a bounded peak. A row's result
        (logits [B, Vd], hidden [B, 1, H]) is the chunk's that holds its last new row."""
        n = next_tokens.shape[1]
        logits = hidden = None
        for start in range(0, n, CATCH_UP_CHUNK):
            end = min(start + CATCH_UP_CHUNK, n)
            part = [min(max(c - start, 0), end - start) for c in counts]  # each row's rows in this chunk
            if not any(part):
                break
            # (eager: a long catch-up's last short chunk is no round's catch-up, and its logits keep the drafter's dtype)
            got = self._extend_eager(drafter, aux[:, start:end], next_tokens[:, start:end], part)
            if logits is None:
                logits, hidden = got
                continue
            ends_here = [b for b, c in enumerate(counts) if start < c <= end]
            if ends_here:  # (host-decided rows: one asynchronous copy of their indices)
                idx = to_device(torch.tensor(ends_here, dtype=torch.long), logits.device)
                logits[idx], hidden[idx] = got[0][idx], got[1][idx]
        return logits, hidden

    def level_mask(self, ancestors: torch.Tensor | None, k: int, fed_width: int) -> torch.Tensor | None:
        """[B, 1, k, length + fed + k] bool (a view of the kept mask): each of a level's k frontier nodes sees its
        row's real rows, its fed ancestors and itself (`ancestors` [B, k, fed + k] on the device; None: a chain,
        which sees every fed row). None for a chain over a cache without holes (the plain causal layout)."""
        if ancestors is None and not self.ragged.holes:
            return None
        if ancestors is None:  # a chain over a cache with holes: every fed row is an ancestor
            ancestors = torch.ones(self.rows, k, fed_width + k, dtype=torch.bool, device=self.keys.device)
        return self._mask.view(ancestors, self.length, self.valid, torch.bool)

    def select(self, rows: list[int]) -> None:
        """Keep these rows of the batch (finished rows leave); their holes go at the next compaction."""
        self._valid_in = None
        if self.slots is not None:
            index = to_device(torch.tensor(rows), self.keys.device)
            self.slots.select(index)
            self.ragged.select(rows, index)
            self._mask.select(index)
        else:
            self.ragged.counts = [self.ragged.counts[b] for b in rows]
        self.positions = [self.positions[b] for b in rows]

    def compact(self) -> None:
        """Drop the holes once they are worth it (`eagle_hf.speculation.ragged`)."""
        if not self.ragged.worth_compacting():
            return
        self.launch_staged()  # (its rows belong in the slots the compaction moves)
        self._valid_in = None
        index = self.ragged.compact()  # [B, W]
        self._mask.drop()
        self.slots.compact(index)


def _graphs_storage(graphs: LevelGraphs, owner: weakref.ref) -> Callable:
    """Allocates a drafter cache's keys and values (both ``[B, kv_heads, C, d]``) from the fixed-shape levels'
    storage, C rounded up to a power of two: calls of nearby lengths share it and its graphs. (The cache is held
    weakly: its buffers must not keep it alive, so a call's cache is freed when the call returns.)"""

    def allocate(shapes: tuple, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, c, d = shapes[0]
        return graphs.buffers((b, h, 1 << (c - 1).bit_length(), d), like, owner())

    return allocate


def draft_trees(drafter: EagleDrafter, state: DraftState, logits: torch.Tensor, hidden: torch.Tensor,
                depths: list[int], top_k: int, layout: TreeRequest, threshold: float = 0.0, prune: bool = True,
                choose: Chooser | None = None) -> tuple[TreeLayout, torch.Tensor]:
    """Grow every row's draft tree after its last real drafter row and lay it out for the verify, on the device
    (`grow_levels`, then `tree_layout`): nothing is read. logits [B, Vd] and hidden [B, 1, H]: each state row's last
    real row's; depths: each state row's levels (0: it drafts nothing, its tree the root alone).

    Level by level, the `top_k` best frontier nodes (by cumulative log-probability) get `top_k` children each (the
    drafter's top k, or `choose`'s); the best ``sizes[b] - 1`` drafts are kept, closed under ancestors, the
    drafter's greedy chain first. With ``top_k = 1`` this is a chain. `threshold` on the drafter's probability:
    with `prune`, drafts whose *cumulative* probability is below it are dropped (not expanded, not verified);
    without, a draft whose own probability is below it is kept but not expanded (transformers'
    ``assistant_confidence_threshold`` for chains).

    How it runs is a launch: one program over the cache's whole storage (`DraftPrograms.grow`, with the staged
    catch-up first, a batch's holes hidden by the programs' validity buffer) where the levels run at fixed shapes;
    otherwise eagerly at the round's shapes, each level under the kept mask (which hides a batch's holes). The
    request's copy branches are laid out beside the trees' W nodes either way (`with_copies`). Returns the
    `TreeLayout` and the verify positions [B, W (+ C)]. Call it under `torch.no_grad` (the decoding loops do)."""
    min_logp = math.log(threshold) if threshold > 0 else -math.inf
    levels = max(depths, default=0)
    state.reserve(max(levels - 1, 0) * top_k)
    state.steps += max(levels - 1, 0)
    roots = [p - 1 for p in state.positions]  # each row's root position
    if state.graphs is not None and choose is None:
        return state.programs(drafter).grow(logits, hidden, top_k, levels, min_logp, prune, roots, depths,
                                            state.length, layout)
    copy_tokens, copy_bits, copies_first = layout.copy_rows()
    host = pack(hidden.device, base=roots, depth=depths, tokens=layout.roots, position=layout.positions,
                sizes=layout.sizes, **({"copy_tokens": copy_tokens, "copy_bits": copy_bits,
                                        "copies_first": copies_first} if copy_tokens else {}))
    state.launch_staged()
    rows, base, real_len = state.rows, host["base"][:, None], state.length  # [B, 1]

    causal = top_k == 1 and not state.ragged.holes  # (a chain over every slot: the plain causal layout, no mask)

    def forward(feed, tokens, level, tail, fed):
        return state.level_forward(drafter, feed, tokens, (base + level).expand(rows, top_k), real_len + fed,
                                   None if causal else state.level_mask(tail, top_k, fed))

    depth = host["depth"][:, None]  # [B, 1]
    kept = grow_levels(drafter, forward, logits, hidden, top_k, levels, depth, min_logp, prune, choose)
    laid = tree_layout(kept, host["tokens"], top_k, layout.width, min_logp if prune else -math.inf,
                       torch.where(depth > 0, host["sizes"][:, None], 1))
    if copy_tokens:
        c = layout.copy_width
        laid = with_copies(laid, host["copy_tokens"].view(rows, c), host["copy_bits"].view(rows, c, -1),
                           host["copies_first"])
    return laid, host["position"][:, None] + laid.depths


@torch.no_grad()
def draft_tree(drafter: EagleDrafter, state: DraftState, root_token: int, logits: torch.Tensor, hidden: torch.Tensor,
               depth: int, top_k: int, total_tokens: int, threshold: float = 0.0, prune: bool = True) -> DraftTree:
    """`draft_trees` for a single row, read on the host (logits: [1, Vd], hidden: [1, 1, H])."""
    laid, _ = draft_trees(drafter, state, logits, hidden, [depth], top_k,
                          TreeRequest(total_tokens, [root_token], [0], [total_tokens]), threshold, prune)
    return DraftTree.of_lists(*host_trees(laid.host.flatten().tolist(), [root_token])[0])


# ------------------------------------------------------------------ what a drafter keeps between calls
# A drafter's fixed-shape programs and the cache storage they write (rows B, the storage's capacity C read under a
# mask), kept between calls (`LevelGraphs.for_drafter`, weakly per drafter), so that a later call of the same shape
# reuses both: eagerly, a draft level is about thirty kernel launches, which on a GPU take longer than the kernels
# themselves (2.0 ms a level at the Llama-3.1-8B shape on an H200, against a compiled target step of 8 ms).

#: environment variable, a debugging switch of the launch (never of the arithmetic): "off" drafts eagerly; "on" in
#: fixed-shape programs wherever the drafter runs; unset or "auto": in programs on CUDA (CUDA graphs) and where the
#: target's forward is compiled (torch.compile elsewhere, `eagle_hf.programs.how_to_run`), eagerly otherwise
GRAPHS_ENV = "EAGLE_HF_DRAFTER_GRAPHS"
#: programs kept per drafter (least recently used dropped first)
MAX_GRAPHS = 16

_PER_DRAFTER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def wanted(drafter: EagleDrafter, compiled: bool) -> bool:
    """Whether a call drafts in fixed-shape programs (`GRAPHS_ENV`; by default on CUDA and where the target's
    forward is compiled)."""
    setting = os.environ.get(GRAPHS_ENV, "auto").lower()
    if setting in ("off", "0", "false", "none"):
        return False
    if setting in ("on", "1", "true"):
        return True
    return compiled or drafter.fc.weight.device.type == "cuda"


@dataclass
class SlotWriter:
    """New keys and values written at the device slots `slots` [T] of whole buffers ``[B, kv_heads, C, d]``; a
    pass attends over all C columns (its mask says which it reads). Fixed shapes, no host value: capturable."""

    keys: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor  # [T] long

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def extended(self, new: KV) -> KV:
        self.keys.index_copy_(2, self.slots, new.keys)
        self.values.index_copy_(2, self.slots, new.values)
        return KV(self.keys, self.values)


def weights_of(drafter: EagleDrafter) -> tuple:
    """Where the drafter's weights and buffers live now (and the target embedding it borrows), and the setting its
    forward reads: what its graphs read (a compiled program reads the rest of the drafter when it is made,
    `eagle_hf.programs.signature`)."""
    tensors = [*drafter.parameters(), *drafter.buffers()]
    embedding = getattr(drafter, "_target_embedding", None)
    if embedding is not None:
        tensors.append(embedding.weight)
    return (*((t.data_ptr(), t.dtype, t.device) for t in tensors), drafter.config.norm_output)


class LevelGraphs:
    """A drafter's fixed-shape levels and the cache storage they write, kept between calls."""

    def __init__(self, drafter: EagleDrafter):
        self._drafter = weakref.ref(drafter)
        self.weights = weights_of(drafter)
        self.programs: OrderedDict[tuple, object] = OrderedDict()  # the draft programs over its storage
        self.storage: dict[tuple, tuple] = {}  # (shape, dtype, device, mode) -> (keys, values, weakref to owner)

    @classmethod
    def for_drafter(cls, drafter: EagleDrafter) -> LevelGraphs:
        """The drafter's levels; new ones when its weights moved since (a graph replays the memory it captured)."""
        graphs = _PER_DRAFTER.get(drafter)
        if graphs is None or graphs.weights != weights_of(drafter):
            graphs = _PER_DRAFTER[drafter] = cls(drafter)
        return graphs

    def buffers(self, shape: tuple, like: torch.Tensor, owner) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `shape` ``[B, kv_heads, C, d]`` for `owner` (a drafter cache): the storage an
        earlier, finished owner left, else new storage (zeros: columns never written weigh zero, where 0 x a
        stale NaN would not). A storage a live owner holds is not handed to another (threads sharing a drafter)."""
        # (inference-mode tensors cannot be written outside inference mode: kept apart)
        key = (tuple(shape), like.dtype, like.device, torch.is_inference_mode_enabled())
        kept = self.storage.get(key)
        holder = kept[2]() if kept is not None else None
        if kept is not None and (holder is None or holder is owner):
            self.storage[key] = (kept[0], kept[1], weakref.ref(owner))
            return kept[0], kept[1]
        made = (like.new_zeros(shape), like.new_zeros(shape))
        if kept is None:
            self.storage[key] = (*made, weakref.ref(owner))
        return made

    @classmethod
    def kept_tensors(cls, drafter: EagleDrafter) -> list[torch.Tensor]:
        """The device tensors kept for `drafter` between calls (storage and the levels' buffers)."""
        graphs = _PER_DRAFTER.get(drafter)
        if graphs is None:
            return []
        out = [t for keys, values, _ in graphs.storage.values() for t in (keys, values)]
        for program in graphs.programs.values():
            out += program.tensors()
        return out

    def kept(self, key: tuple, make):
        """The fixed-shape object kept under `key` (a program over this drafter's storage: anything with a
        ``tensors()`` method), made by ``make()`` the first time; the least recently used go first."""
        kept = self.programs.get(key)
        if kept is None:
            kept = self.programs[key] = make()
            while len(self.programs) > MAX_GRAPHS:
                self.programs.popitem(last=False)
        self.programs.move_to_end(key)
        return kept


class DraftPrograms:
    """One cache storage's draft programs (rows B, storage ``[B, kv_heads, C, d]``, run `how`), with the buffers
    they share: the last real rows' logits [B, Vd] and hidden states [B, 1, H] that a catch-up writes and the levels
    read (no copy between the two launches)."""

    def __init__(self, drafter: EagleDrafter, keys: torch.Tensor, values: torch.Tensor, how: str):
        rows, capacity = keys.shape[0], keys.shape[2]
        self._drafter, self.keys, self.values, self.how = weakref.ref(drafter), keys, values, how
        self.inference = torch.is_inference_mode_enabled()  # (its buffers are inference tensors, or not)
        self.logits = keys.new_zeros(rows, drafter.lm_head.weight.shape[0], dtype=torch.float32)  # [B, Vd]
        self.hidden = keys.new_zeros(rows, 1, drafter.config.hidden_size, dtype=drafter.fc.weight.dtype)
        self.columns = keys.new_ones(capacity, dtype=torch.long).cumsum(0) - 1  # [C] 0 .. C-1
        # [B, C] which slots each row reads: the catch-ups write their rows', the levels read it (a batch's holes)
        self.valid = keys.new_ones(rows, capacity, dtype=torch.bool)
        self.catch_ups: dict[int, CatchUp] = {}
        self.levels: dict[tuple, Levels] = {}
        self.staged: CatchUp | None = None  # a catch-up written, not launched: it runs with the next levels

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors it keeps (its programs' buffers included)."""
        out = [self.keys, self.values, self.valid, self.logits, self.hidden, self.columns]
        for program in [*self.catch_ups.values(), *self.levels.values()]:
            out += [t for t in program.program.args if isinstance(t, torch.Tensor)]
        return out

    def catch_up(self, aux: torch.Tensor, tokens: torch.Tensor, positions: list[int], counts: list[int], at: int,
                 n: int, stage: bool = False):
        """The round's catch-up (`CatchUp`, n rows a row: a power of two at least m): aux [B, m, A*H_t], tokens
        [B, m], from slot `at`, row b's first ``counts[b]`` real (the rest holes), its first at ``positions[b]``.
        Returns the shared (logits [B, Vd], hidden [B, 1, H]), written by the launch, or with `stage` by the next
        `grow`'s launch (one program: the catch-up, then the levels), and the new rows' validity [B, m] (None: all
        real)."""
        program = self.catch_ups.get(n)
        if program is None:
            program = self.catch_ups[n] = CatchUp(self, n)
        new_valid = program.write(aux, tokens, positions, counts, at)
        if stage:
            self.staged = program
        else:
            self.launch_staged()
            program.program(self._drafter())
        return self.logits, self.hidden, new_valid

    def launch_staged(self) -> None:
        """The staged catch-up on its own (its outputs are read before any levels run)."""
        if self.staged is not None:
            staged, self.staged = self.staged, None
            staged.program(self._drafter())

    def grow(self, logits: torch.Tensor, hidden: torch.Tensor, k: int, levels: int, min_logp: float, prune: bool,
             roots: list[int], depths: list[int], at: int, layout: TreeRequest):
        """The round's levels (`Levels`) from logits [B, Vd] and hidden [B, 1, H] (the catch-up's, or copied in),
        row b's root at position ``roots[b]``, its tree rows from slot `at`: the trees' `TreeLayout`, with the
        request's copy branches beside them, and the verify positions [B, W (+ C)]."""
        key = (k, levels, min_logp, prune, layout.width, layout.copy_width)
        program = self.levels.get(key)
        if program is None:
            program = self.levels[key] = Levels(self, *key)
        staged, self.staged = self.staged, None
        if staged is None:  # (a staged catch-up writes them in the launch)
            for given, shared in ((logits, self.logits), (hidden, self.hidden)):
                if given is not shared:
                    shared.copy_(given)
        return program(roots, depths, at, layout.roots, layout.positions, layout.sizes, *layout.copy_rows(),
                       after=staged)


class CatchUp:
    """A round's catch-up at fixed shapes (n rows a row, a power of two): the taps ``aux`` [B, n, A*H_t] fused and
    the tokens after them [B, n] written at slots ``at .. at+n-1``, each row under a causal mask over the C columns
    it reads, with `ints` = (each row's first position [B], `at`, each row's real rows [B]); a row's rows after its
    real ones are holes (its validity says so) or padding past the round's rows, overwritten by the next pass.
    Writes each row's last real row's draft logits and fed-back hidden state into the shared buffers
    (`catch_up_rows`)."""

    def __init__(self, shared: DraftPrograms, n: int):
        keys, drafter = shared.keys, shared._drafter()
        rows = keys.shape[0]
        self.n = n
        self.aux = keys.new_zeros(rows, n, drafter.fc.weight.shape[1], dtype=drafter.fc.weight.dtype)
        self.tokens = keys.new_zeros(rows, n, dtype=torch.long)  # [B, n]
        self.ints = Ints(2 * rows + 1, keys.device)  # positions [B], at, counts [B]
        self.steps = keys.new_ones(n, dtype=torch.long).cumsum(0) - 1  # [n] 0 .. n-1
        self.program = Program(catch_up_rows, (shared.keys, shared.values, shared.valid, self.aux, self.tokens,
                                               self.ints.tensor, self.steps, shared.columns, shared.logits,
                                               shared.hidden),
                               shared.how, "drafter's catch-up")

    def write(self, aux: torch.Tensor, tokens: torch.Tensor, positions: list[int], counts: list[int],
              at: int) -> torch.Tensor | None:
        """A launch's inputs into the buffers; returns the m new rows' validity [B, m] (None: every row real)."""
        rows, m = tokens.shape
        self.aux[:, :m].copy_(aux)
        self.tokens[:, :m].copy_(tokens)
        self.ints.write([*positions, at, *counts])
        if all(c == m for c in counts):
            return None
        return self.steps[None, :m] < self.ints.tensor[rows + 1 :, None]  # [B, m] (on the device, after the write)


def catch_up_rows(drafter: EagleDrafter, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                  aux: torch.Tensor, tokens: torch.Tensor, ints: torch.Tensor, steps: torch.Tensor,
                  columns: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor) -> None:
    """`CatchUp`'s body: the drafter, its cache storage ``[B, kv_heads, C, d]`` and validity [B, C], the program's
    buffers, and the shared outputs (logits [B, Vd], hidden [B, 1, H]) it writes."""
    rows = tokens.shape[0]
    positions, at, counts = ints[:rows], ints[rows], ints[rows + 1 :]
    slots = steps + at  # [n]
    valid.index_copy_(1, slots, steps[None, :] < counts[:, None])  # [B, n]: row b's first counts[b] rows are real
    causal, own = columns[None, :] <= slots[:, None], columns[None, :] >= slots[:, None]  # [n, C] each
    mask = causal & (valid[:, None, :] | own)  # [B, n, C]: the real rows so far, and itself (a hole too)
    out = drafter.step(drafter.fuse(aux), tokens, positions[:, None] + steps, past=SlotWriter(keys, values, slots),
                       mask=mask[:, None])
    last = (counts - 1).clamp(min=0)[:, None, None]  # [B, 1, 1] each row's last real row (none: meaningless)
    logits.copy_(out.logits.gather(1, last.expand(rows, 1, out.logits.shape[-1]))[:, 0])  # [B, Vd]
    hidden.copy_(out.hidden.gather(1, last.expand(rows, 1, out.hidden.shape[-1])))  # [B, 1, H]


def catch_up_then_grow(drafter: EagleDrafter, catch_up: tuple, levels: tuple):
    """A round's whole drafting as one program: `catch_up_rows` over its arguments `catch_up`, then `grow_trees`
    over `levels` (reading the shared logits and hidden states the catch-up wrote)."""
    catch_up_rows(drafter, *catch_up)
    return grow_trees(drafter, *levels)


class Levels:
    """A round's draft levels at fixed shapes (top-k k, `levels` levels; `grow_levels`) from the shared logits and
    hidden states, with `ints` = (each row's root position [B], its depth [B], the first tree slot `at`): the k
    nodes of level l are written at slots ``at + (l-1)k ..``; each reads its row's real slots before `at` (the
    validity buffer) and its ancestors among the tree rows (`grow_trees`). Output: the trees' layout, W nodes a
    row and C copy nodes beside them (`copies`; their tokens, ancestor bits and order follow in `ints`:
    `with_copies`)."""

    def __init__(self, shared: DraftPrograms, k: int, levels: int, min_logp: float, prune: bool, width: int,
                 copies: int = 0):
        keys = shared.keys
        rows = keys.shape[0]
        self._drafter = shared._drafter  # (a weak reference: the programs and their owner form no cycle)
        # root positions [B], depths [B], at, root tokens [B], verify positions [B], sizes [B], then the copy
        # nodes' tokens [B, C], ancestor bits [B, C, words] and each row's order [B]
        self.ints = Ints(5 * rows + 1 + (rows * copies * (1 + copy_words(copies)) + rows if copies else 0),
                         keys.device)
        steps = keys.new_ones(levels * k, dtype=torch.long).cumsum(0) - 1  # [levels * k] 0 ..
        self.program = Program(grow_trees, (shared.keys, shared.values, shared.valid, shared.logits, shared.hidden,
                                            self.ints.tensor, steps, shared.columns, k, levels, min_logp, prune,
                                            width, copies),
                               shared.how, "drafter's levels")
        self.after: dict[int, Program] = {}  # catch-up rows n -> the catch-up and these levels, one program

    def __call__(self, roots: list[int], depths: list[int], at: int, *layout: list[int],
                 after: CatchUp | None = None):
        """A launch (`after`: a catch-up written to run first, in the same program)."""
        values = [*roots, *depths, at] + [v for part in layout for v in part]  # (the copy rows' lists last)
        self.ints.write(values)
        program = self.program
        if after is not None:
            program = self.after.get(after.n)
            if program is None:
                program = self.after[after.n] = Program(catch_up_then_grow, (after.program.args, self.program.args),
                                                        self.program.how, "drafter's catch-up and levels")
        return program(self._drafter())


def grow_trees(drafter: EagleDrafter, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
               logits: torch.Tensor, hidden: torch.Tensor, ints: torch.Tensor, steps: torch.Tensor,
               columns: torch.Tensor, k: int, levels: int, min_logp: float, prune: bool, width: int,
               copies: int = 0):
    """`Levels`' body: `grow_levels` over the drafter's cache storage (validity [B, C]) from the shared logits and
    hidden states; the trees' `TreeLayout` (W nodes a row, `copies` copy nodes beside them: `with_copies`) and the verify
    positions [B, W (+ copies)]."""
    rows = logits.shape[0]
    base, depth, at = ints[:rows, None], ints[rows : 2 * rows, None], ints[2 * rows]
    past = (valid & (columns < at)[None, :])[:, None, :]  # [B, 1, C] each row's real rows
    block = (columns - at)[None, None, :]  # [1, 1, C] each column's place among the tree rows

    def forward(feed, tokens, level, tail, fed):
        slots = steps[fed : fed + k] + at  # [k]
        inside = (block >= 0) & (block < fed + k)
        seen = tail.gather(2, block.clamp(0, fed + k - 1).expand(rows, k, -1)) & inside  # [B, k, C]
        return drafter.step(feed, tokens, (base + level).expand(rows, k), past=SlotWriter(keys, values, slots),
                            mask=(past | seen)[:, None])

    kept = grow_levels(drafter, forward, logits, hidden, k, levels, depth, min_logp, prune)
    tokens, position, sizes = (ints[2 * rows + 1 + i * rows : 2 * rows + 1 + (i + 1) * rows] for i in range(3))
    # (a chain's draft below the threshold is kept, only not expanded: every eligible candidate is a node)
    layout = tree_layout(kept, tokens, k, width, min_logp if prune else -math.inf,
                         torch.where(depth > 0, sizes[:, None], 1))
    if copies:
        start = 5 * rows + 1
        copy_bits = ints[start + rows * copies : -rows].view(rows, copies, -1)  # [B, C, words]
        layout = with_copies(layout, ints[start : start + rows * copies].view(rows, copies), copy_bits,
                             ints[-rows:])
    return layout, position[:, None] + layout.depths  # [B, W (+ C)] the verify positions
