"""Drafter training loop: AdamW, warm-up + cosine, gradient clipping, bf16 autocast, checkpoints and resume,
held-out acceptance length and best-checkpoint selection."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import pickle
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..devices import native_bf16
from ..drafter.modeling import EagleDrafter
from ..files import append_line, recover_folder, tensor_bytes, write_file, write_folder
from .distributed import Processes, join_processes
from .report import read_log
from .ttt import add_feature_noise, step_counts, ttt_evaluate, ttt_loss
from .vocab import DraftVocab

logger = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"
LOG_FILE = "training_log.jsonl"
#: what a training state holds (`save_state`, `load_state`)
STATE_KEYS = ("drafter", "optimizer", "step", "torch_rng")


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
    eval_fraction: float = 0.02  # share of conversations held out (by a hash of the prompt: stable as data grows)
    eval_tokens: int = 20000  # answer tokens of the held-out split that each evaluation reads
    eval_chain: int = 5  # drafts per chain for the held-out acceptance length (tau)
    seed: int = 0
    bf16: bool | None = None  # bf16 autocast; None: where the device computes bf16 natively (`native_bf16`)
    max_minutes: float | None = None  # stop (after a checkpoint) when the wall-clock budget is spent
    compile: bool = False  # torch.compile the decoder layer (dynamic shapes; needs a C++ compiler on CPU)
    feature_noise: float = 0.0  # uniform noise on the captured states, half-width x their RMS (0: off; training only)
    stop_after: int | None = None  # stop (after a checkpoint) at this step; the schedule still runs to `max_steps`
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


def prompt_key(sample) -> float:
    """A number in [0, 1) from the conversation's prompt tokens: the held-out split, stable as data is added."""
    ids = sample["input_ids"]
    answer = sample["loss_mask"].nonzero()
    n = int(answer[0]) if answer.numel() else ids.shape[0]
    digest = hashlib.sha1(ids[:n].to(torch.int32).numpy().tobytes()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_heldout(samples, cfg: TrainConfig, greedy: list[bool] | None = None):
    """`(train_idx, eval_idx, heldout_idx)`: conversations whose prompt hashes below `eval_fraction` are held out
    (all answers to one prompt fall on one side); the evaluation reads at most `eval_tokens` answer tokens of them,
    smallest hashes first, from the target's own answers when there are any (not ShareGPT's originals)."""
    keys = [prompt_key(s) for s in samples]
    held = [i for i, k in enumerate(keys) if k < cfg.eval_fraction]
    if not held and len(samples) > 1 and cfg.eval_fraction > 0:
        held = [min(range(len(samples)), key=keys.__getitem__)]
    held_set = set(held)
    train_idx = [i for i in range(len(samples)) if i not in held_set] or list(range(len(samples)))
    pool = [i for i in held if greedy is None or greedy[i]] or held
    eval_idx, tokens = [], 0
    for i in sorted(pool, key=keys.__getitem__):
        if eval_idx and tokens >= cfg.eval_tokens:
            break
        eval_idx.append(i)
        tokens += int(samples[i]["loss_mask"].sum())
    return train_idx, eval_idx, held


@torch.no_grad()
def target_argmax(samples, indices, target_head: torch.Tensor, chunk: int = 256) -> dict[int, torch.Tensor]:
    """The target's argmax over its full vocabulary at every position (only where the next token is an answer
    token; -1 elsewhere), from the captured final hidden states x its lm_head: computed once per run."""
    w = target_head.float()
    out = {}
    for i in indices:
        s = samples[i]
        n = s["input_ids"].shape[0]
        am = torch.full((n,), -1, dtype=torch.long)
        need = torch.zeros(n, dtype=torch.bool)
        need[: n - 1] = s["loss_mask"][1:].bool()
        pos = need.nonzero().flatten()
        for c in pos.split(chunk):
            am[c] = (s["final"][c].float().to(w.device) @ w.T).argmax(-1).cpu()
        out[i] = am
    return out


@torch.no_grad()
def evaluate(drafter, samples, indices, cfg, head_weight, t2d, device, eval_targets=None, sources=None) -> dict:
    """Held-out loss, per-step accuracy and expected acceptance length of a greedy chain of `cfg.eval_chain`."""
    drafter.eval()
    steps = cfg.ttt_steps
    loss_sums, correct, counts = [0.0] * steps, [0] * steps, [0] * steps
    chain_sum, chain_rows = 0, 0
    by_source: dict[str, list[int]] = {}
    if eval_targets is None:  # fall back to the argmax over the draft vocabulary (mapped to target ids)
        ids_map = torch.nonzero(t2d).flatten()  # draft id -> target id
        eval_targets = {}
        for i in indices:
            s = samples[i]
            eval_targets[i] = ids_map[(s["final"].float() @ head_weight.float().cpu().T).argmax(-1)]
    lengths = [min(samples[i]["input_ids"].shape[0], cfg.max_seq_len) for i in indices]
    for batch in make_batches(lengths, cfg.tokens_per_batch, 0):
        members = [indices[i] for i in batch]
        ids, aux, final, mask, in_vocab = collate(samples, members, cfg.max_seq_len, head_weight, t2d, device)
        targ = torch.full(ids.shape, -1, dtype=torch.long)
        for j, i in enumerate(members):
            n = min(eval_targets[i].shape[0], ids.shape[1])
            targ[j, :n] = eval_targets[i][:n]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            out = ttt_evaluate(drafter, aux, final, head_weight, ids, mask, in_vocab, targ.to(device), steps, cfg.eval_chain)
        for k in range(len(out.counts)):
            loss_sums[k] += out.loss_sums[k]
            correct[k] += out.correct[k]
            counts[k] += out.counts[k]
        chain_sum += int(out.chain_sum.sum())
        chain_rows += int(out.chain_rows.sum())
        if sources is not None:
            for j, i in enumerate(members):
                acc_ = by_source.setdefault(sources[i], [0, 0])
                acc_[0] += int(out.chain_sum[j])
                acc_[1] += int(out.chain_rows[j])
    drafter.train()
    used = [k for k in range(steps) if counts[k]]
    acc = [correct[k] / counts[k] for k in used]
    step_loss = [loss_sums[k] / counts[k] for k in used]
    # expected accepted drafts in a chain ~ sum_k prod_{j<=k} acc_j (an estimate; the real loop is the benchmark)
    expected, running = 1.0, 1.0
    for a in acc:
        running *= a
        expected += running
    result = {
        "eval_loss": sum(cfg.step_decay**k * step_loss[k] for k in range(len(step_loss))),
        "eval_step_loss": step_loss,
        "eval_step_accuracy": acc,
        "eval_est_acceptance_length": expected,
        "eval_tau": 1.0 + chain_sum / max(chain_rows, 1),
        "eval_tokens": chain_rows,
    }
    if len(by_source) > 1:
        result["eval_tau_by_source"] = {k: 1.0 + v[0] / max(v[1], 1) for k, v in sorted(by_source.items())}
    return result


BEST_DIR = "best"
BEST_FILE = "best.json"


def save_best(out: Path, drafter: EagleDrafter, info: dict, dtype: torch.dtype, target_name: str | None) -> None:
    """Write a full drafter (`save_pretrained`, EAGLE-3 layout, `dtype`) to ``out/best`` atomically (the previous
    best stays whole when the write fails: `write_folder`)."""
    copy = type(drafter)(drafter.config)
    copy.load_state_dict(drafter.state_dict())
    copy.to(dtype)

    def fill(tmp: Path) -> None:
        copy.save_pretrained(tmp, target_model=target_name)
        (tmp / BEST_FILE).write_text(json.dumps(info, indent=1))

    write_folder(out / BEST_DIR, fill, size=tensor_bytes(copy.state_dict()))


def read_best(out: Path) -> dict | None:
    """The kept best's record (``best/best.json``); None when there is none. An empty or unreadable record (a
    full disk, a crash while writing) is replaced by `{}` with a warning: the run then scores the kept drafter
    again (or starts a fresh best when that does not load either)."""
    recover_folder(out / BEST_DIR)  # interrupted between the two renames of save_best
    path = out / BEST_DIR / BEST_FILE
    if not path.exists():
        return None
    try:
        best = json.loads(path.read_text())
    except (OSError, ValueError) as err:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        best, why = None, str(err).splitlines()[0] if str(err) else type(err).__name__
    else:
        why = "" if isinstance(best, dict) and isinstance(best.get("eval_tau"), (int, float)) else "no eval_tau"
    if why:
        logger.warning("%s is empty or unreadable (%s); the kept best drafter is scored again.", path, why)
        return {}
    return best


def _best_from_log(out: Path) -> dict:
    """The best step the log records last (each row after an evaluation names it; None: none does), for a lost
    best.json."""
    rows = read_log(out / LOG_FILE)
    marked = [r for r in rows if "best_step" in r]
    return {"step": marked[-1]["best_step"] if marked else None}


def train(
    drafter: EagleDrafter,
    samples: list[dict],
    vocab: DraftVocab,
    head_weight: torch.Tensor,  # [Vd, H_t] the target's lm_head rows of the draft vocabulary
    out_dir: str | Path,
    cfg: TrainConfig,
    device: torch.device | str = "cpu",
    target_head: torch.Tensor | None = None,  # [V, H_t] the target's full lm_head (held-out acceptance)
    sources: list[str] | None = None,  # per sample: the data folder it came from
    greedy: list[bool] | None = None,  # per sample: the target's own answer (True) or ShareGPT's original
    save_dtype: torch.dtype = torch.bfloat16,
    target_name: str | None = None,
) -> dict:
    """Train `drafter` in place; resumes from ``out_dir/train_state.pt`` when present.

    Evaluates at step 0 and every `eval_every` steps on the held-out split and keeps the drafter with the highest
    held-out acceptance length in ``out_dir/best`` (see `split_heldout`, `evaluate`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(device)
    if cfg.bf16 is None:
        cfg = replace(cfg, bf16=native_bf16(device))
        logger.info("bf16 autocast %s (%s)", "on" if cfg.bf16 else "off: float32", "native" if cfg.bf16 else "emulated here")
    torch.manual_seed(cfg.seed)
    train_idx, eval_idx, held = split_heldout(samples, cfg, greedy)
    eval_set = hashlib.sha1(json.dumps(sorted(prompt_key(samples[i]) for i in eval_idx)).encode()).hexdigest()[:12]
    logger.info(
        "%d conversations: %d for training, %d held out (%d read by each evaluation, %d answer tokens)",
        len(samples), len(train_idx), len(held), len(eval_idx), sum(int(samples[i]["loss_mask"].sum()) for i in eval_idx),
    )
    lengths = [min(samples[i]["input_ids"].shape[0], cfg.max_seq_len) for i in train_idx]
    # the schedule counts global batches: the same for any number of processes
    per_epoch = len(make_batches(lengths, cfg.tokens_per_batch, 0))
    total = cfg.max_steps if cfg.max_steps is not None else max(1, int(per_epoch * cfg.epochs))
    procs = join_processes(device)
    if procs.rank:  # feature noise: each process draws its own
        torch.manual_seed(cfg.seed + procs.rank)
    drafter.to(device).train()
    if cfg.compile:  # in place: parameter names (checkpoints) are unchanged
        drafter.midlayer.compile(dynamic=True)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    step = 0
    state_path = out / STATE_FILE
    if state_path.exists():
        state = load_state(state_path)
        drafter.load_state_dict(state["drafter"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        restore_rng(state, procs, cfg)
        logger.info("Resuming from %s at step %d of %d", state_path, step, total)
        if procs.main:
            _truncate_log(out / LOG_FILE, step)  # steps after the checkpoint are redone
    procs.broadcast_parameters(drafter)  # one drafter: every process starts from the main process's weights
    head_weight = head_weight.to(device)
    main = procs.main
    eval_targets = None
    if main and eval_idx and target_head is not None:
        t0 = time.perf_counter()
        eval_targets = target_argmax(samples, eval_idx, target_head)
        logger.info("target argmax of the held-out positions in %.1f s", time.perf_counter() - t0)

    def run_eval() -> dict:
        t0 = time.perf_counter()
        result = evaluate(drafter, samples, eval_idx, cfg, head_weight, vocab.t2d, device, eval_targets, sources)
        result["eval_seconds"] = time.perf_counter() - t0
        return result

    best = read_best(out) if main and step > 0 else None
    best_tau = float("-inf")
    if best is not None and best.get("eval_set") == eval_set:
        best_tau = best["eval_tau"]
    elif best is not None and eval_idx:  # the held-out split changed (more data), or best.json was lost: score
        from ..drafter.checkpoint import DrafterLoadError  # the kept drafter again

        if not best:
            best = _best_from_log(out)
        try:
            kept = EagleDrafter.from_pretrained(out / BEST_DIR, dtype=torch.float32).to(device)
        except DrafterLoadError as err:
            logger.warning("The kept best drafter in %s does not load (%s); starting a fresh best.", out / BEST_DIR, err)
            best = None
        else:
            kept.bind_target_embedding(drafter._target_embedding)
            kept_eval = evaluate(kept, samples, eval_idx, cfg, head_weight, vocab.t2d, device, eval_targets, sources)
            best_tau = kept_eval["eval_tau"]
            best.update(eval_tau=best_tau, eval_set=eval_set)
            write_file(out / BEST_DIR / BEST_FILE, json.dumps(best, indent=1))
            logger.info("The kept best drafter (step %s) scores tau %.3f on this run's held-out split",
                        best.get("step"), best_tau)
            del kept

    def consider_best(row: dict) -> None:
        nonlocal best_tau, best
        if row["eval_tau"] > best_tau:
            best_tau = row["eval_tau"]
            best = {"step": row["step"], "eval_tau": best_tau, "eval_set": eval_set,
                    "eval_step_accuracy": row["eval_step_accuracy"], "eval_loss": row["eval_loss"]}
            save_best(out, drafter, best, save_dtype, target_name)
        row["best_step"], row["best_tau"] = best["step"], best_tau

    if main and step == 0 and eval_idx:  # the starting point (the init drafter when warm-starting) is a candidate
        row = {"step": 0, "epoch": 0.0, **run_eval()}
        consider_best(row)
        logger.info("step 0 eval: tau %.3f, loss %.4f", row["eval_tau"], row["eval_loss"])
        append_line(out / LOG_FILE, json.dumps(row))
    start, start_step, seen_tokens, seen_answer = time.perf_counter(), step, 0, 0
    bar = tqdm(total=total, initial=step, desc="training", unit="step", disable=not main)
    last: dict = {"step": step}
    while step < total:
        epoch, offset = divmod(step, per_epoch)
        batches = make_batches(lengths, cfg.tokens_per_batch, cfg.seed + epoch)
        for batch in batches[offset:]:
            if step >= total:
                break
            mine = [train_idx[i] for i in batch[procs.rank :: procs.world]]  # this process's slice of the batch
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total, cfg)
            opt.zero_grad(set_to_none=True)
            loss, step_losses, step_accuracy, tokens, answer = _train_step(
                drafter, samples, mine, cfg, head_weight, vocab.t2d, device, procs)
            if procs.world > 1:
                procs.sum_gradients(params)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
            opt.step()
            step += 1
            seen_tokens += tokens
            seen_answer += answer
            elapsed = time.perf_counter() - start
            last = {
                "step": step,
                "epoch": step / per_epoch,
                "loss": loss,
                "step_loss": step_losses,
                "step_accuracy": step_accuracy,
                "lr": opt.param_groups[0]["lr"],
                "grad_norm": grad_norm,
                "steps_per_s": (step - start_step) / elapsed,
                "tokens_per_s": seen_tokens / elapsed,
                "answer_tokens_per_s": seen_answer / elapsed,
            }
            bar.update(1)
            bar.set_postfix(loss=f"{last['loss']:.3f}", acc0=f"{step_accuracy[0]:.2f}" if step_accuracy else "-")
            out_of_time = cfg.max_minutes is not None and elapsed > 60 * cfg.max_minutes
            if procs.world > 1 and cfg.max_minutes is not None:  # the processes stop together
                out_of_time = bool(procs.max(torch.tensor([float(out_of_time)], device=device)).item())
            stop = out_of_time or (step == cfg.stop_after and step < total)
            if main and (step % cfg.eval_every == 0 or step == total or stop) and eval_idx:
                last.update(run_eval())
                consider_best(last)
                logger.info("step %d eval: tau %.3f (best %.3f at step %s), accuracy %s", step, last["eval_tau"],
                            best_tau, last["best_step"], [round(a, 3) for a in last["eval_step_accuracy"]])
            if main:
                append_line(out / LOG_FILE, json.dumps(last))
            if step % cfg.save_every == 0 or step == total or stop:
                save_state(state_path, drafter, opt, step, procs)
            if stop:
                if out_of_time:
                    logger.warning("Time budget of %.0f min spent at step %d of %d; resume to continue.",
                                   cfg.max_minutes, step, total)
                else:
                    logger.info("Stopped after step %d of %d as asked; resume to continue.", step, total)
                bar.close()
                procs.barrier()
                return {**last, "finished": False, "total_steps": total, "best": best}
    bar.close()
    procs.barrier()
    return {**last, "finished": True, "total_steps": total, "config": asdict(cfg), "best": best}


def _train_step(drafter, samples, members, cfg, head_weight, t2d, device, procs: Processes):
    """Forward and backward over this process's slice `members` of a global batch (maybe empty); returns the global
    batch's `(loss, step_losses, step_accuracy, padded_tokens, answer_tokens)`, the same in every process."""
    steps = cfg.ttt_steps
    if members:
        ids, aux, final, mask, in_vocab = collate(samples, members, cfg.max_seq_len, head_weight, t2d, device)
        if cfg.feature_noise:
            aux = add_feature_noise(aux, cfg.feature_noise, aux.shape[-1] // final.shape[-1])
        counts = step_counts(mask, in_vocab, steps)
    else:
        counts = [0] * steps
    normalisers = None
    if procs.world > 1:  # every slice's loss is divided by the global batch's rows: the slices' losses sum to it
        normalisers = [int(c) for c in procs.sum(torch.tensor(counts, dtype=torch.float64, device=device)).tolist()]
    if not members:
        return _global_stats(procs, 0.0, [], [], 0, 0, 0, steps, device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
        out = ttt_loss(drafter, aux, final, head_weight, ids, mask, in_vocab, steps, cfg.step_decay, normalisers=normalisers)
    out.loss.backward()
    return _global_stats(procs, float(out.loss.detach()), out.step_losses, out.step_accuracy, int(ids.numel()),
                         int(mask.sum()), ids.shape[1], steps, device)


def _global_stats(procs: Processes, loss, step_losses, step_accuracy, tokens, answer, length, steps, device):
    """The global batch's logged figures: each process's share (already divided by the global rows) summed."""
    if procs.world == 1:
        return loss, step_losses, step_accuracy, tokens, answer
    pad = [0.0] * (steps - len(step_losses))
    stats = procs.sum(torch.tensor([loss, tokens, answer, *step_losses, *pad, *step_accuracy, *pad],
                                   dtype=torch.float64, device=device)).tolist()
    length = int(procs.max(torch.tensor([length], device=device)).item())  # the longest slice: its unrolled steps
    unrolled = max(0, min(steps, length - 1))
    return stats[0], stats[3 : 3 + unrolled], stats[3 + steps : 3 + steps + unrolled], int(stats[1]), int(stats[2])


def _truncate_log(path: Path, step: int) -> None:
    """The log up to `step` (the checkpoint's): the steps after it are redone."""
    if path.exists():
        lines = sum(1 for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip())
        rows = [row for row in read_log(path) if row["step"] <= step]
        if len(rows) != lines:  # (rewritten only when a row goes: a full disk may be why the run stopped)
            write_file(path, "".join(json.dumps(r) + "\n" for r in rows))


def load_state(path: Path | str) -> dict:
    """A run's training state (`save_state`): tensors and plain values only (``weights_only``). A file holding
    anything else (a pickle can call any function as it loads) is refused before any of it runs."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{path} holds objects other than tensors and plain values, which eagle_hf does not load: a crafted file "
            "could run code as it loads. A training state eagle_hf wrote holds none; if this one is yours, delete it "
            f"to train from the start, else delete it unread. ({str(err).splitlines()[0]})"
        ) from err
    except Exception as err:  # zip, EOF and torch's own errors differ in type
        raise ValueError(
            f"Cannot read the training state {path} ({type(err).__name__}: {err}); it is truncated or corrupt. "
            "Delete it to train from the start."
        ) from err
    missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"{path} is not a training state eagle_hf wrote: it lacks {missing}. Delete it to train "
                         "from the start.")
    return state


def save_state(path: Path, drafter, opt, step: int, procs: Processes | None = None) -> None:
    """The resumable state (tensors and plain containers only), written by the main process. With several processes
    it also keeps every process's random state (feature noise) and their number."""
    procs = procs or Processes()
    state = {"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "step": step, "torch_rng": torch.get_rng_state()}
    if procs.world > 1:
        state["processes"] = procs.world
        state["torch_rng_by_process"] = procs.gather(torch.get_rng_state())
    if procs.main:  # whole or not at all: a full disk leaves the previous state (`write_file`)
        write_file(path, lambda tmp: torch.save(state, tmp), size=tensor_bytes(state))


def restore_rng(state: dict, procs: Processes, cfg: TrainConfig) -> None:
    """Each process's random state from a checkpoint. Saved by another number of processes, the training itself
    resumes exactly (the batches, the weights and the optimizer are global); only the feature noise draws
    differ from an uninterrupted run."""
    saved = state.get("processes", 1)
    if saved == procs.world:
        torch.set_rng_state(state["torch_rng_by_process"][procs.rank] if saved > 1 else state["torch_rng"])
        return
    if procs.main:
        torch.set_rng_state(state["torch_rng"])
    if cfg.feature_noise:
        logger.warning("The checkpoint was written by %d processes, this run has %d: the training resumes at step "
                       "%d, but its feature noise draws differ from an uninterrupted run's.", saved, procs.world,
                       state["step"])


@torch.no_grad()
def initialise_from_target(drafter: EagleDrafter, samples, vocab: DraftVocab, head_weight, max_rows: int = 20000):
    """Warm start (training_notes.md): the target's lm_head rows, a final norm of one uniform scale, the layer's
    output projections at zero, and `fc` fitted by least squares so that the drafter starts out predicting the
    next position's final hidden state (what the target's lm_head reads), up to its scale.

    The target's per-channel final-norm scale is not copied. An EAGLE-3.1 drafter feeds its post-norm state back
    as the next step's residual, so a per-channel scale would be applied again at every unrolled step; a uniform
    scale (the median RMS of the target's final states) is not, since RMSNorm ignores it: the warm-started
    drafter's fed-back state is a fixed point of its norm. And the fit is made in the space lm_head reads, where
    an error costs the same on every channel: Gemma 3's final norm scales channels by 0.19 to 301, and a drafter
    fitted before that scale had its logits move by hundreds of nats for a small step of the optimiser."""
    drafter.lm_head.weight.copy_(head_weight.to(drafter.lm_head.weight.dtype))
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
    x = torch.cat(xs)[:max_rows]  # [N, A*H_t]
    y = torch.cat(ys)[:max_rows]  # [N, H_t] the target's final states, as its lm_head reads them
    rms = y.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)  # [N, 1]
    y = y / rms  # unit RMS: the drafter's norm removes any scale of its input anyway
    drafter.norm.weight.fill_(rms.median().item())
    if drafter.fc_norm is not None:
        chunks = x.chunk(len(drafter.fc_norm), dim=-1)
        x = torch.cat([c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + drafter.config.rms_norm_eps) for c in chunks], -1)
    # ridge regression: the taps are highly collinear (every sample starts with the same system prompt)
    x64, y64 = x.double(), y.double()
    gram = x64.T @ x64  # [A*H_t, A*H_t]
    ridge = 1e-3 * gram.diagonal().mean()
    sol = torch.linalg.solve(gram + ridge * torch.eye(gram.shape[0], dtype=gram.dtype), x64.T @ y64)  # [A*H_t, H]
    drafter.fc.weight.copy_(sol.T.to(drafter.fc.weight.dtype).to(drafter.fc.weight.device))
