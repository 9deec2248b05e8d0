"""Verification of a draft tree against the target: logits processing per node, greedy and sampling acceptance.

Vocabulary (as vLLM's): *accepted* drafts, then one token of the target's own: the *bonus* token after the last
accepted draft, or the *recovered* token drawn from the residual distribution when a draft is rejected.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .tree import DraftTree


def process_logits(logits_processor, prefix: torch.Tensor, paths: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
    """Apply the logits processors to each row of `logits` ([n, V]) with ``prefix + paths[row]`` as its input ids.

    Used for the target's logits at every tree node, and for the drafter's logits of every sampled draft, so
    that both follow the exact processing plain `generate()` applies. prefix: [1, T]."""
    if len(logits_processor) == 0:
        return logits
    out = torch.empty_like(logits)
    for i, path in enumerate(paths):
        ids = torch.cat([prefix, torch.tensor([path], dtype=prefix.dtype, device=prefix.device)], 1) if path else prefix
        out[i : i + 1] = logits_processor(ids, logits[i : i + 1])
    return out


def accept_greedy(tree: DraftTree, target_tokens: Sequence[int]) -> list[int]:
    """Longest root path whose drafts equal the target's choice at their parent.

    target_tokens: [N+1] the target's (greedy) token after each node. Returns the accepted node path
    (root first); the bonus token is ``target_tokens[path[-1]]``.
    """
    if tree.size == 1:  # a plain step
        return [0]
    tokens, chosen = tree.tokens.tolist(), [int(t) for t in target_tokens]
    best: list[int] = [0]
    for path in tree.paths():
        ok = [0]
        for node in path[1:]:
            if tokens[node] != chosen[ok[-1]]:
                break
            ok.append(node)
        if len(ok) > len(best):
            best = ok
    return best


def accept_sampling(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Lossless acceptance over a tree of deterministic and sampled drafts (recursive rejection across siblings).

    probs: [N+1, V] the target's processed distribution after each node. At a node with target distribution P,
    its children are tried in node order: child x proposed with distribution q (one-hot on x for a deterministic
    draft; ``softmax(tree.q_logits[child])`` for a sampled one) is accepted with probability min(1, P(x)/q(x));
    on rejection P := normalise(max(P - q, 0)) before the next sibling (for a deterministic draft: P(x) := 0).
    When no child is accepted the recovered token is drawn from the residual P. Returns (accepted node path,
    bonus or recovered token).
    """
    node, path = 0, [0]
    while True:
        p = probs[node].double().clone()
        p = p / p.sum()
        tried: set[int] = set()
        accepted = None
        for child in tree.children(node):
            tok = int(tree.tokens[child])
            sampled = tree.q_logits is not None
            if tok in tried and not sampled:
                continue  # a deterministic duplicate was rejected already: P(tok) is 0 now
            tried.add(tok)
            if sampled:
                q = torch.softmax(tree.q_logits[child].double(), -1).to(p.device)
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
            return path, int(torch.multinomial(p.float(), 1, generator=generator))
        path.append(accepted)
        node = accepted


def verify(tree: DraftTree, node_logits: torch.Tensor, do_sample: bool) -> tuple[list[int], int]:
    """Accept from processed target logits [N+1, V]: (accepted node path, root first; the token that follows)."""
    if do_sample:
        return accept_sampling(tree, torch.softmax(node_logits.float(), -1))
    return verify_greedy(tree, node_logits.argmax(-1).tolist())


def verify_greedy(tree: DraftTree, target_tokens: Sequence[int]) -> tuple[list[int], int]:
    """Greedy acceptance from the target's choice after each node ([N+1]; a batch takes the argmax of all its
    rows' logits at once): (accepted node path, root first; the bonus token)."""
    path = accept_greedy(tree, target_tokens)
    return path, int(target_tokens[path[-1]])
