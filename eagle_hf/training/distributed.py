"""Data parallel training: one drafter trained by N processes (launched by `torchrun` or `accelerate launch`).

A launcher sets ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; with
``WORLD_SIZE`` > 1, `join_processes` joins their process group (gloo on the CPU, NCCL on GPUs). Every process
holds the whole drafter (one decoder layer: about 1 GB in float32 for an 8B target) and computes its slice of every
global batch; `Processes.sum_gradients` sums the slices' gradients, so every process takes the step one process
would take over the whole batch. Without a launcher everything here is a no-op on a single process.

FSDP and DeepSpeed are not supported (`check_launcher`): the drafter is small enough to be replicated.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


def launched_processes() -> int:
    """The number of processes a launcher started (1 without one)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_launcher() -> None:
    """Refuse a sharded launch (FSDP, DeepSpeed) before any compute: only plain data parallel is supported."""
    sharded = [name for name, var in (("FSDP", "ACCELERATE_USE_FSDP"), ("DeepSpeed", "ACCELERATE_USE_DEEPSPEED"))
               if os.environ.get(var, "").lower() in ("1", "true", "yes")]
    if sharded:
        raise ValueError(
            f"eagle-hf train does not support {' or '.join(sharded)}: it trains data parallel, every process "
            "holding the whole drafter and summing gradients. Launch with `torchrun --nproc_per_node N` or "
            "`accelerate launch --multi_gpu --num_processes N` (without --use_fsdp / --use_deepspeed)."
        )


def local_device(device: str | None) -> str | None:
    """Under a launcher, an unnumbered ``cuda`` becomes this process's GPU (``cuda:LOCAL_RANK``)."""
    if launched_processes() > 1 and device in ("cuda", "auto") and torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


@dataclass(frozen=True)
class Processes:
    """This process's place in the group; `world` == 1: a single process (every collective returns its input)."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over the processes (in place; returned)."""
        if self.world > 1:
            torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.SUM)
        return values

    def max(self, values: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
        return values

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def gather(self, obj) -> list:
        """Every process's `obj` (picklable), in rank order, on every process."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Every process starts from the main process's weights (and buffers)."""
        if self.world > 1:
            with torch.no_grad():
                for t in list(module.parameters()) + list(module.buffers()):
                    torch.distributed.broadcast(t.data, src=0)

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients of `params` over the processes, in one flat all-reduce. A parameter keeps no gradient
        (None, skipped by the optimizer as in one process) only where no process computed one."""
        if self.world == 1:
            return
        ref = params[0]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float() for p in params]
                         + [torch.tensor([float(p.grad is not None) for p in params], device=ref.device)])
        self.sum(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype).clone()
            offset += n
        for p, present in zip(params, flat[offset:].tolist()):
            if not present:
                p.grad = None


def join_processes(device: torch.device | str = "cpu") -> Processes:
    """Join the launcher's process group (once; gloo on the CPU, NCCL on GPUs), or a single process without one."""
    world = launched_processes()
    if world == 1:
        return Processes()
    import torch.distributed as dist

    check_launcher()
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # NCCL's object collectives use the current GPU
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend)
        logger.info("process %d of %d joined the %s group", dist.get_rank(), world, backend)
    return Processes(rank=dist.get_rank(), world=dist.get_world_size())
