"""The host's tree growth, level by level: the reference the device's trees are checked against node for node.

`reference_trees` grows each row's tree on the host from the drafter's choices, read once a level (the way eagle_hf
grew trees before they were grown and laid out on the device, `eagle_hf.speculation.drafting.draft_trees`): the
best ``total_tokens - 1`` candidates by cumulative log-probability, closed under ancestors, the drafter's greedy
chain first, then in drafting order. It runs the drafter's levels itself (`DraftState.level_forward` under the
kept masks), so it is also a second, independent driver of the drafter's cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from eagle_hf.drafter.modeling import EagleDrafter
from eagle_hf.programs import pack
from eagle_hf.speculation.drafting import Choice, DraftState, top_k_choice
from eagle_hf.speculation.tree import DraftTree

#: chooses the children of k nodes from their draft logits [k, Vd]; `paths` are the nodes' draft tokens below
#: the root (for logits processors that read the prefix)
Chooser = Callable[[torch.Tensor, list[list[int]]], Choice]


def read_choices(choices: list[Choice]) -> list[tuple[list[list[int]], list[list[float]]]]:
    """Per choice: its tokens and log-probabilities as host lists, all read in one device-to-host copy."""
    flat = torch.cat([t for c in choices for t in (c.tokens.reshape(-1).double(), c.logp.reshape(-1).double())])
    values, out, at = flat.tolist(), [], 0
    for c in choices:
        k, n = c.tokens.shape[0], c.tokens.numel()
        width = n // k if k else 0
        tokens = [[int(v) for v in values[at + i * width : at + (i + 1) * width]] for i in range(k)]
        logp = [values[at + n + i * width : at + n + (i + 1) * width] for i in range(k)]
        out.append((tokens, logp))
        at += 2 * n
    return out


class Candidates:
    """One row's drafts so far, on the host; node ids are candidate indices + 1 (0 is the root)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.parent: list[int] = []  # node id of each candidate's parent
        self.score: list[float] = []  # cumulative log-probability
        self.own: list[float] = []  # the candidate's own (conditional) log-probability
        self.depth: list[int] = []  # 1 for the root's children

    def add(self, tokens: list[list[int]], logp: list[list[float]], parents: list[int],
            parent_scores: list[float]) -> list[int]:
        """Append the chosen children of `parents` (node ids; per parent its tokens and their log-probabilities);
        returns their candidate indices, best first."""
        first = len(self.tokens)
        for r, parent in enumerate(parents):
            depth = 1 if parent == 0 else self.depth[parent - 1] + 1
            for tok, own in zip(tokens[r], logp[r]):
                self.tokens.append(tok)
                self.parent.append(parent)
                self.own.append(own)
                self.score.append(parent_scores[r] + own)
                self.depth.append(depth)
        return sorted(range(first, len(self.tokens)), key=lambda i: -self.score[i])

    def path(self, c: int) -> list[int]:
        """Draft tokens from below the root down to candidate `c`."""
        return [self.tokens[a] for a in _ancestors(c, self.parent)] + [self.tokens[c]]


@dataclass
class _Growth:
    """One row's tree while it grows: its candidates, the nodes to expand next (`frontier`), where each of their
    parents' drafter outputs sits in the last level's output (`parent_slot`), and the candidates fed to the drafter
    so far (`fed`, -1 for padding slots; in the drafter cache's order after the real rows)."""

    depth: int  # levels to grow (0: the row drafts nothing this round, its frontier empty)
    chooser: Chooser | None = None
    cands: Candidates = field(default_factory=lambda: Candidates())
    frontier: list[int] = field(default_factory=list)
    parent_slot: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)

    def start(self, chosen: tuple, top_k: int) -> None:
        """The root's children (the first level, from the catch-up's logits)."""
        self.frontier = self.cands.add(*chosen, [0], [0.0])[:top_k]
        self.parent_slot = [0] * len(self.frontier)

    def prune(self, level: int, prune: bool, min_logp: float) -> None:
        """Keep the frontier nodes that may grow at `level`: below the row's depth, and (`prune`: cumulative,
        else own) log-probability at least `min_logp`."""
        c = self.cands
        keep = [i for i, n in enumerate(self.frontier)
                if level < self.depth and (c.score[n] if prune else c.own[n]) >= min_logp]
        self.frontier, self.parent_slot = [self.frontier[i] for i in keep], [self.parent_slot[i] for i in keep]

    def grow(self, chosen: tuple, top_k: int) -> None:
        """The frontier's chosen children become the next frontier (the best `top_k`)."""
        f, c = self.frontier, self.cands
        self.frontier = c.add(*chosen, [n + 1 for n in f], [c.score[n] for n in f])[:top_k]
        self.parent_slot = [f.index(c.parent[n] - 1) for n in self.frontier]


