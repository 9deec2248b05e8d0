"""Drafting with an EAGLE head: the drafter's cache of real rows, and the one function that grows a draft tree.

Real rows (prompt and accepted tokens) are always computed from the target's own hidden states; speculative
rows live only for one round and are dropped before the next (eagle_spec.md §5.4). A chain is the tree with
``top_k = 1``; with a sampling chooser its drafts keep the exact distributions they were drawn from.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .modeling import KV, EagleDrafter
from .tree import DraftTree


@dataclass
class DraftState:
    """The drafter's cache of real rows. Row i sits at position ``start + i`` (``start`` > 0 when the target's
    cache already held a prefix the drafter never saw)."""

    kv: KV | None = None
    start: int = 0

    @property
    def length(self) -> int:
        return 0 if self.kv is None else self.kv.length

    @property
    def next_position(self) -> int:
        return self.start + self.length

    def extend(self, drafter: EagleDrafter, aux: torch.Tensor, next_tokens: torch.Tensor):
        """Add real rows. aux: [1, n, A*H_t] target taps; next_tokens: [1, n] the token after each row.

        Returns the last row's draft logits ``[1, Vd]`` and fed-back hidden state ``[1, 1, H]``.
        """
        n = next_tokens.shape[1]
        first = self.next_position
        positions = torch.arange(first, first + n, device=next_tokens.device)[None]  # [1, n]
        out = drafter.step(drafter.fuse(aux), next_tokens, positions, past=self.kv, compute_logits=False)
        self.kv = out.kv if self.kv is None else self.kv.append(out.kv)
        return drafter.lm_head(out.normed[:, -1]), out.hidden[:, -1:]  # only the last row drafts


@dataclass
class Choice:
    """Children chosen for k expanded nodes, c each."""

    tokens: torch.Tensor  # [k, c] target-vocabulary ids
    logp: torch.Tensor  # [k, c] log-probability of each child under the distribution it was chosen from
    q_logits: torch.Tensor | None = None  # [k, c, V] the processed logits a *sampled* child was drawn from


#: chooses the children of k nodes from their draft logits [k, Vd]; `paths` are the nodes' draft tokens below
#: the root (for logits processors that read the prefix)
Chooser = Callable[[torch.Tensor, list[list[int]]], Choice]


def top_k_chooser(drafter: EagleDrafter, top_k: int) -> Chooser:
    """The deterministic chooser of EAGLE-2 trees (and greedy chains): the top_k drafts by probability."""

    def choose(logits: torch.Tensor, paths: list[list[int]]) -> Choice:
        top = torch.topk(torch.log_softmax(logits.float(), dim=-1), top_k, dim=-1)  # [k, top_k]
        return Choice(drafter.draft_to_target(top.indices), top.values)

    return choose


@torch.no_grad()
def draft_tree(
    drafter: EagleDrafter,
    state: DraftState,
    root_token: int,
    logits: torch.Tensor,
    hidden: torch.Tensor,
    depth: int,
    top_k: int,
    total_tokens: int,
    threshold: float = 0.0,
    choose: Chooser | None = None,
    prune: bool = True,
) -> DraftTree:
    """Grow a draft tree after the last real drafter row (logits: [1, Vd], hidden: [1, 1, H]).

    Level by level, the `top_k` best frontier nodes (by cumulative log-probability) get `top_k` children each
    from `choose` (default: the drafter's top_k); the best ``total_tokens - 1`` drafts are kept, closed under
    ancestors. With ``top_k = 1`` this is a chain of `depth` drafts.

    `threshold` on the drafter's probability: with `prune`, drafts whose *cumulative* probability is below it are
    dropped (not expanded, not verified); without, a draft whose own probability is below it is kept but not
    expanded (transformers' ``assistant_confidence_threshold`` for chains).
    """
    choose = choose or top_k_chooser(drafter, top_k)
    device = hidden.device
    min_logp = math.log(threshold) if threshold > 0 else -math.inf
    real, base = state.kv, state.next_position - 1  # position of the last real row
    # candidate tables: node ids are candidate indices + 1 (0 is the root)
    cand_tokens: list[int] = []
    cand_parent: list[int] = []
    cand_score: list[float] = []
    cand_own: list[float] = []  # a candidate's own (conditional) log-probability
    cand_q: list[torch.Tensor | None] = []

    def add(choice: Choice, parents: list[int], parent_scores: list[float]) -> list[int]:
        """Append the chosen children of `parents` (node ids); returns their candidate indices, best first."""
        first = len(cand_tokens)
        for r, parent in enumerate(parents):
            for c in range(choice.tokens.shape[1]):
                cand_tokens.append(int(choice.tokens[r, c]))
                cand_parent.append(parent)
                own = float(choice.logp[r, c])
                cand_own.append(own)
                cand_score.append(parent_scores[r] + own)
                cand_q.append(None if choice.q_logits is None else choice.q_logits[r, c])
        new = list(range(first, len(cand_tokens)))
        return sorted(new, key=lambda i: -cand_score[i])

    def path(c: int) -> list[int]:
        out = []
        while c >= 0:
            out.append(cand_tokens[c])
            c = cand_parent[c] - 1
        return out[::-1]

    def expandable(c: int) -> bool:
        return (cand_score[c] if prune else cand_own[c]) >= min_logp

    frontier = add(choose(logits, [[]]), [0], [0.0])[:top_k]
    frontier_hidden = hidden.expand(1, len(frontier), hidden.shape[-1])  # level-1 rows read the root's output
    fed: list[int] = []  # candidates with drafter rows in `tree_kv`, in order
    tree_kv = None
    for level in range(1, depth):
        rows = [r for r, c in enumerate(frontier) if expandable(c)]
        frontier, frontier_hidden = [frontier[r] for r in rows], frontier_hidden[:, rows]
        if not frontier:
            break
        k = len(frontier)
        toks = torch.tensor([[cand_tokens[c] for c in frontier]], device=device)  # [1, k]
        pos = torch.full((1, k), base + level, device=device)
        mask = None  # a chain: every fed row is an ancestor, the plain causal layout
        if k > 1 or (fed and any(_ancestors(c, cand_parent) != fed for c in frontier)):
            fed_index = {c: i for i, c in enumerate(fed)}
            anc = torch.zeros(k, len(fed), dtype=torch.bool)  # [k, fed] ancestors among fed tree rows
            for r, c in enumerate(frontier):
                for a in _ancestors(c, cand_parent):
                    anc[r, fed_index[a]] = True
            real_len = 0 if real is None else real.length
            mask = torch.cat([torch.ones(k, real_len, dtype=torch.bool), anc, torch.eye(k, dtype=torch.bool)], 1)
            mask = mask[None, None].to(device)  # [1, 1, k, real + fed + k]
        past = tree_kv if real is None else (real if tree_kv is None else real.append(tree_kv))
        out = drafter.step(frontier_hidden, toks, pos, past=past, mask=mask)
        tree_kv = out.kv if tree_kv is None else tree_kv.append(out.kv)
        fed += frontier
        choice = choose(out.logits[0], [path(c) for c in frontier])  # out.logits: [1, k, Vd]
        new = add(choice, [c + 1 for c in frontier], [cand_score[c] for c in frontier])
        frontier = new[:top_k]
        by_parent = {c: r for r, c in enumerate(fed[-k:])}
        frontier_hidden = out.hidden[:, [by_parent[cand_parent[c] - 1] for c in frontier]]  # [1, k', H]
    return _select(cand_tokens, cand_parent, cand_score, cand_q, root_token, total_tokens, min_logp if prune else -math.inf)


def _ancestors(c: int, cand_parent: list[int]) -> list[int]:
    """Candidate indices of `c`'s draft ancestors, root-most first."""
    out, p = [], cand_parent[c]
    while p > 0:
        out.append(p - 1)
        p = cand_parent[p - 1]
    return out[::-1]


def _select(cand_tokens, cand_parent, cand_score, cand_q, root_token, total_tokens, min_logp) -> DraftTree:
    """The best ``total_tokens - 1`` candidates, closed under ancestors, parents before children."""
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
    kept = sorted(keep)
    new_id = {c: i + 1 for i, c in enumerate(kept)}
    tokens = [root_token] + [cand_tokens[c] for c in kept]
    parents = [-1] + [0 if cand_parent[c] == 0 else new_id[cand_parent[c] - 1] for c in kept]
    scores = [0.0] + [cand_score[c] for c in kept]
    q_logits = None
    if kept and cand_q[kept[0]] is not None:
        rows = [cand_q[c] for c in kept]
        q_logits = torch.cat([torch.zeros_like(rows[0])[None], torch.stack(rows)])  # [N+1, V]
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores), q_logits)
