"""Training-time test (TTT): unroll K drafter steps on the drafter's own hidden states (eagle_spec.md §7.3).

Row t at step k consumes token ``x[t+k+1]`` and the drafter's own step-(k-1) output for row t (step 0: the
fused target taps at t), sits at position ``t+k`` and attends the step-0 rows ``<= t`` plus its own rows of
steps 1..k. It is trained towards the target's distribution at position ``t+k+1`` (over token ``t+k+2``),
restricted to the draft vocabulary, with weight ``decay**k``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..modeling import KV, EagleDrafter


@dataclass
class TTTOutput:
    loss: torch.Tensor  # scalar, weighted sum over steps
    step_losses: list[float]
    step_accuracy: list[float]  # argmax(draft) == argmax(target), over valid positions
    step_counts: list[int]


def ttt_mask(t: int, step: int, device) -> torch.Tensor:
    """bool [1, 1, T, (step+1)*T]: causal over the step-0 block, diagonal over the blocks of steps 1..step."""
    rows = torch.arange(t, device=device)
    blocks = [rows[None, :] <= rows[:, None]]
    eye = rows[None, :] == rows[:, None]
    blocks += [eye] * step
    return torch.cat(blocks, dim=1)[None, None]


def ttt_loss(
    drafter: EagleDrafter,
    aux: torch.Tensor,  # [B, T, A*H_t]
    target_final: torch.Tensor,  # [B, T, H_t] the target's final-normed hidden state at each position
    head_weight: torch.Tensor,  # [Vd, H_t] the target's lm_head rows of the draft vocabulary
    input_ids: torch.Tensor,  # [B, T]
    loss_mask: torch.Tensor,  # [B, T] 1 on assistant tokens (0 on padding)
    in_draft_vocab: torch.Tensor,  # [B, T] bool: token is in the draft vocabulary
    steps: int = 7,
    decay: float = 0.8,
) -> TTTOutput:
    b, t, _ = aux.shape
    device = aux.device
    positions = torch.arange(t, device=device)[None].expand(b, t)
    hidden = drafter.fuse(aux)  # [B, T, H]
    past: KV | None = None
    total = aux.new_zeros((), dtype=torch.float32)
    step_losses, step_acc, step_counts = [], [], []
    for k in range(steps):
        if k + 2 > t:
            break
        # inputs: token x[t+k+1] for row t (zero-padded at the end)
        tokens = F.pad(input_ids[:, k + 1 :], (0, k + 1))  # [B, T]
        mask = None if k == 0 else ttt_mask(t, k, device)
        out = drafter.step(hidden, tokens, positions + k, past=past, mask=mask, compute_logits=False)
        past = out.kv if past is None else past.append(out.kv)
        # targets: distribution at position t+k+1, valid where token t+k+2 is an assistant token in the draft vocab
        valid = loss_mask[:, k + 2 :].bool() & in_draft_vocab[:, k + 2 :]  # [B, T-k-2] for rows 0..T-k-3
        rows = out.normed[:, : t - k - 2][valid]  # [n, H] only rows that carry a loss
        with torch.autocast(device.type, enabled=False):  # bf16 logits are too coarse for soft targets
            tgt = target_final[:, k + 1 : t - 1][valid].float() @ head_weight.float().T  # [n, Vd] target logits
        n = rows.shape[0]
        logq = torch.log_softmax(drafter.lm_head(rows).float(), dim=-1)
        p = torch.softmax(tgt.float(), dim=-1)
        loss_k = -(p * logq).sum(-1).sum() / max(n, 1)
        total = total + (decay**k) * loss_k
        with torch.no_grad():
            acc = (logq.argmax(-1) == tgt.argmax(-1)).sum().item() / max(n, 1)
        step_losses.append(float(loss_k.detach()))
        step_acc.append(acc)
        step_counts.append(n)
        hidden = out.hidden
    return TTTOutput(total, step_losses, step_acc, step_counts)
