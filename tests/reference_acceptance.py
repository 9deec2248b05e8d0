"""The tests' reference acceptance: recursive rejection sampling over a tree, one node at a time on the host, for
deterministic and sampled drafts alike (`accept_sampling`), and `verify` from a tree's target logits. The library
accepts deterministic drafts from values drawn on the device in one read (`eagle_hf.speculation.tree.sampling_draws`
and `accept_drawn`); a sampled chain's drafts go through transformers' assisted loop. The tests check both against
the target's distribution and against this reference."""

from __future__ import annotations

import torch

from eagle_hf.speculation.tree import DraftTree, accept_greedy, draw


def accept_sampling(tree: DraftTree, probs: torch.Tensor, q_logits: torch.Tensor | None = None,
                    generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Lossless acceptance over a tree of deterministic and sampled drafts (recursive rejection across siblings).

    probs: [N+1, V] the target's processed distribution after each node; q_logits: [N+1, V] the processed logits
    each sampled draft was drawn from (row 0 unused; a deterministic draft among sampled ones has a one-hot row),
    None: every draft deterministic. At a node with target distribution P, its children are tried in node order:
    child x proposed with distribution q (one-hot on x for a deterministic draft) is accepted with probability
    min(1, P(x)/q(x)); on rejection P := normalise(max(P - q, 0)) before the next sibling (for a deterministic
    draft: P(x) := 0). When no child is accepted the recovered token is drawn from the residual P. Returns
    (accepted node path, bonus or recovered token)."""
    node, path = 0, [0]
    while True:
        p = probs[node].double().clone()
        p = p / p.sum()
        tried: set[int] = set()
        accepted = None
        for child in tree.children(node):
            tok = int(tree.tokens[child])
            sampled = q_logits is not None
            if tok in tried and not sampled:
                continue  # a deterministic duplicate was rejected already: P(tok) is 0 now
            tried.add(tok)
            if sampled:
                q = torch.softmax(q_logits[child].double(), -1).to(p.device)
            else:
                q = torch.zeros_like(p)
                q[tok] = 1.0
            u = torch.rand((), generator=generator, dtype=torch.float64, device=p.device)
            if q[tok] > 0 and u * q[tok] <= p[tok]:
                accepted = child
                break
            residual = torch.clamp(p - q, min=0.0)
            if residual.sum() <= 0:  # P was q exactly: nothing left to recover from; keep P
                continue
            p = residual / residual.sum()
        if accepted is None:
            return path, int(draw(p[None], generator)[0])
        path.append(accepted)
        node = accepted


def verify(tree: DraftTree, node_logits: torch.Tensor, do_sample: bool) -> tuple[list[int], int]:
    """Accept from processed target logits [N+1, V]: (accepted node path, root first; the token that follows)."""
    if do_sample:
        return accept_sampling(tree, torch.softmax(node_logits.float(), -1))
    chosen = node_logits.argmax(-1).tolist()
    path = accept_greedy(tree, chosen)
    return path, chosen[path[-1]]
