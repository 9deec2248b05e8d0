"""Drafting with an EAGLE head: the drafter's cache of real rows, and the one function that grows a draft tree.

Real rows (prompt and accepted tokens) are always computed from the target's own hidden states; speculative
rows live only for one round and are dropped before the next (eagle_spec.md §5.4). A chain is the tree with
``top_k = 1``; with a sampling chooser its drafts keep the exact distributions they were drawn from.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .modeling import KV, EagleDrafter
from .ragged import packed_index, worth_compacting
from .tree import DraftTree


@dataclass
class DraftState:
    """The drafter's cache of real rows for the rows of a batch: keys and values ``[B, kv_heads, L, d]``.

    Row b's slot i holds a real row where ``valid[b, i]`` (None: every slot, as with a single row; a batch's rows
    read different numbers of rows per round, and a shorter row's extra slots are holes, see `eagle_hf.ragged`).
    Row b's next real row sits at position ``positions[b]`` (> 0 at first when the target's cache already held a
    prefix the drafter never saw)."""

    kv: KV | None = None
    valid: torch.Tensor | None = None  # [B, L] bool, or None: no holes
    positions: list[int] = field(default_factory=lambda: [0])

    @property
    def rows(self) -> int:
        return len(self.positions)

    @property
    def length(self) -> int:
        """Slots per row (real rows and holes)."""
        return 0 if self.kv is None else self.kv.length

    @property
    def next_position(self) -> int:
        """A single row's next position (a batch's rows: `positions`)."""
        return self.positions[0]

    def slots(self, rows: list[int] | None = None) -> tuple[KV | None, torch.Tensor | None]:
        """The cache and its validity for some rows (all by default)."""
        if rows is None or rows == list(range(self.rows)):
            return self.kv, self.valid
        index = torch.tensor(rows, device=self.kv.keys.device)
        kv = KV(self.kv.keys.index_select(0, index), self.kv.values.index_select(0, index))
        return kv, None if self.valid is None else self.valid.index_select(0, index)

    def extend(self, drafter: EagleDrafter, aux: torch.Tensor, next_tokens: torch.Tensor,
               counts: list[int] | None = None):
        """Add real rows: row b reads ``aux[b, :counts[b]]`` (target taps [B, n, A*H_t]), each with the token after
        it (``next_tokens`` [B, n]); default: all n. One drafter forward for the batch.

        Returns each row's last new row's draft logits ``[B, Vd]`` and fed-back hidden state ``[B, 1, H]``
        (meaningless for a row that read nothing)."""
        rows, n = next_tokens.shape
        device = next_tokens.device
        counts = [n] * rows if counts is None else counts
        steps = torch.arange(n, device=device)
        positions = torch.tensor(self.positions, device=device)[:, None] + steps  # [B, n]
        new_valid = steps[None] < torch.tensor(counts, device=device)[:, None]  # [B, n]
        mask = None  # every slot real and every row full: the plain causal layout
        if self.valid is not None or not bool(new_valid.all()):
            past = torch.ones(rows, self.length, dtype=torch.bool, device=device) if self.valid is None else self.valid
            own = torch.ones(n, n, dtype=torch.bool, device=device).tril() & new_valid[:, None, :]  # [B, n, n]
            own |= torch.eye(n, dtype=torch.bool, device=device)  # a padding row sees itself: no empty softmax
            mask = torch.cat([past[:, None, :].expand(rows, n, self.length), own], 2)[:, None]  # [B, 1, n, L + n]
        out = drafter.step(drafter.fuse(aux), next_tokens, positions, past=self.kv, mask=mask, compute_logits=False)
        self.kv = out.kv if self.kv is None else self.kv.append(out.kv)
        if mask is not None:
            past = torch.ones(rows, self.length - n, dtype=torch.bool, device=device) if self.valid is None else self.valid
            self.valid = torch.cat([past, new_valid], 1)
        self.positions = [p + c for p, c in zip(self.positions, counts)]
        last = torch.tensor([max(c, 1) - 1 for c in counts], device=device)  # [B] each row's last new row
        pick = torch.arange(rows, device=device)
        self.compact()
        return drafter.lm_head(out.normed[pick, last]), out.hidden[pick, last][:, None]

    def select(self, rows: list[int]) -> None:
        """Keep these rows of the batch (finished rows leave); slots no remaining row reads are dropped."""
        if self.kv is not None:
            self.kv, self.valid = self.slots(rows)
        self.positions = [self.positions[b] for b in rows]
        if self.kv is None:
            return
        if self.valid is not None:
            read = self.valid.any(0)  # [L]
            if not bool(read.all()):
                index = read.nonzero()[:, 0]
                self.kv = KV(self.kv.keys.index_select(2, index), self.kv.values.index_select(2, index))
                self.valid = self.valid[:, read]
            if bool(self.valid.all()):
                self.valid = None

    def compact(self) -> None:
        """Drop the holes once they are worth it (`eagle_hf.ragged`)."""
        if self.valid is None or not worth_compacting(self.valid):
            return
        index, self.valid = packed_index(self.valid)
        b, h, _, d = self.kv.keys.shape
        gather = index[:, None, :, None].expand(b, h, index.shape[1], d)
        self.kv = KV(self.kv.keys.gather(2, gather), self.kv.values.gather(2, gather))


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


class Candidates:
    """One row's drafts so far; node ids are candidate indices + 1 (0 is the root)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.parent: list[int] = []  # node id of each candidate's parent
        self.score: list[float] = []  # cumulative log-probability
        self.own: list[float] = []  # the candidate's own (conditional) log-probability
        self.q: list[torch.Tensor | None] = []  # the distribution a sampled candidate was drawn from

    def add(self, choice: Choice, parents: list[int], parent_scores: list[float]) -> list[int]:
        """Append the chosen children of `parents` (node ids); returns their candidate indices, best first."""
        first = len(self.tokens)
        for r, parent in enumerate(parents):
            for c in range(choice.tokens.shape[1]):
                own = float(choice.logp[r, c])
                self.tokens.append(int(choice.tokens[r, c]))
                self.parent.append(parent)
                self.own.append(own)
                self.score.append(parent_scores[r] + own)
                self.q.append(None if choice.q_logits is None else choice.q_logits[r, c])
        return sorted(range(first, len(self.tokens)), key=lambda i: -self.score[i])

    def path(self, c: int) -> list[int]:
        """Draft tokens from below the root down to candidate `c`."""
        return [self.tokens[a] for a in _ancestors(c, self.parent)] + [self.tokens[c]]


