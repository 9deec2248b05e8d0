"""Wall-clock timing of device work: a clock that waits for the device at the points it measures."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def device_sync(device) -> Callable[[], None] | None:
    """The function that waits for queued work on `device` (None on the CPU, where work is synchronous)."""
    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    accelerator = getattr(torch, device.type, None)
    if device.type != "cpu" and accelerator is not None and hasattr(accelerator, "synchronize"):
        return accelerator.synchronize
    return None


class Clock:
    """``clock()`` returns seconds after all device work queued so far has finished.

    On CUDA a kernel launch returns at once: reading `time.perf_counter` without a synchronize measures the
    launch, not the work. Only the points where something is measured call the clock; `time_fn` and `sync_fn`
    can be injected (tests)."""

    def __init__(self, device="cpu", time_fn: Callable[[], float] = time.perf_counter, sync_fn=...):
        self.time_fn = time_fn
        self.sync_fn = device_sync(device) if sync_fn is ... else sync_fn

    def __call__(self) -> float:
        if self.sync_fn is not None:
            self.sync_fn()
        return self.time_fn()
