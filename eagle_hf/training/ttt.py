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

from ..drafter.modeling import KV, EagleDrafter


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


def ttt_unroll(drafter: EagleDrafter, aux: torch.Tensor, input_ids: torch.Tensor, steps: int):
    """Yield `(k, DraftStep)` for the K unrolled TTT steps (rows as in the module docstring)."""
    b, t, _ = aux.shape
    device = aux.device
    positions = torch.arange(t, device=device)[None].expand(b, t)
    hidden = drafter.fuse(aux)  # [B, T, H]
    past: KV | None = None
    for k in range(steps):
        if k + 2 > t:
            break
        # inputs: token x[t+k+1] for row t (zero-padded at the end)
        tokens = F.pad(input_ids[:, k + 1 :], (0, k + 1))  # [B, T]
        mask = None if k == 0 else ttt_mask(t, k, device)
        out = drafter.step(hidden, tokens, positions + k, past=past, mask=mask, compute_logits=False)
        past = out.kv if past is None else past.append(out.kv)
        yield k, out
        hidden = out.hidden


def add_feature_noise(aux: torch.Tensor, scale: float, layers: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Uniform noise on the captured target states (EAGLE's feature augmentation, Li et al. 2024, sec. 4: U(-0.1, 0.1)
    on the target's features so that the drafter learns to read states as imprecise as its own). Here the half-width
    is `scale` times each state's RMS, per token and per captured layer, because the aux layers of one target differ
    in scale by orders of magnitude."""
    b, t, width = aux.shape
    states = aux.float().view(b, t, layers, width // layers)  # [B, T, A, H]
    rms = states.pow(2).mean(-1, keepdim=True).sqrt()  # [B, T, A, 1]
    noise = torch.rand(states.shape, generator=generator, device=aux.device) * 2 - 1  # U(-1, 1)
    return (states + scale * rms * noise).view(b, t, width).to(aux.dtype)


@dataclass
class SoftTargets:
    """The target's distribution over the draft vocabulary, once per batch, at every position whose next token is
    an answer token in the draft vocabulary (every TTT step reads a shifted subset of these positions)."""

    probs: torch.Tensor  # [n, Vd] float32
    argmax: torch.Tensor  # [n] draft ids
    index: torch.Tensor  # [B, T] row of `probs` for position p, -1 where none


def soft_targets(target_final, head_weight, loss_mask, in_draft_vocab) -> SoftTargets:
    b, t = loss_mask.shape
    need = torch.zeros((b, t), dtype=torch.bool, device=loss_mask.device)
    need[:, : t - 1] = loss_mask[:, 1:].bool() & in_draft_vocab[:, 1:]
    with torch.no_grad(), torch.autocast(target_final.device.type, enabled=False):  # bf16 is too coarse here
        logits = target_final[need].float() @ head_weight.float().T  # [n, Vd]
        probs = torch.softmax(logits, dim=-1)
        argmax = logits.argmax(-1)
    index = torch.full((b, t), -1, dtype=torch.long, device=loss_mask.device)
    index[need] = torch.arange(int(need.sum()), device=loss_mask.device)
    return SoftTargets(probs, argmax, index)


class _SoftCrossEntropy(torch.autograd.Function):
    """sum over rows of -sum_v p_v log softmax(z)_v = logsumexp(z) - <p, z> (p sums to 1); the gradient
    softmax(z) - p is formed in one pass in backward, nothing but z and the log-normaliser is kept."""

    @staticmethod
    def forward(ctx, logits, probs):
        z = logits.float()
        lse = torch.logsumexp(z, dim=-1)
        loss = (lse - (probs * z).sum(-1)).sum()
        ctx.save_for_backward(logits, probs, lse)
        return loss

    @staticmethod
    def backward(ctx, grad):
        logits, probs, lse = ctx.saved_tensors
        g = torch.exp(logits.float() - lse[:, None]).sub_(probs).mul_(grad)
        return g.to(logits.dtype), None


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Summed soft-label cross-entropy of `logits` [n, V] against probabilities `probs` [n, V] (fused)."""
    return _SoftCrossEntropy.apply(logits, probs)


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
    fast: bool = True,
    normalisers: list[int] | None = None,  # per step: rows to divide by (default: this batch's, `step_counts`)
) -> TTTOutput:
    """Weighted TTT loss. `fast` (default) computes the target's soft distribution once per batch and uses the
    fused soft cross-entropy; `fast=False` is the plain reference (per step, autograd log-softmax).

    Each step's loss (and accuracy) is a mean over its rows; `normalisers` divides by the rows of a larger batch
    instead, of which this one is a slice: data parallel processes pass the global batch's rows, so that their
    losses sum to the global batch's loss."""
    t = aux.shape[1]
    device = aux.device
    total = aux.new_zeros((), dtype=torch.float32)
    step_losses, step_acc, step_counts = [], [], []
    st = soft_targets(target_final, head_weight, loss_mask, in_draft_vocab) if fast else None
    for k, out in ttt_unroll(drafter, aux, input_ids, steps):
        # targets: distribution at position t+k+1, valid where token t+k+2 is an assistant token in the draft vocab
        valid = loss_mask[:, k + 2 :].bool() & in_draft_vocab[:, k + 2 :]  # [B, T-k-2] for rows 0..T-k-3
        rows = out.normed[:, : t - k - 2][valid]  # [n, H] only rows that carry a loss
        n = rows.shape[0] if normalisers is None else normalisers[k]
        logits = drafter.lm_head(rows)
        if fast:
            idx = st.index[:, k + 1 : t - 1][valid]
            loss_k = soft_cross_entropy(logits, st.probs[idx]) / max(n, 1)
            with torch.no_grad():
                acc = (logits.argmax(-1) == st.argmax[idx]).sum().item() / max(n, 1)
        else:
            with torch.autocast(device.type, enabled=False):  # bf16 logits are too coarse for soft targets
                tgt = target_final[:, k + 1 : t - 1][valid].float() @ head_weight.float().T  # [n, Vd] target logits
            logq = torch.log_softmax(logits.float(), dim=-1)
            p = torch.softmax(tgt.float(), dim=-1)
            loss_k = -(p * logq).sum(-1).sum() / max(n, 1)
            with torch.no_grad():
                acc = (logq.argmax(-1) == tgt.argmax(-1)).sum().item() / max(n, 1)
        total = total + (decay**k) * loss_k
        step_losses.append(float(loss_k.detach()))
        step_acc.append(acc)
        step_counts.append(n)
    return TTTOutput(total, step_losses, step_acc, step_counts)


def step_counts(loss_mask: torch.Tensor, in_draft_vocab: torch.Tensor, steps: int) -> list[int]:
    """Rows that carry a loss at each of the `steps` unrolled steps of `ttt_loss` (its default normalisers)."""
    t = loss_mask.shape[1]
    valid = loss_mask.bool() & in_draft_vocab  # [B, T]
    return [int(valid[:, k + 2 :].sum()) if k + 2 <= t else 0 for k in range(steps)]


def chain_lengths(correct: torch.Tensor) -> torch.Tensor:
    """Accepted drafts of greedy chains: the number of leading True per row of `correct` ``[N, K]``."""
    return correct.long().cumprod(dim=-1).sum(dim=-1)


@dataclass
class TTTEval:
    loss_sums: list[float]  # per step: sum over valid rows of the soft cross-entropy
    correct: list[int]  # per step: draft argmax == target argmax over the draft vocabulary
    counts: list[int]  # per step: valid rows (next token an answer token in the draft vocab)
    chain_sum: torch.Tensor  # [B] per sample: accepted drafts summed over its counted rows
    chain_rows: torch.Tensor  # [B] per sample: counted rows (the token after the row's input is an answer token)


@torch.no_grad()
def ttt_evaluate(
    drafter: EagleDrafter,
    aux: torch.Tensor,
    target_final: torch.Tensor,
    head_weight: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    in_draft_vocab: torch.Tensor,
    target_argmax: torch.Tensor,  # [B, T] the target's argmax over its FULL vocabulary at each position
    steps: int = 7,
    chain: int = 5,
) -> TTTEval:
    """Held-out loss, per-step accuracy and greedy-chain acceptance in one TTT unroll.

    Row t drafts the tokens at t+2, t+3, ... (its input pairs the features at t with token t+1). Draft k of row t
    is correct when the draft's argmax, mapped to a target id, equals the target's argmax at position t+k+1;
    the row's chain accepts the leading correct drafts among the first `chain`, cut where the answer ends. The
    unroll feeds data tokens, which are the accepted ones as long as the drafts are correct and the data is the
    target's greedy output (for other data it is an approximation).
    """
    b, t, _ = aux.shape
    lm = loss_mask.bool()
    n_rows = max(t - 2, 0)
    correct_all = torch.zeros((b, n_rows, chain), dtype=torch.bool, device=aux.device)
    loss_sums, correct, counts = [], [], []
    for k, out in ttt_unroll(drafter, aux, input_ids, max(steps, chain)):
        rows_n = t - k - 2
        ans = lm[:, k + 2 :]  # [B, rows_n] rows whose drafted token is an answer token
        logits = drafter.lm_head(out.normed[:, :rows_n][ans]).float()  # [m, Vd]
        if k < steps:
            iv = in_draft_vocab[:, k + 2 :][ans]
            tgt = target_final[:, k + 1 : t - 1][ans][iv].float() @ head_weight.float().T
            logq = torch.log_softmax(logits[iv], dim=-1)
            p = torch.softmax(tgt, dim=-1)
            loss_sums.append(float(-(p * logq).sum()))
            correct.append(int((logq.argmax(-1) == tgt.argmax(-1)).sum()))
            counts.append(int(iv.sum()))
        if k < chain:
            drafted = drafter.draft_to_target(logits.argmax(-1))
            ok = torch.zeros_like(ans)
            ok[ans] = drafted == target_argmax[:, k + 1 : t - 1][ans]
            correct_all[:, :rows_n, k] = ok
    counted = lm[:, 2:]  # [B, T-2]
    lengths = chain_lengths(correct_all) * counted  # [B, T-2]
    return TTTEval(loss_sums, correct, counts, lengths.sum(-1).cpu(), counted.sum(-1).cpu())