@torch.no_grad()
def draft_trees(
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
) -> list[DraftTree]:
    """Grow a draft tree after the last real drafter row of each of `rows` (default: every row of `state`), with one
    drafter forward per level for all of them. logits: [R, Vd] and hidden: [R, 1, H], each row's last real row's.

    Level by level, the `top_k` best frontier nodes (by cumulative log-probability) get `top_k` children each
    from the row's chooser (default: the drafter's top_k); the best ``total_tokens - 1`` drafts are kept, closed
    under ancestors. With ``top_k = 1`` this is a chain of `depth` drafts.

    `threshold` on the drafter's probability: with `prune`, drafts whose *cumulative* probability is below it are
    dropped (not expanded, not verified); without, a draft whose own probability is below it is kept but not
    expanded (transformers' ``assistant_confidence_threshold`` for chains).
    """
    rows = list(range(state.rows)) if rows is None else rows
    choosers = [c or top_k_chooser(drafter, top_k) for c in (choosers or [None] * len(rows))]
    device = hidden.device
    min_logp = math.log(threshold) if threshold > 0 else -math.inf
    real, real_valid = state.slots(rows)
    real_len = 0 if real is None else real.length
    base = [state.positions[b] - 1 for b in rows]  # position of each row's last real row
    cands = [Candidates() for _ in rows]
    frontier = [cands[r].add(choosers[r](logits[r : r + 1], [[]]), [0], [0.0])[:top_k] for r in range(len(rows))]
    parent_row = [[0] * len(f) for f in frontier]  # where each frontier node's parent output is: level 1, the root's
    parent_out = hidden  # [R, k, H] the outputs parents were fed back from
    fed: list[list[int]] = [[] for _ in rows]  # per row: candidates with drafter rows in `tree_kv`, by slot
    tree_kv = None
    for level in range(1, max(depths)):
        for r, c_r in enumerate(cands):  # expand only what may grow
            keep = [i for i, c in enumerate(frontier[r])
                    if level < depths[r] and (c_r.score[c] if prune else c_r.own[c]) >= min_logp]
            frontier[r], parent_row[r] = [frontier[r][i] for i in keep], [parent_row[r][i] for i in keep]
        k = max(len(f) for f in frontier)
        if k == 0:
            break
        toks = torch.zeros(len(rows), k, dtype=torch.long, device=device)  # [R, k] (padding: token 0, masked)
        feed = parent_out.new_zeros(len(rows), k, parent_out.shape[-1])  # [R, k, H]
        for r, f in enumerate(frontier):
            toks[r, : len(f)] = torch.tensor([cands[r].tokens[c] for c in f], device=device)
            feed[r, : len(f)] = parent_out[r, parent_row[r]]
        pos = torch.tensor(base, device=device)[:, None] + level  # [R, 1]
        mask = _level_mask(cands, frontier, fed, k, real_len, real_valid, device)
        past = tree_kv if real is None else (real if tree_kv is None else real.append(tree_kv))
        out = drafter.step(feed, toks, pos.expand(len(rows), k), past=past, mask=mask)
        tree_kv = out.kv if tree_kv is None else tree_kv.append(out.kv)
        for r, f in enumerate(frontier):
            fed[r] += f + [-1] * (k - len(f))  # padding slots are nobody's ancestors
            if not f:
                continue
            choice = choosers[r](out.logits[r, : len(f)], [cands[r].path(c) for c in f])  # out.logits: [R, k, Vd]
            new = cands[r].add(choice, [c + 1 for c in f], [cands[r].score[c] for c in f])
            frontier[r] = new[:top_k]
            parent_row[r] = [f.index(cands[r].parent[c] - 1) for c in frontier[r]]
        parent_out = out.hidden  # [R, k, H]
    return [_select(c.tokens, c.parent, c.score, c.q, root, total, min_logp if prune else -math.inf)
            for c, root, total in zip(cands, roots, total_tokens)]


