"""Draft vocabulary: the most frequent assistant tokens, as the `d2t` / `t2d` maps (eagle_spec.md §7.6)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass
class DraftVocab:
    d2t: torch.Tensor  # [Vd] int64 offsets: target_id = draft_id + d2t[draft_id]
    t2d: torch.Tensor  # [V] bool: target id is in the draft vocabulary
    coverage: float  # share of counted assistant tokens the draft vocabulary contains

    @property
    def target_ids(self) -> torch.Tensor:
        return torch.arange(self.d2t.shape[0]) + self.d2t


def count_tokens(samples, vocab_size: int) -> torch.Tensor:
    """Frequency of every target id over the loss-masked (assistant) positions."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        ids = s["input_ids"].long()[s["loss_mask"].bool()]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> DraftVocab:
    vocab_size = counts.shape[0]
    if draft_vocab_size > vocab_size:
        raise ValueError(
            f"draft_vocab_size={draft_vocab_size} is larger than the target vocabulary ({vocab_size}); "
            "choose at most the target's size."
        )
    if draft_vocab_size <= 0:
        raise ValueError("draft_vocab_size must be positive.")
    # most frequent first; ties (including never-seen ids) broken by the lower id
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    used = torch.tensor(sorted(order[:draft_vocab_size]), dtype=torch.long)
    d2t = used - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    total = int(counts.sum())
    coverage = float(counts[used].sum()) / total if total else 0.0
    logger.info("Draft vocabulary of %d tokens covers %.2f%% of assistant tokens", draft_vocab_size, 100 * coverage)
    return DraftVocab(d2t=d2t, t2d=t2d, coverage=coverage)
