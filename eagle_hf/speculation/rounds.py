"""A round's record and its timing: what every reader of a round's outcome and timing reads.

(A round's plan, decided before anything runs, is `eagle_hf.speculation.speculator.plan_round`.)

A round ends in one place per row (`Speculator.end_round`), with a `RoundRecord`: its kind, the verified tree,
the accepted path, the drafter's levels. The stats, the adaptive schedule, the copy source and the listeners
read that record. A round's timings come later, as one `RoundTiming` (device marks are read after the round's
read-back, one round late on a GPU) through one entry point of the schedule (`DraftLengthController.observe`).

Timing device work without stalling it (`Timer`): marks on the device's queue, read once the work behind them is
done. On a GPU a kernel launch returns at once: reading `time.perf_counter` measures the launch, and synchronising to
measure the work stalls the queue. A `Timer` instead records a
*mark* in the device's queue (a CUDA event; on the CPU, where work is synchronous, the wall clock) and measures
between two marks only after the host has read something the device computed after both: the round's own
read-back of the verification. Until then a measurement waits in `pending`; `resolve()` after each read-back
hands the finished ones to their callbacks. So the adaptive schedule learns a round's timings one round late
(on CUDA; at once on the CPU), and the device never waits for the clock. Nothing in eagle_hf synchronises a
device to time it (the cost model learns from these marks; nothing is measured before the first token).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from .tree import EAGLE, SOURCE_NAMES, DraftTree


class Round(StrEnum):
    """A row's round: the prompt's prefill; a draft-and-verify cycle; a plain step chosen by the schedule (or a
    fully pruned tree); a plain step because no room was left for drafts; a finished row kept in the batch (a
    cheaper forward than dropping it), its root alone."""

    PREFILL = "prefill"
    DRAFT = "draft"
    FALLBACK = "fallback"
    FINAL = "final"
    PADDING = "padding"


@dataclass
class RoundRecord:
    """One row's round. `path`: the accepted node path of `tree`, root first (drafting rounds); `accepted`: the
    drafts accepted (the round emitted accepted + 1 tokens, the last `last_token`); `cut`: the round's tokens
    were cut at EOS or the length limit (nothing after the accepted drafts was rejected); `eagle_depth`: the
    drafter's levels this round (0: copies alone, or a plain step)."""

    kind: Round
    accepted: int
    last_token: int
    row: int | None = None
    tree: DraftTree | None = None
    path: list[int] = field(default_factory=lambda: [0])
    cut: bool = False
    eagle_depth: int = 0

    @property
    def drafting(self) -> bool:
        return self.kind == Round.DRAFT

    @functools.cached_property
    def depths(self) -> list[int]:
        """Each node's depth (root 0)."""
        return self.tree.host.depths

    @property
    def depth(self) -> int:
        """The deepest draft verified."""
        return max(self.depths)

    @functools.cached_property
    def per_source(self) -> dict[str, tuple[int, list[int], list[int]]]:
        """Per source that drafted: (nodes drafted, depths it drafted at, depths of the accepted nodes it
        proposed), depths from 1."""
        sources, depths, out = self.tree.host.sources, self.depths, {}
        for bit, name in SOURCE_NAMES.items():
            mine = [n for n in range(1, len(sources)) if sources[n] & bit]
            if mine:
                out[name] = (len(mine), sorted({depths[n] for n in mine}),
                             [i + 1 for i, n in enumerate(self.path[1:]) if sources[n] & bit])
        return out

    @functools.cached_property
    def drafter_outcome(self) -> tuple[int, int]:
        """(the deepest level of the drafter's own nodes, how many of the accepted drafts it proposed in a row
        from the root): what the schedule learns the drafter's acceptance from."""
        if self.tree.all_eagle:
            return self.depth, self.accepted
        sources, depths = self.tree.host.sources, self.depths
        drafted = max((depths[n] for n in range(1, len(sources)) if sources[n] & EAGLE), default=0)
        mine = next((i for i, n in enumerate(self.path[1:]) if not sources[n] & EAGLE), self.accepted)
        return drafted, mine

    @property
    def taken(self) -> list[int]:
        """The accepted drafts' tokens."""
        return [self.tree.host.tokens[n] for n in self.path[1:]]

    def shown(self) -> tuple[list[int], list[str]]:
        """For displays: the accepted drafts, then the best-scoring rejected continuation below the last accepted
        node (a chain: every draft; none after a cut), with who proposed each ("eagle", "copy", "eagle+copy")."""
        if not self.drafting:
            return [], []
        tree = self.tree
        nodes, node = list(self.path[1:]), self.path[-1]
        while children := tree.children(node):
            node = max(children, key=lambda i: tree.host.scores[i])
            nodes.append(node)
        nodes = nodes[: self.accepted] if self.cut else nodes
        return [tree.host.tokens[n] for n in nodes], [source_name(tree.source(n)) for n in nodes]