def _level_mask(cands, frontier, fed, k, real_len, real_valid, device) -> torch.Tensor | None:
    """[R, 1, k, real + fed + k] bool: each frontier node sees its row's real rows, its fed ancestors and itself;
    None for one row's chain over a cache without holes (every fed row an ancestor: the plain causal layout)."""
    rows, width = len(frontier), len(fed[0])
    if rows == 1 and k == 1 and real_valid is None and _ancestors(frontier[0][0], cands[0].parent) == fed[0]:
        return None
    anc = torch.zeros(rows, k, width, dtype=torch.bool)  # [R, k, fed] ancestors among fed tree rows
    for r, f in enumerate(frontier):
        slot = {c: i for i, c in enumerate(fed[r]) if c >= 0}
        for i, c in enumerate(f):
            for a in _ancestors(c, cands[r].parent):
                anc[r, i, slot[a]] = True
    real = torch.ones(rows, real_len, dtype=torch.bool) if real_valid is None else real_valid.cpu()
    own = torch.eye(k, dtype=torch.bool).expand(rows, k, k)
    return torch.cat([real[:, None, :].expand(rows, k, real_len), anc, own], 2)[:, None].to(device)


@torch.no_grad()
def draft_tree(drafter: EagleDrafter, state: DraftState, root_token: int, logits: torch.Tensor, hidden: torch.Tensor,
               depth: int, top_k: int, total_tokens: int, threshold: float = 0.0, choose: Chooser | None = None,
               prune: bool = True) -> DraftTree:
    """`draft_trees` for a single row (logits: [1, Vd], hidden: [1, 1, H])."""
    return draft_trees(drafter, state, [root_token], logits, hidden, [depth], top_k, [total_tokens], threshold,
                       [choose], prune)[0]


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
