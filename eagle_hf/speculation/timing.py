"""Timing device work without stalling it: marks on the device's queue, read once the work behind them is done.

On a GPU a kernel launch returns at once: reading `time.perf_counter` measures the launch, and synchronising to
measure the work stalls the queue (every round, 3-8 times, before this module). A `Timer` instead records a
*mark* in the device's queue (a CUDA event; on the CPU, where work is synchronous, the wall clock) and measures
between two marks only after the host has read something the device computed after both: the round's own
read-back of the verification. Until then a measurement waits in `pending`; `resolve()` after each read-back
hands the finished ones to their callbacks. So the adaptive schedule learns a round's timings one round late
(on CUDA; at once on the CPU), and the device never waits for the clock. Nothing in eagle_hf synchronises a
device to time it (the cost model learns from these marks; nothing is measured before the first token).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch


class Mark:
    """A point in the device's queue: a recorded CUDA event, or the wall clock where work is synchronous."""

    __slots__ = ("epoch", "event", "seconds")

    def __init__(self, event, seconds: float, epoch: int):
        self.event, self.seconds, self.epoch = event, seconds, epoch


class Timer:
    """Marks on one device's queue and the measurements between them, resolved without a synchronisation.

    ``timer.measure([m0, m1, ...], callback)`` calls ``callback(seconds m0->m1, seconds m1->m2, ...)`` once the
    device has run everything queued before the last mark and the host has read a result of it (`read_back`); on
    the CPU at once."""

    def __init__(self, device="cpu", time_fn: Callable[[], float] = time.perf_counter, event_fn=None):
        device = torch.device(device)
        if event_fn is None and device.type == "cuda":
            event_fn = lambda: torch.cuda.Event(enable_timing=True)
        self.event_fn = event_fn  # None: the wall clock (synchronous devices); injected in tests
        self.events = event_fn is not None
        self.time_fn = time_fn
        self.epoch = 0  # read-backs so far: a mark of an earlier epoch is done on the device
        self.pending: list[tuple[list[Mark], Callable[..., None]]] = []

    def mark(self) -> Mark:
        if not self.events:
            return Mark(None, self.time_fn(), self.epoch)
        event = self.event_fn()
        event.record()
        return Mark(event, 0.0, self.epoch)

    def measure(self, marks: list[Mark], callback: Callable[..., None]) -> None:
        if not self.events:
            callback(*(b.seconds - a.seconds for a, b in itertools.pairwise(marks)))
            return
        self.pending.append((marks, callback))

    def measure_marks(self, marks: dict[str, Mark], callback: Callable[[dict[str, float]], None]) -> None:
        """``callback({name: seconds since the first mark})`` for named marks made in this (insertion) order,
        once they are all done (`measure`)."""
        names = list(marks)

        def elapsed(*gaps: float) -> None:
            out, t = {names[0]: 0.0}, 0.0
            for name, gap in zip(names[1:], gaps):
                t += gap
                out[name] = t
            callback(out)

        self.measure([marks[n] for n in names], elapsed)

    def read_back(self) -> None:
        """The host just read a device result queued after every mark made so far: they are all done."""
        self.epoch += 1
        self.resolve()

    def close(self, hand_over: bool = True) -> None:
        """The call is over: hand over the measurements the device has finished (asked with a non-blocking event
        query, never a synchronisation; none with `hand_over` False) and drop the rest. A measurement left pending
        would keep its callback's objects alive (the decoding loop, and through it the call's caches) in a
        reference cycle."""
        pending, self.pending = self.pending, []
        for marks, callback in pending if hand_over else ():
            if getattr(marks[-1].event, "query", lambda: True)():  # (a queue runs in order: all done)
                callback(*_elapsed(marks))

    def resolve(self) -> None:
        """Hand every finished measurement to its callback (marks made before the last read-back)."""
        ready = [p for p in self.pending if p[0][-1].epoch < self.epoch]
        if not ready:
            return
        self.pending = [p for p in self.pending if p[0][-1].epoch >= self.epoch]
        for marks, callback in ready:
            callback(*_elapsed(marks))


def _elapsed(marks: list[Mark]) -> list[float]:
    """Seconds between consecutive recorded marks (their events are done)."""
    return [a.event.elapsed_time(b.event) / 1000.0 for a, b in itertools.pairwise(marks)]
