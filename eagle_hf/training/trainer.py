"""Drafter training loop: AdamW, warm-up + cosine, gradient clipping, bf16 autocast, checkpoints and resume."""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..modeling import EagleDrafter
from .ttt import ttt_loss
from .vocab import DraftVocab

logger = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"
LOG_FILE = "training_log.jsonl"


@dataclass
class TrainConfig:
    ttt_steps: int = 7
    step_decay: float = 0.8
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_ratio: float = 0.02
    min_lr_ratio: float = 0.05
    max_grad_norm: float = 0.5
    epochs: float = 2.0
    max_steps: int | None = None
    tokens_per_batch: int = 2048
    max_seq_len: int = 1024
    eval_every: int = 200
    save_every: int = 100
    eval_fraction: float = 0.02
    seed: int = 0
    bf16: bool = True
    max_minutes: float | None = None  # stop (after a checkpoint) when the wall-clock budget is spent
    extra: dict = field(default_factory=dict)


def make_batches(lengths: list[int], tokens_per_batch: int, seed: int) -> list[list[int]]:
    """Group sample indices of similar length so that batch_size * max_len <= tokens_per_batch; shuffled."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, cur, cur_max = [], [], 0
    for i in order:
        new_max = max(cur_max, lengths[i])
        if cur and new_max * (len(cur) + 1) > tokens_per_batch:
            batches.append(cur)
            cur, new_max = [], lengths[i]
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    random.Random(seed).shuffle(batches)
    return batches


def collate(samples, indices, max_len, head_weight, t2d, device):
    """Pad a batch (right padding) and compute the target's logits over the draft vocabulary."""
    seqs = [samples[i] for i in indices]
    t = min(max(s["input_ids"].shape[0] for s in seqs), max_len)
    b = len(seqs)
    a_dim, h_dim = seqs[0]["aux"].shape[-1], seqs[0]["final"].shape[-1]
    ids = torch.zeros((b, t), dtype=torch.long)
    aux = torch.zeros((b, t, a_dim), dtype=torch.bfloat16)
    final = torch.zeros((b, t, h_dim), dtype=torch.bfloat16)
    mask = torch.zeros((b, t), dtype=torch.bool)
    for j, s in enumerate(seqs):
        n = min(s["input_ids"].shape[0], t)
        ids[j, :n] = s["input_ids"][:n].long()
        aux[j, :n] = s["aux"][:n]
        final[j, :n] = s["final"][:n]
        mask[j, :n] = s["loss_mask"][:n].bool()
    ids = ids.to(device)
    return ids, aux.to(device), final.to(device), mask.to(device), t2d.to(device)[ids]


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    warm = max(1, int(total * cfg.warmup_ratio))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(drafter, samples, indices, cfg, head_weight, t2d, device) -> dict:
    drafter.eval()
    sums, counts = None, None
    for batch in make_batches([min(samples[i]["input_ids"].shape[0], cfg.max_seq_len) for i in indices], cfg.tokens_per_batch, 0):
        ids, aux, final, mask, in_vocab = collate(samples, [indices[i] for i in batch], cfg.max_seq_len, head_weight, t2d, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            out = ttt_loss(drafter, aux, final, head_weight, ids, mask, in_vocab, cfg.ttt_steps, cfg.step_decay)
        acc = [a * c for a, c in zip(out.step_accuracy, out.step_counts)]
        sums = acc if sums is None else [x + y for x, y in zip(sums, acc)]
        counts = out.step_counts if counts is None else [x + y for x, y in zip(counts, out.step_counts)]
    drafter.train()
    acc = [s / max(c, 1) for s, c in zip(sums or [], counts or [])]
    # expected accepted drafts in a chain ~ sum_k prod_{j<=k} acc_j (an estimate; the real loop is the benchmark)
    expected, running = 1.0, 1.0
    for a in acc:
        running *= a
        expected += running
    return {"eval_step_accuracy": acc, "eval_est_acceptance_length": expected}


def train(
    drafter: EagleDrafter,
    samples: list[dict],
    vocab: DraftVocab,
    head_weight: torch.Tensor,  # [Vd, H_t] the target's lm_head rows of the draft vocabulary
    out_dir: str | Path,
    cfg: TrainConfig,
    device: torch.device | str = "cpu",
) -> dict:
    """Train `drafter` in place; resumes from ``out_dir/train_state.pt`` when present."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(device)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    all_idx = list(range(len(samples)))
    rng.shuffle(all_idx)
    n_eval = max(1, int(len(all_idx) * cfg.eval_fraction)) if len(all_idx) > 1 else 0
    eval_idx, train_idx = all_idx[:n_eval], all_idx[n_eval:] or all_idx
    lengths = [min(samples[i]["input_ids"].shape[0], cfg.max_seq_len) for i in train_idx]
    per_epoch = len(make_batches(lengths, cfg.tokens_per_batch, 0))

    from accelerate import Accelerator

    # Under `accelerate launch` (DDP/FSDP) every process trains on its own slice of each global step's batches;
    # in a single process this is a no-op wrapper.
    acc = Accelerator(cpu=device.type == "cpu")
    device = acc.device if acc.num_processes > 1 else device
    world, rank = acc.num_processes, acc.process_index
    per_epoch = max(1, per_epoch // world)
    total = cfg.max_steps or max(1, int(per_epoch * cfg.epochs))
    drafter.to(device).train()
    objective = TTTObjective(drafter, cfg)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    step = 0
    state_path = out / STATE_FILE
    if state_path.exists():
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        drafter.load_state_dict(state["drafter"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        torch.set_rng_state(state["torch_rng"])
        logger.info("Resuming from %s at step %d of %d", state_path, step, total)
        if acc.is_main_process:
            _truncate_log(out / LOG_FILE, step)  # steps after the checkpoint are redone
    objective, opt = acc.prepare(objective, opt)
    head_weight = head_weight.to(device)
    main = acc.is_main_process
    log = (out / LOG_FILE).open("a") if main else None
    start, seen_tokens = time.perf_counter(), 0
    bar = tqdm(total=total, initial=step, desc="training", unit="step", disable=not main)
    last: dict = {}
    while step < total:
        epoch, offset = divmod(step, per_epoch)
        batches = make_batches(lengths, cfg.tokens_per_batch, cfg.seed + epoch)
        for batch in batches[offset * world + rank :: world]:
            if step >= total:
                break
            ids, aux, final, mask, in_vocab = collate(samples, [train_idx[i] for i in batch], cfg.max_seq_len, head_weight, vocab.t2d, device)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total, cfg)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                loss, step_losses, step_accuracy = objective(aux, final, head_weight, ids, mask, in_vocab)
            opt.zero_grad(set_to_none=True)
            acc.backward(loss)
            grad_norm = float(acc.clip_grad_norm_(params, cfg.max_grad_norm))
            opt.step()
            step += 1
            seen_tokens += int(ids.numel()) * world
            last = {
                "step": step,
                "epoch": step / per_epoch,
                "loss": float(loss.detach()),
                "step_loss": step_losses,
                "step_accuracy": step_accuracy,
                "lr": opt.param_groups[0]["lr"],
                "grad_norm": grad_norm,
                "tokens_per_s": seen_tokens / (time.perf_counter() - start),
            }
            bar.update(1)
            bar.set_postfix(loss=f"{last['loss']:.3f}", acc0=f"{step_accuracy[0]:.2f}" if step_accuracy else "-")
            out_of_time = cfg.max_minutes is not None and (time.perf_counter() - start) > 60 * cfg.max_minutes
            if main and (step % cfg.eval_every == 0 or step == total or out_of_time) and eval_idx:
                last.update(evaluate(drafter, samples, eval_idx, cfg, head_weight, vocab.t2d, device))
                logger.info("step %d eval %s", step, last["eval_step_accuracy"])
            if main:
                log.write(json.dumps(last) + "\n")
                log.flush()
                if step % cfg.save_every == 0 or step == total or out_of_time:
                    save_state(state_path, drafter, opt, step)
            if out_of_time:
                logger.warning("Time budget of %.0f min spent at step %d of %d; resume to continue.", cfg.max_minutes, step, total)
                bar.close()
                if log:
                    log.close()
                return {**last, "finished": False, "total_steps": total}
    bar.close()
    if log:
        log.close()
    acc.wait_for_everyone()
    return {**last, "finished": True, "total_steps": total, "config": asdict(cfg)}


class TTTObjective(torch.nn.Module):
    """The drafter behind one `forward` per optimizer step, so that DDP / FSDP wrappers see the computation."""

    def __init__(self, drafter: EagleDrafter, cfg: TrainConfig):
        super().__init__()
        self.drafter = drafter
        self.cfg = cfg

    def forward(self, aux, final, head_weight, ids, mask, in_vocab):
        out = ttt_loss(self.drafter, aux, final, head_weight, ids, mask, in_vocab, self.cfg.ttt_steps, self.cfg.step_decay)
        return out.loss, out.step_losses, out.step_accuracy


def _truncate_log(path: Path, step: int) -> None:
    if path.exists():
        rows = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        path.write_text("".join(r + "\n" for r in rows))


def save_state(path: Path, drafter, opt, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "step": step, "torch_rng": torch.get_rng_state()},
        tmp,
    )
    tmp.replace(path)


@torch.no_grad()
def initialise_from_target(drafter: EagleDrafter, samples, vocab: DraftVocab, head_weight, final_norm_weight, max_rows: int = 20000):
    """Warm start (training_notes.md): copy the target's lm_head rows and final norm, zero the layer's output
    projections, and fit `fc` by least squares so that the drafter starts out predicting the next position."""
    drafter.lm_head.weight.copy_(head_weight.to(drafter.lm_head.weight.dtype))
    drafter.norm.weight.copy_(final_norm_weight.to(drafter.norm.weight.dtype))
    drafter.midlayer.self_attn.o_proj.weight.zero_()
    drafter.midlayer.mlp.down_proj.weight.zero_()
    xs, ys = [], []
    rows = 0
    for s in samples:
        n = s["input_ids"].shape[0]
        if n < 3:
            continue
        xs.append(s["aux"][: n - 2].float())
        ys.append(s["final"][1 : n - 1].float())
        rows += n - 2
        if rows >= max_rows:
            break
    x = torch.cat(xs)[:max_rows]
    w = final_norm_weight.float().cpu()
    w = torch.where(w.abs() < 1e-3, torch.full_like(w, 1e-3), w)  # norm weights may be negative
    y = torch.cat(ys)[:max_rows] / w
    if drafter.fc_norm is not None:
        chunks = x.chunk(len(drafter.fc_norm), dim=-1)
        x = torch.cat([c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + drafter.config.rms_norm_eps) for c in chunks], -1)
    # ridge regression: the taps are highly collinear (every sample starts with the same system prompt)
    x64, y64 = x.double(), y.double()
    gram = x64.T @ x64  # [A*H_t, A*H_t]
    ridge = 1e-3 * gram.diagonal().mean()
    sol = torch.linalg.solve(gram + ridge * torch.eye(gram.shape[0], dtype=gram.dtype), x64.T @ y64)  # [A*H_t, H]
    drafter.fc.weight.copy_(sol.T.to(drafter.fc.weight.dtype).to(drafter.fc.weight.device))
