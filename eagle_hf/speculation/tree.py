"""`DraftTree`: the drafts of one round, laid out for one verification forward.

Vocabulary (eagle_spec.md §6.3): `depth` draft levels, `top_k` children expanded per frontier node,
`total_tokens` verified tokens including the root. Node 0 is the root (the last token the target emitted);
nodes 1..N are drafts, parents before children. A chain is the tree with ``top_k=1``. Built by
`eagle_hf.speculation.drafting.draft_trees`, accepted by `eagle_hf.speculation.verification`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

#: the sources a draft node can come from (bits of `DraftTree.sources`; a node both proposed carries both)
EAGLE, COPY = 1, 2
SOURCE_NAMES = {EAGLE: "eagle", COPY: "copy"}


#: the parents and scores of every root-only tree (read only: a tree's tensors are never written in place)
_ROOT_PARENTS, _ROOT_SCORES = torch.tensor([-1]), torch.zeros(1)


def most_nodes(depth: int, top_k: int, total_tokens: int) -> int:
    """The most nodes a tree of `depth` levels holds, the root included: top_k candidates at depth 1, top_k**2 at
    each further depth (the children of the top_k nodes kept there), at most `total_tokens`."""
    return min(total_tokens, 1 + top_k + (depth - 1) * top_k * top_k) if depth > 0 else 1


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N+1] target ids; tokens[0] is the root
    parents: torch.Tensor  # [N+1] parent node index; parents[0] = -1
    scores: torch.Tensor  # [N+1] cumulative draft log-probability (root 0)
    q_logits: torch.Tensor | None = None  # [N+1, V] processed logits each *sampled* draft was drawn from (row 0
    # unused); None for deterministic (top-k) drafts; a deterministic draft among sampled ones has a one-hot row
    sources: torch.Tensor | None = None  # [N+1] bits EAGLE | COPY of who proposed each node; None: all EAGLE

    @classmethod
    def root(cls, token: int) -> DraftTree:
        """The tree of a plain step: the root alone (the target decodes one token). Its host lists are given (a
        plain round builds one per row: nothing to read back)."""
        tree = cls(torch.tensor([token]), _ROOT_PARENTS, _ROOT_SCORES)
        tree.__dict__["host"] = _HostTree([token], [-1], [0.0], [EAGLE], [[]], [0])
        return tree

    @classmethod
    def of_lists(cls, tokens: list[int], parents: list[int], scores: list[float],
                 sources: list[int] | None = None) -> DraftTree:
        """A deterministic tree from host lists (node 0 the root, parents before children; `sources`: who proposed
        each node, default the drafter)."""
        tree = cls(torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores),
                   sources=None if sources is None else torch.tensor(sources, dtype=torch.uint8))
        tree.__dict__["host"] = _HostTree.of_lists(tokens, parents, tree.scores.tolist(), sources)  # (as a tree's own)
        return tree

    @functools.cached_property
    def host(self) -> _HostTree:
        """The tree as Python lists (a tree lives on the host; its tensors are read once, here)."""
        return _HostTree.of(self)

    def source(self, node: int) -> int:
        return self.host.sources[node]

    def graft(self, branches: list[list[int]], logp: list[list[float]], at: list[int] | None = None) -> DraftTree:
        """This tree plus deterministic COPY branches below the root (or below node ``at[b]`` for branch b); a
        branch token that is already a child is shared (and marked as proposed by both). logp: each branch
        token's assumed log-probability (added to its parent's score)."""
        tokens, parents = self.tokens.tolist(), self.parents.tolist()
        scores, sources = self.scores.tolist(), [self.source(i) for i in range(self.size)]
        q_rows = list(self.q_logits) if self.q_logits is not None else None
        child = {(parents[i], tokens[i]): i for i in range(1, len(tokens))}
        for b, (branch, branch_logp) in enumerate(zip(branches, logp)):
            node = 0 if at is None else at[b]
            for tok, lp in zip(branch, branch_logp):
                if (node, tok) in child:
                    node = child[(node, tok)]
                    sources[node] |= COPY
                    continue
                tokens.append(tok), parents.append(node), scores.append(scores[node] + lp), sources.append(COPY)
                if q_rows is not None:  # a deterministic proposal among sampled ones: one-hot q
                    row = torch.full_like(q_rows[0], -1e9)
                    row[tok] = 0.0
                    q_rows.append(row)
                node = child[(node, tok)] = len(tokens) - 1
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores),
                         None if q_rows is None else torch.stack(q_rows), torch.tensor(sources, dtype=torch.uint8))

    def first(self, n: int) -> DraftTree:
        """The tree of its first `n` nodes (a node's parent comes before it: a prefix is a tree)."""
        if n >= self.size:
            return self
        return DraftTree(self.tokens[:n], self.parents[:n], self.scores[:n],
                         None if self.q_logits is None else self.q_logits[:n],
                         None if self.sources is None else self.sources[:n])

    @property
    def num_drafts(self) -> int:
        return self.size - 1

    def path_tokens(self, node: int) -> list[int]:
        """The draft tokens from the root (excluded) down to `node` (included)."""
        tokens = self.host.tokens
        return [tokens[n] for n in self.host.path(node)[1:]]

    def children(self, node: int) -> list[int]:
        return self.host.children[node]

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def depths(self) -> torch.Tensor:
        """[N+1] depth of each node (root 0)."""
        return torch.tensor(self.host.depths)

    def confidences(self) -> list[float]:
        """Per depth 1..D: the drafter's probability that one of the children of its best node at the depth
        above is right (the sibling mass a tree's verification can accept from)."""
        scores, out, node = self.host.scores, [], 0
        while children := self.children(node):
            out.append(min(1.0, sum(math.exp(scores[c] - scores[node]) for c in children)))
            node = max(children, key=lambda c: scores[c])
        return out

    def ancestor_mask(self) -> torch.Tensor:
        """bool [N+1, N+1]: row i sees node j iff j is i or an ancestor of i."""
        n = self.size
        rows = [[False] * n for _ in range(n)]
        for i in range(n):
            for j in self.host.path(i):
                rows[i][j] = True
        return torch.tensor(rows, dtype=torch.bool)

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node paths (one per leaf), in node order of their leaves."""
        h = self.host
        if self.size == 1:
            return [[0]]
        return [h.path(leaf) for leaf in range(1, self.size) if not h.children[leaf]]

    def retrieve_indices(self) -> torch.Tensor:
        """[num_leaves, max_depth+1] node paths, padded with -1 (the EAGLE reference's layout)."""
        paths = self.paths()
        width = max(len(p) for p in paths)
        return torch.tensor([p + [-1] * (width - len(p)) for p in paths], dtype=torch.long)


@dataclass
class _HostTree:
    """A `DraftTree` as Python lists, with each node's children and depth and its path from the root."""

    tokens: list[int]
    parents: list[int]
    scores: list[float]
    sources: list[int]
    children: list[list[int]]
    depths: list[int]

    @classmethod
    def of(cls, tree: DraftTree) -> _HostTree:
        return cls.of_lists(tree.tokens.tolist(), tree.parents.tolist(), tree.scores.tolist(),
                            None if tree.sources is None else tree.sources.tolist())

    @classmethod
    def of_lists(cls, tokens: list[int], parents: list[int], scores: list[float],
                 sources: list[int] | None = None) -> _HostTree:
        children: list[list[int]] = [[] for _ in parents]
        depths = [0] * len(parents)
        for i in range(1, len(parents)):  # parents before children
            children[parents[i]].append(i)
            depths[i] = depths[parents[i]] + 1
        return cls(tokens, parents, scores, [EAGLE] * len(parents) if sources is None else sources, children, depths)

    def path(self, node: int) -> list[int]:
        """Node ids from the root down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]
