"""Drafting with an EAGLE head: the drafter's KV cache of real rows, and chain drafting on top of it.

Real rows (prompt and accepted tokens) are always computed from the target's own hidden states; speculative
rows live only for one round and are dropped before the next (eagle_spec.md §5.4).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .modeling import KV, EagleDrafter


@dataclass
class DraftState:
    """The drafter's cache of real rows; row t sits at position t."""

    kv: KV | None = None

    @property
    def length(self) -> int:
        return 0 if self.kv is None else self.kv.length

    def extend(self, drafter: EagleDrafter, aux: torch.Tensor, next_tokens: torch.Tensor):
        """Add real rows. aux: [1, n, A*H_t] target taps; next_tokens: [1, n] the token after each row.

        Returns the last row's draft logits ``[1, Vd]`` and fed-back hidden state ``[1, 1, H]``.
        """
        n = next_tokens.shape[1]
        start = self.length
        positions = torch.arange(start, start + n, device=next_tokens.device)[None]  # [1, n]
        out = drafter.step(drafter.fuse(aux), next_tokens, positions, past=self.kv, compute_logits=False)
        self.kv = out.kv if self.kv is None else self.kv.append(out.kv)
        return drafter.lm_head(out.normed[:, -1]), out.hidden[:, -1:]  # only the last row drafts


#: chooses the next draft token from draft-vocabulary logits [1, Vd]; returns (target id [1], processed
#: target-vocabulary logits [1, V] or None, probability of the chosen token as a float)
Chooser = Callable[[torch.Tensor, list[int]], tuple[torch.Tensor, torch.Tensor | None, float]]


def draft_chain(
    drafter: EagleDrafter,
    state: DraftState,
    logits: torch.Tensor,
    hidden: torch.Tensor,
    num_tokens: int,
    choose: Chooser,
    confidence_threshold: float = 0.0,
) -> tuple[list[int], list[torch.Tensor], list[float]]:
    """Draft up to `num_tokens` tokens after the last real row (a tree with top-k 1).

    logits: [1, Vd] of the last real row; hidden: [1, 1, H]. Returns target ids, when sampling the processed
    target-vocabulary logits each draft was sampled from, and the drafter's probability of each draft.
    """
    tokens: list[int] = []
    q_logits: list[torch.Tensor] = []
    probs: list[float] = []
    past = state.kv
    position = state.length - 1
    device = hidden.device
    for j in range(num_tokens):
        token, q, prob = choose(logits, tokens)
        tokens.append(int(token))
        probs.append(prob)
        if q is not None:
            q_logits.append(q)
        if j == num_tokens - 1 or prob < confidence_threshold:
            break
        position += 1
        ids = torch.tensor([[tokens[-1]]], device=device)
        out = drafter.step(hidden, ids, torch.tensor([[position]], device=device), past=past)
        past = past.append(out.kv)
        logits, hidden = out.logits[:, -1], out.hidden
    return tokens, q_logits, probs