@torch.no_grad()
def reference_trees(
    drafter: EagleDrafter,
    state: DraftState,
    roots: list[int],
    logits: torch.Tensor,
    hidden: torch.Tensor,
    depths: list[int],
    top_k: int,
    total_tokens: list[int],
    threshold: float = 0.0,
    choosers: list[Chooser | None] | None = None,
    prune: bool = True,
    rows: list[int] | None = None,
):
    """Grow a draft tree after the last real drafter row of each of `rows` (default: every row of `state`), with one
    drafter forward and one device-to-host read per level for all of them. logits: [B, Vd] and hidden: [B, 1, H],
    every state row's last real row's (a row not in `rows` keeps an empty frontier). roots, depths,
    total_tokens, choosers: per row of `rows`.

    Level by level, the `top_k` best frontier nodes (by cumulative log-probability) get `top_k` children each
    from the row's chooser (default: the drafter's top_k, for all rows at once); the best ``total_tokens - 1``
    drafts are kept, closed under ancestors. With ``top_k = 1`` this is a chain of `depth` drafts.

    `threshold` on the drafter's probability: with `prune`, drafts whose *cumulative* probability is below it are
    dropped (not expanded, not verified); without, a draft whose own probability is below it is kept but not
    expanded (transformers' ``assistant_confidence_threshold`` for chains).

    """
    rows = list(range(state.rows)) if rows is None else rows
    at = {b: i for i, b in enumerate(rows)}  # state row -> index in `rows`
    growth = [_Growth(depths[at[b]], choosers[at[b]] if choosers else None) if b in at else _Growth(0)
              for b in range(state.rows)]
    min_logp = math.log(threshold) if threshold > 0 else -math.inf
    real_len = state.length
    drafting = [b for b, g in enumerate(growth) if g.depth > 0]
    state.launch_staged()  # (the host chooses from the catch-up's logits)
    chosen = _choose(drafter, top_k, growth, {b: logits[b : b + 1] for b in drafting}, logits[:, None],
                     {b: [[]] for b in drafting})
    for b in drafting:
        growth[b].start(chosen[b], top_k)
    parent_out = hidden  # [B, k, H] the outputs parents were fed back from
    state.reserve((max(depths, default=1) - 1) * top_k)
    base = None  # [B, 1] each row's root position, on the device
    for level in range(1, max(depths, default=0)):
        for g in growth:  # expand only what may grow
            g.prune(level, prune, min_logp)
        if not any(g.frontier for g in growth):
            break
        out, base = _level_step(drafter, state, growth, parent_out, top_k, level, base, real_len)
        growing = [b for b, g in enumerate(growth) if g.frontier]
        chosen = _choose(drafter, top_k, growth, {b: out.logits[b, : len(growth[b].frontier)] for b in growing},
                         out.logits, {b: [growth[b].cands.path(c) for c in growth[b].frontier] for b in growing})
        for b in growing:
            growth[b].grow(chosen[b], top_k)
        parent_out = out.hidden  # [B, k, H]
    return [_select(growth[b].cands, root, total, min_logp if prune else -math.inf)
            for b, root, total in zip(rows, roots, total_tokens)]


