"""Per-call speculative decoding statistics (`SpecDecodeStats`), retrievable after `generate()`."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field, fields

from .rounds import Round


@dataclass
class SpecDecodeStats:
    """What one `generate()` call did.

    A *cycle* is one draft-and-verify round; each yields ``accepted + 1`` tokens (the accepted drafts plus the
    target's own bonus or recovered token). The prefill round drafts nothing and is not a cycle.
    """

    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    accepted_per_cycle: list[int] = field(default_factory=list)
    draft_length_per_cycle: list[int] = field(default_factory=list)
    fallback_steps: int = 0  # plain rounds: the adaptive schedule fell back, or the confidence threshold pruned all drafts
    final_steps: int = 0  # rounds decoded plainly because no room was left to draft (max_new_tokens)
    new_tokens: int = 0
    # per source ("eagle", "copy"): draft nodes verified, accepted drafts (a node both proposed counts for both),
    # and per depth 1..: rounds the source drafted at that depth / rounds its node there was accepted
    drafted_by_source: dict[str, int] = field(default_factory=dict)
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    drafted_per_position_by_source: dict[str, list[int]] = field(default_factory=dict)
    accepted_per_position_by_source: dict[str, list[int]] = field(default_factory=dict)
    drafter_time: float = 0.0  # seconds in the drafter (its catch-up and its draft levels)
    catch_up_time: float = 0.0  # of which its catch-up over the rows committed since its last round
    # seconds in the target's forwards after the prefill (verify and plain steps); these times leave out the rounds
    # that compiled a shape of the target's forward or captured a drafter graph
    verify_time: float = 0.0
    timed_rounds: int = 0  # the rounds these three times cover (a round that compiled or captured is not timed)
    timed_drafter_rounds: int = 0  # of which rounds this row's drafter drafted in
    per_row: list[SpecDecodeStats] = field(default_factory=list)  # a batch's rows (these stats are their merge)
    total_time: float = 0.0  # wall time of the whole generate() call

    def read(self, record) -> None:
        """One row's round (a `eagle_hf.speculation.rounds.RoundRecord`)."""
        if record.kind == Round.DRAFT:
            self.record_cycle(record.depth, record.accepted)
            self.record_sources(record.per_source)
        elif record.kind == Round.FALLBACK:
            self.fallback_steps += 1
        else:
            self.final_steps += 1

    def record_timing(self, timing, target_share: float = 1.0, drafter_share: float = 1.0) -> None:
        """One round's timings (a `eagle_hf.speculation.rounds.RoundTiming`): this row's share of the target's
        forward and of the drafter's time (0: it did not draft)."""
        self.timed_rounds += 1
        self.timed_drafter_rounds += drafter_share > 0
        self.verify_time += (timing.verify or 0.0) * target_share
        self.catch_up_time += (timing.catch_up or 0.0) * drafter_share
        self.drafter_time += ((timing.catch_up or 0.0) + (timing.draft or 0.0)) * drafter_share

    def record_cycle(self, drafted: int, accepted: int) -> None:
        self.cycles += 1
        self.drafted += drafted
        self.accepted += accepted
        self.accepted_per_cycle.append(accepted)
        self.draft_length_per_cycle.append(drafted)
        grow = drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(drafted):
            self.drafted_per_position[i] += 1
            if i < accepted:
                self.accepted_per_position[i] += 1

    def record_sources(self, per_source: dict[str, tuple[int, list[int], list[int]]]) -> None:
        """One round per source: (draft nodes, depths drafted at, depths of its accepted nodes), depths from 1."""
        for name, (nodes, drafted_depths, accepted_depths) in per_source.items():
            self.drafted_by_source[name] = self.drafted_by_source.get(name, 0) + nodes
            self.accepted_by_source[name] = self.accepted_by_source.get(name, 0) + len(accepted_depths)
            for table, depths in ((self.drafted_per_position_by_source, drafted_depths),
                                  (self.accepted_per_position_by_source, accepted_depths)):
                row = table.setdefault(name, [])
                for d in depths:
                    row.extend([0] * (d - len(row)))
                    row[d - 1] += 1

    @property
    def acceptance_per_position_by_source(self) -> dict[str, list[float]]:
        """Per source: P(its draft at depth i accepted | it drafted at depth i)."""
        return {name: [a / d if d else 0.0 for a, d in zip(self.accepted_per_position_by_source.get(name, []) +
                                                           [0] * len(drafted), drafted)]
                for name, drafted in self.drafted_per_position_by_source.items()}

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per cycle, bonus token counted (the EAGLE papers' tau)."""
        return (self.accepted + self.cycles) / self.cycles if self.cycles else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """P(draft i accepted | draft i was proposed), i = 0..max drafted - 1."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def steps(self) -> int:
        """Rounds after the prefill: speculative cycles plus plain (fallback and final) steps."""
        return self.cycles + self.fallback_steps + self.final_steps

    @property
    def fallback_ratio(self) -> float:
        return self.fallback_steps / self.steps if self.steps else 0.0

    @property
    def target_time(self) -> float:
        return max(self.total_time - self.drafter_time, 0.0)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time if self.total_time else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            mean_acceptance_length=self.mean_acceptance_length,
            acceptance_rate=self.acceptance_rate,
            acceptance_per_position=self.acceptance_per_position,
            acceptance_per_position_by_source=self.acceptance_per_position_by_source,
            steps=self.steps,
            fallback_ratio=self.fallback_ratio,
            target_time=self.target_time,
            tokens_per_second=self.tokens_per_second,
        )
        return out

    def summary(self) -> str:
        per_pos = ", ".join(f"{p:.2f}" for p in self.acceptance_per_position)
        by_source = "".join(f"; {name} accepted {self.accepted_by_source.get(name, 0)}/{n}"
                            for name, n in self.drafted_by_source.items())
        return (
            f"{self.new_tokens} new tokens in {self.total_time:.2f}s ({self.tokens_per_second:.1f} tok/s); "
            f"{self.cycles} cycles, mean acceptance length {self.mean_acceptance_length:.2f}, "
            f"acceptance per position [{per_pos}]{by_source}; fallback {self.fallback_ratio:.0%} of steps; drafter {self.drafter_time:.2f}s, target {self.target_time:.2f}s"
        )


_local = threading.local()


def last_stats() -> SpecDecodeStats | None:
    """Stats of the most recent EAGLE `generate()` call made *in this thread* (None before the first)."""
    return getattr(_local, "last", None)


def _set_last(stats: SpecDecodeStats) -> None:
    _local.last = stats


#: per-position counts add position-wise; other lists are per-cycle records and concatenate
PER_POSITION = ("drafted_per_position", "accepted_per_position")


def _add_positions(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))]


def merge_stats(items: list[SpecDecodeStats]) -> SpecDecodeStats:
    """Pool several calls' stats: counts and times add up, per-cycle records concatenate, per-position counts
    add position-wise (per source too)."""
    out = SpecDecodeStats()
    for s in items:
        for f in fields(SpecDecodeStats):
            mine, theirs = getattr(out, f.name), getattr(s, f.name)
            if f.name in PER_POSITION:
                setattr(out, f.name, _add_positions(mine, theirs))
            elif isinstance(mine, dict):  # per source: counts add, per-position lists add position-wise
                for name, value in theirs.items():
                    old = mine.get(name, [] if isinstance(value, list) else 0)
                    mine[name] = _add_positions(old, value) if isinstance(value, list) else old + value
            else:
                setattr(out, f.name, mine + theirs)  # numbers add, lists concatenate
    return out