@dataclass
class RoundTiming:
    """One round's timings in seconds (None: not timed), read by the cost model, the schedule and the stats.
    `rows` verified `width` tokens each (1: a plain round); `drafting_rows` shared the drafter, whose draft
    levels took `levels` forwards after its catch-up (fewer than the depth where a tree was pruned), the deepest
    row's tree of `depth` (0: copy branches alone, or a plain round); `copies`: copy branches were verified;
    `tokens`: what each live row emitted on average; `drafter_prefill`: the drafter's catch-up read rows of rounds
    it did not draft in (the prompt, plain rounds: not a regular round's cost); `caught_up`: the most rows a
    drafting row's catch-up read; `batch`: the call decodes several rows; `kind`: the kind of drafting round a
    batch planned (`DraftLengthController.kind`), whatever its rows then drafted."""

    seconds: float | None = None  # the whole round
    catch_up: float | None = None  # the drafter reading the rows committed since its last round
    draft: float | None = None  # the drafter's levels
    verify: float | None = None  # the target's verify forward
    rows: int = 1
    width: int = 1
    drafting_rows: int = 0
    levels: int = 0
    depth: int = 0
    copies: bool = False
    tokens: float = 1.0
    drafter_prefill: bool = False
    caught_up: int = 0  # the most rows a drafting row's catch-up read (0: not known)
    batch: bool = False
    kind: tuple[int, bool] | None = None

    @classmethod
    def from_marks(cls, at: dict[str, float], **facts) -> RoundTiming:
        """From the seconds of a round's named marks (`Timer.measure_marks`): ``start``, then where present
        ``draft``, ``caught_up``, ``drafted`` (the drafter), ``verify``, ``verified`` (the target), ``end``. Where
        the catch-up and the levels ran as one program (no ``caught_up`` mark), its time is split evenly over its
        drafter forwards: the catch-up's one and the `levels`."""

        def between(a: str, b: str) -> float | None:
            return at[b] - at[a] if a in at and b in at else None

        catch_up, draft = between("draft", "caught_up"), between("caught_up", "drafted")
        if catch_up is None and draft is None and (whole := between("draft", "drafted")) is not None:
            catch_up = whole / (facts.get("levels", 0) + 1)
            draft = whole - catch_up
        return cls(seconds=between("start", "end"), catch_up=catch_up, draft=draft,
                   verify=between("verify", "verified"), **facts)

    @property
    def wide(self) -> bool:
        """Whether the round verified drafts or copy branches (or ran the drafter, even if all was pruned)."""
        return self.width > 1 or self.drafting_rows > 0


def report_round(timing: RoundTiming, speculators, drafting, learner=None) -> None:
    """The one door of a round's timings, once measured (a round late on a GPU: `drafting`, the rows whose
    drafter drafted, was taken at the round): the schedule (`DraftLengthController.observe`; else `learner`, a
    cost model taught by the loop's rounds, if any) and each row's stats (its share of the target's forward and,
    a drafting row, of the drafter's time)."""
    controller = speculators[0].controller
    if controller is not None or learner is not None:
        (controller or learner).observe(timing)
    for sp in speculators:
        sp.stats.record_timing(timing, 1 / len(speculators), 1 / len(drafting) if sp in drafting else 0.0)


def source_name(bits: int) -> str:
    return "+".join(name for bit, name in SOURCE_NAMES.items() if bits & bit)


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
        self.queue = None  # CUDA's events: the device's current stream, asked at each mark (its queue, whichever
        # device is current)
        if event_fn is None and device.type == "cuda":
            event_fn = lambda: torch.cuda.Event(enable_timing=True)
            self.queue = lambda: torch.cuda.current_stream(device)
        self.event_fn = event_fn  # None: the wall clock (synchronous devices); injected in tests
        self.events = event_fn is not None
        self.time_fn = time_fn
        self.epoch = 0  # read-backs so far: a mark of an earlier epoch is done on the device
        self.pending: list[tuple[list[Mark], Callable[..., None]]] = []

    def mark(self) -> Mark:
        if not self.events:
            return Mark(None, self.time_fn(), self.epoch)
        event = self.event_fn()
        if self.queue is None:
            event.record()
        else:
            event.record(self.queue())
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