def _level_step(drafter, state: DraftState, growth: list[_Growth], parent_out: torch.Tensor, k: int, level: int,
                base: torch.Tensor | None, real_len: int):
    """One drafter forward over every row's frontier at `level` (padded to `k` nodes a row: every level's step has
    the shape [B, k], so a captured step, a CUDA graph, never sees a new shape; padding slots are nobody's
    ancestors), fed the parents' outputs `parent_out` [B, k', H]. Returns the step's output and `base`, each
    row's root position [B, 1] on the device (copied with the first level's layout)."""
    host = pack(parent_out.device, **_level_layout(growth, k, base is None and state.positions))
    if base is None:
        base = host.pop("base")[:, None]  # [B, 1]
    feed = parent_out.gather(1, host["slot"][..., None].expand(len(growth), k, parent_out.shape[-1]))  # [B, k, H]
    mask = state.level_mask(host.get("ancestors"), k, len(growth[0].fed))
    out = state.level_forward(drafter, feed, host["tokens"], (base + level).expand(len(growth), k),
                              real_len + len(growth[0].fed), mask)
    state.steps += 1
    for g in growth:
        g.fed += g.frontier + [-1] * (k - len(g.frontier))
    return out, base


def _choose(drafter, top_k, growth: list[_Growth], logits_of: dict, all_logits: torch.Tensor, paths_of: dict) -> dict:
    """Each growing row's children of its frontier nodes (from ``logits_of[b]`` [k_b, Vd]; `all_logits` [B, k, Vd]
    are every row's at once; ``paths_of[b]``: each node's draft tokens below the root), read in one device-to-host
    copy: row -> (tokens, log-probabilities) per expanded node. Rows with the default chooser are chosen
    together."""
    growing = list(logits_of)
    default = [b for b in growing if growth[b].chooser is None]
    custom = [b for b in growing if growth[b].chooser is not None]
    choices = [growth[b].chooser(logits_of[b], paths_of[b]) for b in custom]
    if default:  # every row's at once, read as one block (no per-row slices on the device)
        batch = top_k_choice(drafter, all_logits, top_k)  # [B, k, top_k]
        width = batch.tokens.shape[1]
        choices.append(Choice(batch.tokens.flatten(0, 1), batch.logp.flatten(0, 1)))  # [B * k, top_k]
    read = read_choices(choices) if choices else []
    out = {b: (tokens, logp) for b, (tokens, logp) in zip(custom, read)}
    if default:
        tokens, logp = read[-1]
        for b in default:
            rows = slice(b * width, b * width + len(paths_of[b]))
            out[b] = (tokens[rows], logp[rows])
    return out


def _level_layout(growth: list[_Growth], k: int, positions) -> dict:
    """A level's host arrays, copied at once: the frontier's tokens and parent slots [B, k], each node's ancestors
    among the fed tree rows and itself [B, k, fed + k] (None for one row's chain: the plain causal layout), and at
    the first level each row's root position [B] (`positions`: the rows' next real positions)."""
    rows, fed_width = len(growth), len(growth[0].fed)
    out = {"tokens": [[g.cands.tokens[c] for c in g.frontier] + [0] * (k - len(g.frontier)) for g in growth],
           "slot": [g.parent_slot + [0] * (k - len(g.parent_slot)) for g in growth]}
    if positions:
        out["base"] = [p - 1 for p in positions]
    first = growth[0]
    chain = rows == 1 and k == 1 and _ancestors(first.frontier[0], first.cands.parent) == first.fed
    if not chain:  # built in host lists, one tensor at the end (no per-element tensor writes)
        anc = [[[False] * (fed_width + k) for _ in range(k)] for _ in range(rows)]
        for b, g in enumerate(growth):
            slot = {c: i for i, c in enumerate(g.fed) if c >= 0}
            for i, c in enumerate(g.frontier):
                for a in _ancestors(c, g.cands.parent):
                    anc[b][i][slot[a]] = True
            for i in range(k):
                anc[b][i][fed_width + i] = True  # itself (a padding node: only itself)
        out["ancestors"] = torch.tensor(anc, dtype=torch.bool)  # [B, k, fed + k]
    return out


