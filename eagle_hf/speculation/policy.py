"""The schedule's decisions that differ between a single row and a batch, each in a policy of its own.

A single row's costs were measured on that row, and its tokens per round vary too much (a copy round yields 1 token
or 12) for a running rate to judge a depth: its schedule decides from the models alone. A batch's rows pay for the
widest row's tree, and a plain round of many rows is not a one-row forward times the rows: a batch times its rounds
(`LossBudget`), lets them have the last word over the models, times a plain round now and then, and chooses its
kind of drafting round (`BatchPlan`). Both policies answer the same questions of the schedule
(`eagle_hf.speculation.schedule.DraftLengthController`, passed as `s`: no reference back to it) and hold nothing;
each round the schedule asks the policy of its rows (`DraftLengthController.policy`, by the rows verified together,
which fall as a batch's rows finish).
"""

from __future__ import annotations

from .batch_plan import COPY, EAGLE, MEASURED_ROUNDS


class OneRowPolicy:
    """A single row's decisions: the models' alone; no timed rounds, no plain rounds of its own, no kinds."""

    def timed(self, s) -> dict:
        """The drafter's timed depths that overrule the model's gains (`DraftLengthController.best`): none."""
        return {}

    def plan(self, s, k: int, gain: float) -> tuple[int, float]:
        """(k, gain) of this round's best draft: the schedule's own."""
        return k, gain

    def measured_gains(self, s) -> dict[tuple[int, bool], float]:
        """Timed drafting rounds by kind: none."""
        return {}

    def copies_draft(self, s, depth: int) -> bool:
        """Whether copy branches draft this round, where they do not rest (else they only retry): they do."""
        return True

    def try_kinds(self, s, k: int) -> int:
        """This round's drafter depth, where a batch would try a kind it does not prefer: k."""
        return k

    def kind(self, s, depth: int) -> tuple[int, bool] | None:
        """This round's kind as a batch's timed rounds key it: None."""
        return None

    def plain_first(self, s) -> bool:
        """Whether a plain round is timed before anything else: no."""
        return False

    def plain_due(self, s) -> bool:
        """Whether a drafting round gives way to a timed plain round: never."""
        return False

    def untimed(self, s) -> bool:
        """Whether the drafter still lacks timed rounds (and is tried as one never tried is): no."""
        return False


class BatchPolicy:
    """A batch's decisions: its timed rounds have the last word, a plain round is timed first and then every
    `plain_every` drafting rounds, and it chooses its kind of drafting round (`BatchPlan`)."""

    def timed(self, s) -> dict:
        """The drafter's depths timed `MEASURED_ROUNDS` times without copy branches in its tree; where none was,
        with them."""
        timed = {key: sums for key, sums in s.budget.timed(MEASURED_ROUNDS).items()
                 if 0 < key[0] <= s.max_draft and sums.expected}
        alone = {d: sums for (d, copies), sums in timed.items() if not copies}
        return alone or {d: sums for (d, _), sums in timed.items()}

    def plan(self, s, k: int, gain: float) -> tuple[int, float]:
        """(k, gain) of this round's best draft, and its kind of drafting round (`BatchPlan.choose`)."""
        return s.kinds.choose(s, k, gain)

    def measured_gains(self, s) -> dict[tuple[int, bool], float]:
        """The timed drafting rounds by kind, (the drafter's depth (0: copy branches alone), whether copy branches
        were verified), each timed at least `MEASURED_ROUNDS` times: their tokens per second over plain rounds'
        (timed, or modelled while none was); none before the cost model has a time."""
        c, b = s.costs, s.budget
        if c.cost.base_seconds <= 0:
            return {}
        plain = b.plain_seconds or c.plain * c.cost.base_seconds * c.rows
        return {d: sums.tokens / max(sums.seconds, 1e-9) * plain for d, sums in b.timed(MEASURED_ROUNDS).items()}

    def copies_draft(self, s, depth: int) -> bool:
        """Beside the drafter and in a plan of copies alone they draft; in a round where the drafter rests while
        nothing pays, while their timed rounds alone beat plain ones (before any was timed too)."""
        measured = s.kinds.copies_gain
        return depth > 0 or s.plan == COPY or measured is None or measured >= s.keep_gain

    def try_kinds(self, s, k: int) -> int:
        """This round's drafter depth: in a drafting round of a batch with both sources, a kind it does not prefer
        is tried now and then (`BatchPlan.try_kinds`)."""
        if not (s.kinds.drafts and s.kinds.copying and k > 0):
            return k
        return s.kinds.try_kinds(k, paying=s._drafting)

    def kind(self, s, depth: int) -> tuple[int, bool] | None:
        """This round's kind as the batch's timed rounds key it, (the drafter's depth, whether copy branches join
        it), where its plan chose a drafting round."""
        return None if s.plan is None else (depth, s.plan != EAGLE)

    def plain_first(self, s) -> bool:
        """Whether no plain round was timed yet: a batch times one before anything else (its losses are counted
        against it)."""
        return not s.budget.plain_seconds

    def plain_due(self, s) -> bool:
        """Whether `plain_every` drafting rounds went by since the last plain one: a plain round of many rows is not
        a one-row forward times the rows, and without one the measured verdict would rest on that model."""
        return s.budget.since_plain >= s.budget.plain_every

    def untimed(self, s) -> bool:
        """Whether the drafter has no kind of round timed `MEASURED_ROUNDS` times yet: a batch's verdict is
        measured, so it drafts until then."""
        return s.kinds.drafts and not any(d > 0 for d, _ in s.budget.timed(MEASURED_ROUNDS))


ONE_ROW, BATCH = OneRowPolicy(), BatchPolicy()
