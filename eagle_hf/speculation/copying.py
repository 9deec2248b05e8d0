"""Copy drafting: continuations of earlier occurrences of the text's own suffix, as deterministic draft branches.

Answers copy their input (summaries, extraction, code edits, multi-turn chats): where the last few tokens occurred
before in the prompt or the output, what followed them then is a strong guess for what follows now. The
`CopyIndex` keeps every n-gram (n = 1..max_ngram) of the context with the positions where it ended, updated
in O(max_ngram) per appended token; a lookup tries the longest suffix first and reads the continuations of its
most recent occurrences (a bounded scan, independent of the context length).

The `CopySource` turns matches into branches for the round's draft tree and decides their lengths from running
acceptance: a copy token is drafted while the probability that it is reached and accepted exceeds the extra
verify cost it adds (both in units of one-token target forwards, whose value is one token), so a long, reliable
match earns a long branch and a source that keeps failing drafts nothing; it retries after a wait that
doubles with each failed retry (exponential backoff).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from .schedule import Backoff, moved
from .tree import COPY, EAGLE, DraftTree

#: occurrences scanned per suffix length (the most recent first): bounds a lookup's cost at any context length
MAX_OCCURRENCES = 8


class CopyIndex:
    """Hashed n-grams of a growing token sequence -> the positions right after each occurrence."""

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> indices just past its occurrences, ascending

    def extend(self, tokens) -> None:
        """Append tokens: O(max_ngram) dictionary updates each."""
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in range(1, min(self.max_ngram, end) + 1):
                self.ends.setdefault(tuple(self.tokens[end - n : end]), []).append(end)

    def matches(self, num_branches: int, length: int) -> list[tuple[list[int], int]]:
        """Up to `num_branches` distinct continuations (at most `length` tokens) of the current suffix, as
        ``(tokens, match length)``: longest match first, then the most recent occurrence. A continuation cut short
        by the end of the text (a recent occurrence) that an older occurrence's runs on past is that longer one,
        in its place."""
        out: list[tuple[tuple[int, ...], int]] = []
        suffix = self.tokens[-self.max_ngram :]
        end = len(self.tokens)
        seen = set()  # occurrences read at a longer match: their continuation is one of `out`'s already
        for n in range(min(self.max_ngram, len(suffix), end - 1), 0, -1):  # (the whole text: no match)
            positions = self.ends.get(tuple(suffix[len(suffix) - n :]), ())
            scanned = 0
            for e in reversed(positions):
                if e >= end:
                    continue  # the suffix itself
                scanned += 1
                if e in seen:
                    if scanned == MAX_OCCURRENCES:
                        break
                    continue
                seen.add(e)
                cont = tuple(self.tokens[e : e + length])
                if cont and not any(c[: len(cont)] == cont for c, _ in out):  # (not one of them, nor a prefix)
                    cut = next((i for i, (c, _) in enumerate(out) if cont[: len(c)] == c), None)
                    if cut is not None:  # an earlier one is this one cut short: this one runs on, in its rank
                        out[cut] = (cont, out[cut][1])
                    else:
                        out.append((cont, n))
                        if len(out) == num_branches:
                            break
                if scanned == MAX_OCCURRENCES:
                    break
            if len(out) == num_branches:
                break
        return [(list(c), n) for c, n in out]


@dataclass
class CopyAcceptance:
    """Running acceptance of copy drafts: the first token by match length, every later token given the one
    before was accepted."""

    max_ngram: int
    first: list[float] = field(default_factory=list)  # [max_ngram] P(first copy token accepted | match length n)
    later: float = 0.8  # P(copy token i+1 accepted | token i accepted)
    seen_first: list[int] = field(default_factory=list)
    seen_later: int = 0
    prior_weight: float = 2.0
    decay: float = 0.85  # copying comes and goes with the text: recent rounds weigh most

    def __post_init__(self):
        if not self.first:  # longer matches are likelier to continue
            self.first = [min(0.2 + 0.1 * n, 0.6) for n in range(1, self.max_ngram + 1)]
        self.seen_first = [0] * self.max_ngram

    def reach(self, match: int, i: int) -> float:
        """P(the copy branch's first i+1 tokens are all accepted)."""
        return self.first[match - 1] * self.later**i

    def update(self, match: int, drafted: int, accepted: int) -> None:
        """One branch's outcome: its first `accepted` of `drafted` tokens were accepted."""
        self.seen_first[match - 1] += 1
        self.first[match - 1] = moved(self.first[match - 1], float(accepted > 0), self.seen_first[match - 1],
                                      self.prior_weight, self.decay)
        for i in range(1, min(drafted, accepted + 1)):  # tokens whose predecessor was accepted
            self.seen_later += 1
            self.later = moved(self.later, float(i < accepted), self.seen_later, self.prior_weight, self.decay)


@dataclass
class Branch:
    tokens: list[int]  # the copied continuation (target ids)
    match: int  # length of the matched suffix


class Wait(StrEnum):
    """What a proposal does to the copy source's wait when the round's plan is executed."""

    SKIP = "skip"  # the context matched, but no branch pays: the source sits the round out
    RESTART = "restart"  # a retry: the count starts again


@dataclass
class Proposal:
    """The copy source's proposal for a round: its `branches`, what executing it does to its wait, and what the
    source expects of them: the copy drafts accepted (`CopySource.expected_tokens`) and the chance that no branch's
    first token is (`CopySource.missed`)."""

    branches: list[Branch]
    wait: Wait | None = None
    expected: float = 0.0
    missed: float = 1.0


class CopySource:
    """Proposes this round's copy branches, sized by expected gain, and learns from their outcomes.

    `marginal_cost(n)`: the extra cost of verifying `n` more tokens, in one-token target forwards.
    `stop_tokens`: a branch ends at the first of them (EOS: nothing after it is ever emitted; a copy of an earlier
    turn would otherwise run on into the next turn's header)."""

    def __init__(self, max_ngram: int, length: int, num_branches: int, marginal_cost: Callable[[int], float],
                 probe_every: int = 16, max_probe_every: int = 64, stop_tokens: Collection[int] = ()):
        self.stop_tokens = frozenset(stop_tokens)
        self.index = CopyIndex(max_ngram)
        self.acceptance = CopyAcceptance(max_ngram)
        self.length, self.num_branches, self.marginal_cost = length, num_branches, marginal_cost
        self.backoff = Backoff(probe_every, max_probe_every)  # when a dropped source tries again
        self.branches: list[Branch] = []  # this round's branches (the plan's, `begin_round`)
        self.tree: DraftTree | None = None  # the branches as this round's copy tree (None: no branches)
        self.leads = False  # the last accepted draft was a copy's: a greedy layout puts the branches first

    def propose(self, room: int, verified: int = 1, retry_only: bool = False, retry: bool | None = None) -> Proposal:
        """This round's branches (at most `room` tokens each) on top of a tree of `verified` tokens (1: sized by
        their own acceptance, as copy drafting alone sizes them, whoever else drafts this round); with
        `retry_only` (drafting rounds were measured not to pay) only a retry. `retry`: whether this round may
        retry, decided by the caller (a batch retries all its rows in the same rounds: every row pays for the
        widest row's tree); None: the source's own wait decides. Nothing changes until the round's plan is
        executed (`begin_round`)."""
        if room <= 0:
            return Proposal([])
        matches = self.index.matches(self.num_branches, min(self.length, room))
        branches, retrying = [], False
        for tokens, match in matches:
            tokens = _through_stop(tokens, self.stop_tokens)
            n = 0
            while not retry_only and n < len(tokens) and self.acceptance.reach(match, n) > self.marginal_cost(verified):
                n, verified = n + 1, verified + 1
            due = self.backoff.due() if retry is None else retry
            if n == 0 and not branches and due and self.marginal_cost(verified) < 1:
                # refresh the estimates of a source that was dropped; never where even a sure hit costs more than
                # it yields (a large batch: every row pays for one row's longer tree)
                n, retrying = min(2, len(tokens)), True
            if n:
                branches.append(Branch(tokens[:n], match))
        wait = Wait.SKIP if matches and not branches else (Wait.RESTART if retrying else None)
        if not branches:
            return Proposal(branches, wait)
        return Proposal(branches, wait, self.expected_tokens(branches), self.missed(branches))

    def begin_round(self, branches: list[Branch], wait: Wait | None = None) -> None:
        """Execute the round's plan for the copy source: the `branches` it drafts (and learns from), as this round's
        copy `tree`, and what its proposal did to its wait (`Proposal.wait`: it sat the round out, or it retries)."""
        self.branches = branches
        self.tree = self._tree() if branches else None
        if wait == Wait.SKIP:
            self.backoff.skip()
        elif wait == Wait.RESTART:
            self.backoff.restart()

    def _tree(self) -> DraftTree:
        """The round's branches as one tree below its root, the text's last token (a prefix two branches share is
        one path), each copy token scored by the acceptance estimate: the first by its branch's match length,
        a later one given the one before."""
        a = self.acceptance
        tokens, parents, scores = [self.index.tokens[-1]], [-1], [0.0]
        child: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for branch in self.branches:
            node = 0
            for i, token in enumerate(branch.tokens):
                if (node, token) not in child:
                    tokens.append(token), parents.append(node)
                    scores.append(scores[node] + math.log(max(a.first[branch.match - 1] if i == 0 else a.later, 1e-6)))
                    child[(node, token)] = len(tokens) - 1
                node = child[(node, token)]
        return DraftTree.of_lists(tokens, parents, scores, [EAGLE] + [COPY] * (len(tokens) - 1))

    def expected_tokens(self, branches: Sequence[Branch]) -> float:
        """Drafts `branches` are expected to get accepted: each token's chance to be reached and accepted, a prefix
        shared with an earlier branch counted once (the branches are alternatives)."""
        total, earlier = 0.0, []
        for b in branches:
            shared = max((_common_prefix(b.tokens, e) for e in earlier), default=0)
            total += sum(self.acceptance.reach(b.match, i) for i in range(shared, len(b.tokens)))
            earlier.append(b.tokens)
        return total

    def missed(self, branches: Sequence[Branch]) -> float:
        """P(no branch's first token is accepted), the branches' first tokens taken as exclusive guesses."""
        firsts = {b.tokens[0]: self.acceptance.first[b.match - 1] for b in branches}
        return max(1.0 - sum(firsts.values()), 0.0)

    def update(self, taken: list[int]) -> None:
        """Outcome of this round's branches given the accepted draft tokens `taken` (root excluded)."""
        reached = 0  # tokens the branches reached
        for branch in self.branches:
            n = _common_prefix(branch.tokens, taken)
            self.acceptance.update(branch.match, len(branch.tokens), n)
            reached = max(reached, n)
        if self.branches:
            self.backoff.paid() if reached else self.backoff.failed()


def cut_branches(branches: list[Branch], nodes: int) -> list[Branch]:
    """`branches` cut to the first `nodes` nodes of their tree (a static cache's free slots; a prefix shared with an
    earlier branch is no new node): a branch keeps, and teaches, only what is verified."""
    kept, seen = [], set()
    for branch in branches:
        n = 0
        while n < len(branch.tokens):
            prefix = tuple(branch.tokens[: n + 1])  # a node of the tree, named by its path
            if prefix not in seen and len(seen) >= nodes:
                break
            seen.add(prefix)
            n += 1
        if n:
            kept.append(Branch(branch.tokens[:n], branch.match))
    return kept


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _through_stop(tokens: list[int], stop_tokens: frozenset[int]) -> list[int]:
    """`tokens` up to and including the first stop token."""
    for i, t in enumerate(tokens):
        if t in stop_tokens:
            return tokens[: i + 1]
    return tokens
