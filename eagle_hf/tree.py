"""Dynamic draft trees (EAGLE-2 style): build, lay out for one verification forward, accept.

Vocabulary (eagle_spec.md §6.3): `depth` draft levels, `top_k` children expanded per frontier node,
`total_tokens` verified tokens including the root. Node 0 is the root (the last token the target emitted);
nodes 1..N are drafts, parents before children. A chain is the tree with ``top_k=1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .drafting import DraftState
from .modeling import EagleDrafter


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N+1] target ids; tokens[0] is the root
    parents: torch.Tensor  # [N+1] parent node index; parents[0] = -1
    scores: torch.Tensor  # [N+1] cumulative draft log-probability (root 0)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def depths(self) -> torch.Tensor:
        """[N+1] depth of each node (root 0)."""
        d = torch.zeros(self.size, dtype=torch.long)
        for i in range(1, self.size):
            d[i] = d[self.parents[i]] + 1
        return d

    def confidences(self) -> list[float]:
        """Per depth 1..D: the drafter's probability that one of the children of its best node at the depth
        above is right (the sibling mass a tree's verification can accept from)."""
        depths = self.depths()
        out, node = [], 0
        for d in range(1, int(depths.max()) + 1):
            children = [i for i in range(1, self.size) if int(self.parents[i]) == node]
            if not children:
                break
            parent_score = float(self.scores[node])
            out.append(min(1.0, sum(math.exp(float(self.scores[c]) - parent_score) for c in children)))
            node = max(children, key=lambda c: float(self.scores[c]))
        return out

    def ancestor_mask(self) -> torch.Tensor:
        """bool [N+1, N+1]: row i sees node j iff j is i or an ancestor of i."""
        n = self.size
        m = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                m[i, j] = True
                j = int(self.parents[j])
        return m

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node paths (one per leaf), in node order of their leaves."""
        has_child = torch.zeros(self.size, dtype=torch.bool)
        has_child[self.parents[1:]] = True
        out = []
        for leaf in range(self.size):
            if has_child[leaf] and leaf != 0:
                continue
            if leaf == 0 and self.size > 1:
                continue
            path, j = [], leaf
            while j >= 0:
                path.append(j)
                j = int(self.parents[j])
            out.append(path[::-1])
        return out

    def retrieve_indices(self) -> torch.Tensor:
        """[num_leaves, max_depth+1] node paths, padded with -1 (the EAGLE reference's layout)."""
        paths = self.paths()
        width = max(len(p) for p in paths)
        return torch.tensor([p + [-1] * (width - len(p)) for p in paths], dtype=torch.long)


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
    confidence_threshold: float = 0.0,
) -> DraftTree:
    """Expand the top-k children of the best nodes per level by cumulative log-probability, keep the best
    `total_tokens - 1` drafts. logits: [1, Vd] and hidden: [1, 1, H] of the last real drafter row.

    Branches whose cumulative draft probability falls below `confidence_threshold` are pruned: not expanded,
    not verified (a chain's threshold, applied to whole paths)."""
    device = hidden.device
    min_logp = math.log(confidence_threshold) if confidence_threshold > 0 else -math.inf
    real = state.kv
    base = state.length - 1  # position of the last real row
    # candidate tables (node ids are candidate indices + 1; 0 is the root)
    cand_tokens: list[int] = []
    cand_parent: list[int] = []
    cand_score: list[float] = []
    logp = torch.log_softmax(logits.float(), dim=-1)[0]  # [Vd]
    top = torch.topk(logp, top_k)
    frontier = []  # candidate indices whose drafter rows come next
    for lp, idx in zip(top.values.tolist(), drafter.draft_to_target(top.indices).tolist()):
        cand_tokens.append(idx)
        cand_parent.append(0)
        cand_score.append(lp)
        frontier.append(len(cand_tokens) - 1)
    frontier_hidden = hidden.expand(1, len(frontier), hidden.shape[-1])  # each level-1 row reads the root's output
    fed: list[int] = []  # candidates with drafter rows in `tree_kv`, in order
    tree_kv = None
    for level in range(1, depth):
        frontier = [c for c in frontier if cand_score[c] >= min_logp]  # best first, so this keeps a prefix
        if not frontier:
            break
        frontier_hidden = frontier_hidden[:, : len(frontier)]
        k = len(frontier)
        toks = torch.tensor([[cand_tokens[c] for c in frontier]], device=device)  # [1, k]
        pos = torch.full((1, k), base + level, device=device)
        # mask: all real rows, ancestors among fed tree rows, self
        anc = torch.zeros(k, len(fed), dtype=torch.bool)
        fed_index = {c: i for i, c in enumerate(fed)}
        for r, c in enumerate(frontier):
            p = cand_parent[c]
            while p > 0:
                anc[r, fed_index[p - 1]] = True
                p = cand_parent[p - 1]
        mask = torch.cat([torch.ones(k, real.length, dtype=torch.bool), anc, torch.eye(k, dtype=torch.bool)], 1)
        past = real if tree_kv is None else real.append(tree_kv)
        out = drafter.step(frontier_hidden, toks, pos, past=past, mask=mask[None, None].to(device))
        tree_kv = out.kv if tree_kv is None else tree_kv.append(out.kv)
        fed += frontier
        lp = torch.log_softmax(out.logits[0].float(), dim=-1)  # [k, Vd]
        top = torch.topk(lp, top_k, dim=-1)  # [k, top_k]
        parent_scores = torch.tensor([cand_score[c] for c in frontier], device=device)[:, None]
        cum = (parent_scores + top.values).flatten()  # [k * top_k]
        child_tokens = drafter.draft_to_target(top.indices).flatten().tolist()
        first_new = len(cand_tokens)
        for j, (tok, sc) in enumerate(zip(child_tokens, cum.tolist())):
            cand_tokens.append(tok)
            cand_parent.append(frontier[j // top_k] + 1)
            cand_score.append(sc)
        best = torch.topk(cum, min(top_k, cum.numel())).indices.tolist()
        frontier = [first_new + b for b in best]
        frontier_hidden = out.hidden[:, [b // top_k for b in best]]  # [1, k', H]
    # global selection: best total_tokens - 1 candidates, closed under ancestors, parents before children
    n_keep = min(total_tokens - 1, len(cand_tokens))
    # a path's score only falls with depth, so dropping low scores keeps the selection closed under ancestors
    order = sorted((c for c in range(len(cand_tokens)) if cand_score[c] >= min_logp), key=lambda c: (-cand_score[c], c))
    keep: set[int] = set()
    for c in order:
        if len(keep) >= n_keep:
            break
        chain, p = [c], cand_parent[c]
        while p > 0 and (p - 1) not in keep:
            chain.append(p - 1)
            p = cand_parent[p - 1]
        if len(keep) + len(chain) <= n_keep:
            keep.update(chain)
    kept = sorted(keep)
    new_id = {c: i + 1 for i, c in enumerate(kept)}
    tokens = [root_token] + [cand_tokens[c] for c in kept]
    parents = [-1] + [0 if cand_parent[c] == 0 else new_id[cand_parent[c] - 1] for c in kept]
    scores = [0.0] + [cand_score[c] for c in kept]
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores))


def accept_greedy(tree: DraftTree, target_tokens: torch.Tensor) -> list[int]:
    """Longest root path whose drafts equal the target's choice at their parent.

    target_tokens: [N+1] the target's (greedy) token after each node. Returns the accepted node path
    (root first); the bonus token is ``target_tokens[path[-1]]``.
    """
    best: list[int] = [0]
    for path in tree.paths():
        ok = [0]
        for node in path[1:]:
            if int(tree.tokens[node]) != int(target_tokens[ok[-1]]):
                break
            ok.append(node)
        if len(ok) > len(best):
            best = ok
    return best


def accept_sampling(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Lossless acceptance over a deterministic tree (recursive rejection across siblings).

    probs: [N+1, V] the target's processed distribution after each node. At a node with target distribution
    P, each distinct child token x (in node order) is accepted with probability P(x) (its draft probability
    is taken as 1); on rejection P(x) := 0 and P is renormalised before the next sibling. When no child is
    accepted the token is sampled from the residual P. Returns (accepted node path, bonus token).
    """
    children: dict[int, list[int]] = {}
    for i in range(1, tree.size):
        children.setdefault(int(tree.parents[i]), []).append(i)
    node, path = 0, [0]
    while True:
        p = probs[node].clone().double()
        seen = set()
        accepted = None
        for child in children.get(node, []):
            tok = int(tree.tokens[child])
            if tok in seen:
                continue
            seen.add(tok)
            u = torch.rand((), generator=generator, dtype=torch.float64, device=p.device)
            if p.sum() > 0 and u <= p[tok] / p.sum():
                accepted = child
                break
            p[tok] = 0.0
        if accepted is None:
            p = p / p.sum()
            bonus = int(torch.multinomial(p.float(), 1, generator=generator))
            return path, bonus
        path.append(accepted)
        node = accepted
