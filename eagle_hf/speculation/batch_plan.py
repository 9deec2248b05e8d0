"""A batch's kind of drafting round: its drafter alone, its drafter with copy branches in its tree, or copy branches
alone, chosen each round from the batch's own timed rounds of each kind, the kinds it does not prefer tried now and
then. The one-row schedule (`eagle_hf.speculation.schedule.DraftLengthController`) keeps the depth, the retries of a
dropped drafter and the loss budget; a batch's schedule asks this plan which kind its round is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from .backoff import RETRY_SHARE, Backoff

#: timed rounds of a kind (a depth, with or without copy branches) before a batch's measured rate of it counts
MEASURED_ROUNDS = 2
#: a batch leaves its preferred kind of round (the drafter with copy branches) for another only where that one's
#: timed rounds beat it by this factor: copies' width is certain, their hits are not, and two rates over about ten
#: rounds differ by a few per cent by chance
KIND_MARGIN = 1.05


class Plan(StrEnum):
    """A batch's kind of drafting round, by its draft sources (as `draft_sources` names them): its drafter alone,
    its drafter and copy branches in one tree, copy branches alone (their timed rounds are `LossBudget` keys (depth, copies): (k, False), (k, True), (0, True))."""

    EAGLE = "eagle"
    EAGLE_COPY = "eagle+copy"
    COPY = "copy"


EAGLE, EAGLE_COPY, COPY = Plan.EAGLE, Plan.EAGLE_COPY, Plan.COPY


@dataclass
class KindTries:
    """A batch's tries of the kinds it does not prefer: the kind being tried, its rounds left and their depth; the
    drafting round each kind was last tried in (never tried: absent); its wide rounds of each kind so far."""

    kind: Plan | None = None
    left: int = 0
    depth: int = 0
    last: dict = field(default_factory=dict)
    rounds_of: dict = field(default_factory=dict)


class BatchPlan:
    """Which kind of drafting round a batch runs (`plan`), from its schedule's timed rounds and gains (the
    schedule passes itself to `choose`: no reference back to it, so a call's objects are freed by reference
    counting). `kind`: this round's kind as the batch's timed rounds key it, (the drafter's depth (0: copy branches
    alone), whether copy branches join it), where the plan chose it: the plan's rounds are timed as its own
    whatever its rows then drafted (copies alone where no row found a match: a plain round). `drafts`: whether the
    drafter drafts (False: copy branches alone); `copying`: whether copy branches draft (False: the drafter alone,
    the batch's only kind of drafting round)."""

    def __init__(self, probe_every: int, max_probe_every: int, drafts: bool = True, copying: bool = True):
        self.drafts, self.copying = drafts, copying
        self.backoff = Backoff(probe_every, max_probe_every)  # the tries of the kinds the batch does not prefer
        self.tries = KindTries()
        self.rounds = 0  # drafting rounds so far
        self.gains = {}  # kind -> its gain this round (None: not timed; `kind_gains`)
        self.copies_gain = None  # the timed rounds of copy branches alone this round (None: not timed)
        self.plan = None  # this round's kind (None: no drafting round; copy branches draft where their own timed
        # rounds pay)
        self.kind = None
        self.preferred = self.drafter_plan = EAGLE_COPY  # the kinds the timed rounds prefer, of all and of those
        # where the drafter drafts

    @property
    def copies(self) -> bool:
        """Whether copy branches join the drafter this round (where the rows have them)."""
        return self.plan != EAGLE

    def choose(self, s, k: int, gain: float) -> tuple[int, float]:
        """(k, gain) of this round's best draft, and its kind (`plan`): the drafter with copy branches in its tree
        (each row then drafts with the sources that pay for it), unless the drafter alone or copy branches alone
        beat it by `KIND_MARGIN` in their timed rounds; a kind is gained by its timed rounds where two were
        timed, at k or the deepest depth below for the drafter's, and the kinds not preferred are tried now and
        then (`try_kinds`). `s`: the schedule (`DraftLengthController`)."""
        self.copies_gain = copies = s.measured_gains().get((0, True))  # (read by `copy_branches`)
        if not self.copying:
            self.plan = EAGLE
            return k, gain
        if not self.drafts:  # copy branches alone: their timed rounds have the last word on whether they draft
            return k, gain if copies is None else min(gain, copies)
        self.gains = gains = self.kind_gains(s, k, gain, copies)

        def score(kind):  # (ties to the earlier kind: the drafter with copies first)
            return (gains[kind] or 0.0) / (1.0 if kind == EAGLE_COPY else KIND_MARGIN)

        self.drafter_plan = max((EAGLE_COPY, EAGLE), key=score)
        self.plan = self.preferred = max((self.drafter_plan, COPY), key=score)
        return k, gains[self.plan]

    @staticmethod
    def kind_gains(s, k: int, gain: float, copies: float | None) -> dict[str, float | None]:
        """The gain of each kind of drafting round at depth k (None: not timed): the drafter alone (`gain`, the
        schedule's `best`), with copy branches in its tree (the model's gain while none was timed) and copy
        branches alone."""
        timed = s.budget.timed(MEASURED_ROUNDS)
        eagle = any(0 < d <= k and not c and sums.expected for (d, c), sums in timed.items())
        both = {d: sums for (d, c), sums in timed.items() if c and 0 < d <= k and sums.expected}
        both_gain = s.timed_gain(k, max(both), both[max(both)]) if both else None
        return {EAGLE: gain if eagle else None, EAGLE_COPY: gain if both_gain is None else both_gain, COPY: copies}

    def try_kinds(self, k: int, paying: bool) -> int:
        """A drafting round at depth k: a kind the batch does not prefer is tried for `MEASURED_ROUNDS` rounds at
        one depth (the rounds a verdict needs, timed per depth), at once if it was never tried, else (while
        drafting pays) the kind tried longest ago whose try is due (`try_due`). Returns the round's depth."""
        t = self.tries
        self.rounds += 1
        if t.left > 0:
            t.left -= 1
            self.plan = t.kind
            return t.depth
        others = [kind for kind in (EAGLE, COPY, EAGLE_COPY) if kind != self.preferred]
        fresh = [kind for kind in others if self.gains[kind] is None and kind not in t.last]
        due = [kind for kind in sorted(others, key=lambda kind: t.last.get(kind, -1)) if self.try_due(kind)]
        if fresh or (paying and due):
            if not fresh:
                self.backoff.restart()
                self.backoff.failed()
            self.plan = t.kind = (fresh or due)[0]
            t.left, t.last[self.plan], t.depth = MEASURED_ROUNDS - 1, self.rounds, k
        else:
            self.backoff.skip()
        return k

    def try_due(self, kind: str) -> bool:
        """Whether a try of a kind not preferred is due: after the try's wait (16 drafting rounds, doubling with
        each try), once the rounds since the last try absorb its expected loss against the preferred kind (by
        their timed gains) at `RETRY_SHARE` of their time, as a dropped drafter's tries are paced, and at the
        latest after the longest wait. A kind close to the preferred one is tried every wait; one far below it
        seldom (batched translation: the drafter's own rounds at 1.0x plain beside copies alone at 2.4x, each try
        a loss of more than a round)."""
        p, gains = self.backoff, self.gains
        best, gain = gains[self.preferred] or 0.0, gains[kind]
        loss = MEASURED_ROUNDS * (max(1.0 - gain / best, 0.0) if gain is not None and best > 0 else 0.0)
        return p.due() and (p.absorbs(loss, RETRY_SHARE) or p.skipped >= p.most)

    def first_of_kind(self, timing) -> bool:
        """Whether a wide round is among the first `MEASURED_ROUNDS` of its kind (`EAGLE`, `EAGLE_COPY`, `COPY`) in
        this call: what a measured verdict on the kind needs, at most six rounds a call, so their loss is not held
        against the loss budget (else one losing try at the start of a call, a few plain rounds' time in, would
        spend it and rest every source for a dozen rounds)."""
        depth, copies = timing.kind or (timing.depth, timing.copies)
        kind = (EAGLE, EAGLE_COPY)[copies] if depth else COPY
        self.tries.rounds_of[kind] = self.tries.rounds_of.get(kind, 0) + 1
        return self.tries.rounds_of[kind] <= MEASURED_ROUNDS