@torch.no_grad()
def reference_tree(drafter: EagleDrafter, state: DraftState, root_token: int, logits: torch.Tensor, hidden: torch.Tensor,
               depth: int, top_k: int, total_tokens: int, threshold: float = 0.0, choose: Chooser | None = None,
               prune: bool = True) -> DraftTree:
    """`reference_trees` for a single row (logits: [1, Vd], hidden: [1, 1, H])."""
    return reference_trees(drafter, state, [root_token], logits, hidden, [depth], top_k, [total_tokens], threshold,
                       [choose], prune)[0]


def _ancestors(c: int, cand_parent: list[int]) -> list[int]:
    """Candidate indices of `c`'s draft ancestors, root-most first."""
    out, p = [], cand_parent[c]
    while p > 0:
        out.append(p - 1)
        p = cand_parent[p - 1]
    return out[::-1]


def greedy_chain(cand_parent: list[int]) -> list[bool]:
    """Which candidates lie on the drafter's greedy chain: each the first child drafted below the root or below
    another on the chain (children are drafted best first). Laid out first, the chain's accepted drafts are the
    tree's first nodes, whose keys and values the target's cache keeps where the verify wrote them."""
    on, first_below = [], set()
    for p in cand_parent:
        on.append(p not in first_below and (p == 0 or on[p - 1]))
        first_below.add(p)
    return on


def _select(cands: Candidates, root_token: int, total_tokens: int, min_logp: float) -> DraftTree:
    """The best ``total_tokens - 1`` candidates, closed under ancestors, the drafter's greedy chain first
    (`greedy_chain`), then in drafting order: parents before children, siblings in the order drafted."""
    cand_tokens, cand_parent, cand_score = cands.tokens, cands.parent, cands.score
    n_keep = min(total_tokens - 1, len(cand_tokens))
    # a path's score only falls with depth, so dropping low scores keeps the selection closed under ancestors
    order = sorted((c for c in range(len(cand_tokens)) if cand_score[c] >= min_logp), key=lambda c: (-cand_score[c], c))
    keep: set[int] = set()
    for c in order:
        if len(keep) >= n_keep:
            break
        chain = [c] + [a for a in _ancestors(c, cand_parent) if a not in keep]
        if len(keep) + len(chain) <= n_keep:
            keep.update(chain)
    greedy = greedy_chain(cand_parent)
    kept = sorted(keep, key=lambda c: (not greedy[c], c))
    new_id = {c: i + 1 for i, c in enumerate(kept)}
    tokens = [root_token] + [cand_tokens[c] for c in kept]
    parents = [-1] + [0 if cand_parent[c] == 0 else new_id[cand_parent[c] - 1] for c in kept]
    scores = [0.0] + [cand_score[c] for c in kept]
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores))


def device_trees(drafter: EagleDrafter, state: DraftState, roots: list[int], logits: torch.Tensor,
                 hidden: torch.Tensor, depths: list[int], top_k: int, total_tokens: list[int], threshold: float = 0.0,
                 prune: bool = True) -> list[DraftTree]:
    """eagle_hf's trees (`draft_trees`: grown and laid out on the device) for every row of `state`, read on the
    host: what `reference_trees` is checked against."""
    from eagle_hf.speculation.drafting import TreeRequest, draft_trees, host_trees

    request = TreeRequest(max(total_tokens), roots, [0] * len(roots), total_tokens)
    with torch.no_grad():
        laid, _ = draft_trees(drafter, state, logits, hidden, depths, top_k, request, threshold, prune)
    return [DraftTree.of_lists(*t) for t in host_trees(laid.host.flatten().tolist(), roots)]
