"""Drafting with an EAGLE head: the drafter's cache of real rows, and the one function that grows a draft tree.

Real rows (prompt and accepted tokens) are always computed from the target's own hidden states; speculative
rows live only for one round and are dropped before the next (eagle_spec.md §5.4). A chain is the tree with
``top_k = 1``; with a sampling chooser its drafts keep the exact distributions they were drawn from.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..drafter.graphs import LevelGraphs
from ..drafter.modeling import KV, DraftStep, EagleDrafter, KVWriter
from .draft_programs import Choice, DraftPrograms, flatten_kept, grow_levels, kept_layout, top_k_choice
from .ragged import KeptMask, Ragged, SlotBuffers, new_buffers
from .transfer import pack, to_device
from .tree import DraftTree

#: catch-ups of at most this many rows per row use the kept attention mask (a prompt's build their own)
KEPT_MASK_ROWS = 64
#: a round's catch-up of at most this many rows a row runs at fixed shapes where the levels do (`DraftState.graphs`)
FIXED_CATCH_UP = 16
#: a prompt's catch-up reads at most this many rows per drafter forward: its activations (the drafter's MLP has
#: the target's width) over 8k rows added ~0.7 GiB to the peak of a Llama-3.1-8B-shaped call (H200 device check)
CATCH_UP_CHUNK = 1024


@dataclass
class DraftState:
    """The drafter's cache of real rows for the rows of a batch, preallocated: keys and values
    ``[B, kv_heads, capacity, d]`` (`slots`, grown in place: `eagle_hf.speculation.ragged.SlotBuffers`), of which
    the first `length` slots hold real rows; a round's tree rows are written after them and dropped
    (overwritten) by the next round.

    Row b reads the slots `ragged` says (a batch's rows read different numbers of rows per round, and a shorter
    row's extra slots are holes, see `eagle_hf.speculation.ragged`). Row b's next real row sits at position ``positions[b]``
    (> 0 at first when the target's cache already held a prefix the drafter never saw)."""

    positions: list[int] = field(default_factory=lambda: [0])
    slots: SlotBuffers | None = None  # keys and values [B, kv_heads, capacity, d]
    ragged: Ragged | None = None
    steps: int = 0  # drafter forwards over draft levels so far (catch-ups not counted): what a round's levels cost
    # [B, 1, R, C] bool, the draft levels' attention mask kept between levels and rounds: columns below `length`
    # hold each row's slot validity for every query row (written as real rows arrive), the tree block after them
    # is rewritten per level: O(new slots), never O(context), per level
    _mask: KeptMask = field(default_factory=KeptMask, repr=False)
    #: draft levels at fixed shapes (captured on CUDA; `eagle_hf.drafter.graphs`), None: eager
    graphs: LevelGraphs | None = field(default=None, repr=False)
    #: how the fixed-shape programs run (`eagle_hf.programs.how_to_run`): "graph", "compile" or "eager"
    how: str = "eager"

    def __post_init__(self):
        if self.ragged is None:
            self.ragged = Ragged([0] * len(self.positions), 0)

    @property
    def rows(self) -> int:
        return len(self.positions)

    @property
    def length(self) -> int:
        """Slots per row (real rows and holes)."""
        return self.ragged.length

    @property
    def keys(self) -> torch.Tensor | None:
        """The keys' whole storage ``[B, kv_heads, capacity, d]`` (None before the first rows)."""
        return None if self.slots is None else self.slots.buffers[0]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.slots is None else self.slots.buffers[1]

    @property
    def kv(self) -> KV | None:
        """The real rows' keys and values ``[B, kv_heads, length, d]`` (views)."""
        return None if self.slots is None else KV(*self.slots.live(self.length))

    @property
    def valid(self) -> torch.Tensor | None:
        """[B, length] bool: which slots each row reads (None: all)."""
        return self.ragged.valid

    @property
    def next_position(self) -> int:
        """A single row's next position (a batch's rows: `positions`)."""
        return self.positions[0]

    def reserve(self, drafter: EagleDrafter, extra: int, like: torch.Tensor) -> None:
        """Room for `extra` slots after the real rows (`SlotBuffers.reserve`: amortised O(1) per slot); `like`:
        the drafter's activations (their dtype and device)."""
        if self.slots is None:
            cfg = drafter.config
            empty = like.new_empty(self.rows, cfg.num_key_value_heads, 0, cfg.head_dim)  # [B, kv_heads, 0, d]
            allocate = new_buffers if self.graphs is None else _graphs_storage(self.graphs, weakref.ref(self))
            self.slots = SlotBuffers.holding((empty, empty), extra, allocate=allocate)
        else:
            if self.length + extra > self.slots.capacity:
                self.launch_staged(drafter)  # (its rows belong in the storage the new one copies)
            self.slots.reserve(self.length, extra)

    def staged(self, drafter: EagleDrafter) -> bool:
        """Whether a catch-up waits to run with the next levels (`extend`'s `staged`)."""
        return self.graphs is not None and self.keys is not None and self.programs(drafter).staged is not None

    def launch_staged(self, drafter: EagleDrafter) -> None:
        """Run a catch-up staged for the next levels (`extend`'s `staged`) now, on its own."""
        if self.graphs is not None and self.keys is not None:
            self.programs(drafter).launch_staged()

    def level_forward(self, drafter: EagleDrafter, feed: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                      at: int, mask: torch.Tensor | None) -> DraftStep:
        """One draft level: the drafter over feed [B, k, H] with tokens and positions [B, k], its rows written at
        slots ``at ..`` (`reserve` first), `mask` [B|1, 1, k, at+k] (None: the plain causal layout). Eager, or
        at fixed shapes (`graphs`): the same arithmetic."""
        if self.graphs is None:
            return drafter.step(feed, ids, positions, past=self.writer(at), mask=mask)
        level = self.graphs.level(self.keys, self.values, self.rows, ids.shape[1])
        return level.run(feed, ids, positions, at, mask)

    def writer(self, at: int) -> KVWriter:
        """Where a drafter pass writes its rows: slot `at` onwards (`reserve` first)."""
        return KVWriter(self.keys, self.values, at)

    def extend(self, drafter: EagleDrafter, aux: torch.Tensor, next_tokens: torch.Tensor,
               counts: list[int] | None = None, staged: int | None = None):
        """Add real rows: row b reads ``aux[b, :counts[b]]`` (target taps [B, n, A*H_t]), each with the token after
        it (``next_tokens`` [B, n]); default: all n. One drafter forward for the batch (a long prompt: one per
        `CATCH_UP_CHUNK` rows), one host-to-device copy.

        Returns each row's last new row's draft logits ``[B, Vd]`` and fed-back hidden state ``[B, 1, H]``
        (meaningless for a row that read nothing). `staged` = m: a catch-up at fixed shapes (`_extend_fixed`) is
        padded to m rows a row at least and written, not launched: the next draft levels run it first, in their
        program (`DraftPrograms.grow`), and only then are the returned buffers written."""
        rows, n = next_tokens.shape
        device = next_tokens.device
        counts = [n] * rows if counts is None else counts
        if n > CATCH_UP_CHUNK:
            return self._extend_in_chunks(drafter, aux, next_tokens, counts)
        full = all(c == n for c in counts)
        if self.graphs is not None and full and not self.ragged.holes and n <= FIXED_CATCH_UP:
            return self._extend_fixed(drafter, aux, next_tokens, staged)
        self.launch_staged(drafter)
        host = pack(device, positions=[[p + i for i in range(n)] for p in self.positions],
                    last=[max(c, 1) - 1 for c in counts],
                    **({} if full else {"new_valid": [[i < c for i in range(n)] for c in counts]}))
        new_valid = None if full else host["new_valid"].bool()  # [B, n]
        mask = None  # every slot real and every row full: the plain causal layout
        if self.ragged.holes or not full:
            own = torch.ones(n, n, dtype=torch.bool, device=device).tril().expand(rows, n, n)  # [B, n, n]
            if new_valid is not None:
                own = own & new_valid[:, None, :]
            own = own | torch.eye(n, dtype=torch.bool, device=device)  # a padding row sees itself: no empty softmax
            if n <= KEPT_MASK_ROWS:  # a round's catch-up: [B, 1, n, L + n], a view of the kept mask
                mask = self._mask.view(own, self.length, self.valid, torch.bool)
            else:  # (a prompt's: not worth keeping n query rows)
                past = self.valid if self.ragged.holes else own.new_ones(rows, self.length)  # [B, L]
                mask = torch.cat([past[:, None, :].expand(rows, n, self.length), own], 2)[:, None]
        fused = drafter.fuse(aux)  # [B, n, H]
        self.reserve(drafter, n, fused)
        out = drafter.step(fused, next_tokens, host["positions"], past=self.writer(self.length), mask=mask,
                           compute_logits=False)
        self._mask.arrive(self.length, n, new_valid)
        self.ragged.append(counts, n, new_valid, device)
        self.positions = [p + c for p, c in zip(self.positions, counts)]
        last = host["last"][:, None, None]  # [B, 1, 1] each row's last new row
        normed = out.normed.gather(1, last.expand(rows, 1, out.normed.shape[-1]))  # [B, 1, H]
        hidden = out.hidden.gather(1, last.expand(rows, 1, out.hidden.shape[-1]))  # [B, 1, H]
        self.compact()
        return drafter.lm_head(normed[:, 0]), hidden

    def _extend_fixed(self, drafter: EagleDrafter, aux: torch.Tensor, next_tokens: torch.Tensor,
                      staged: int | None = None):
        """`extend` for a round's catch-up at fixed shapes (`graphs`): every row reads its n rows (no holes), in one
        program (`DraftPrograms.catch_up`: n padded to the next power of two, `staged` rows at least, the padding
        rows written after the real ones and overwritten by the next pass, which never reads them)."""
        rows, n = next_tokens.shape
        bucket = 1 << (max(n, staged or 1) - 1).bit_length()
        self.reserve(drafter, bucket, drafter.fc.weight)
        logits, hidden = self.programs(drafter).catch_up(aux, next_tokens, self.positions, self.length, bucket,
                                                         stage=staged is not None)
        self._mask.arrive(self.length, n, None)
        self.ragged.append([n] * rows, n, None, next_tokens.device)
        self.positions = [p + n for p in self.positions]
        self.compact()
        return logits, hidden  # [B, Vd], [B, 1, H]

    def programs(self, drafter: EagleDrafter) -> DraftPrograms:
        """The draft programs over the cache's current storage (kept with the drafter's levels: a later call of
        the same shape reuses them)."""
        key = ("programs", self.keys.data_ptr(), tuple(self.keys.shape), self.how, torch.is_inference_mode_enabled())
        return self.graphs.kept(key, lambda: DraftPrograms(drafter, self.keys, self.values, self.how))

    def _extend_in_chunks(self, drafter: EagleDrafter, aux: torch.Tensor, next_tokens: torch.Tensor,
                          counts: list[int]):
        """`extend` over many rows (a long prompt), `CATCH_UP_CHUNK` at a time: each chunk reads the rows cached
        before it, so the cache and each row's result are those of one pass, with a bounded peak. A row's result
        (logits [B, Vd], hidden [B, 1, H]) is the chunk's that holds its last new row."""
        n = next_tokens.shape[1]
        logits = hidden = None
        for start in range(0, n, CATCH_UP_CHUNK):
            end = min(start + CATCH_UP_CHUNK, n)
            part = [min(max(c - start, 0), end - start) for c in counts]  # each row's rows in this chunk
            if not any(part):
                break
            got = self.extend(drafter, aux[:, start:end], next_tokens[:, start:end], part)
            if logits is None:
                logits, hidden = got
                continue
            ends_here = [b for b, c in enumerate(counts) if start < c <= end]
            if ends_here:  # (host-decided rows: one asynchronous copy of their indices)
                idx = to_device(torch.tensor(ends_here, dtype=torch.long), logits.device)
                logits[idx], hidden[idx] = got[0][idx], got[1][idx]
        return logits, hidden

    def level_mask(self, ancestors: torch.Tensor | None, k: int, fed_width: int) -> torch.Tensor | None:
        """[B, 1, k, length + fed + k] bool (a view of the kept mask): each of a level's k frontier nodes sees its
        row's real rows, its fed ancestors and itself (`ancestors` [B, k, fed + k] on the device; None: a chain,
        which sees every fed row). None for a chain over a cache without holes (the plain causal layout)."""
        if ancestors is None and not self.ragged.holes:
            return None
        if ancestors is None:  # a chain over a cache with holes: every fed row is an ancestor
            ancestors = torch.ones(self.rows, k, fed_width + k, dtype=torch.bool, device=self.keys.device)
        return self._mask.view(ancestors, self.length, self.valid, torch.bool)

    def select(self, rows: list[int]) -> None:
        """Keep these rows of the batch (finished rows leave); their holes go at the next compaction."""
        if self.slots is not None:
            index = to_device(torch.tensor(rows), self.keys.device)
            self.slots.select(index)
            self.ragged.select(rows, index)
            self._mask.select(index)
        else:
            self.ragged.counts = [self.ragged.counts[b] for b in rows]
        self.positions = [self.positions[b] for b in rows]

    def compact(self) -> None:
        """Drop the holes once they are worth it (`eagle_hf.speculation.ragged`)."""
        if not self.ragged.worth_compacting():
            return
        index = self.ragged.compact()  # [B, W]
        self._mask.drop()
        self.slots.compact(index)


def _graphs_storage(graphs: LevelGraphs, owner: weakref.ref) -> Callable:
    """Allocates a drafter cache's keys and values (both ``[B, kv_heads, C, d]``) from the fixed-shape levels'
    storage, C rounded up to a power of two: calls of nearby lengths share it and its graphs. (The cache is held
    weakly: its buffers must not keep it alive, so a call's cache is freed when the call returns.)"""

    def allocate(shapes: tuple, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, c, d = shapes[0]
        return graphs.buffers((b, h, 1 << (c - 1).bit_length(), d), like, owner())

    return allocate


#: chooses the children of k nodes from their draft logits [k, Vd]; `paths` are the nodes' draft tokens below
#: the root (for logits processors that read the prefix)
Chooser = Callable[[torch.Tensor, list[list[int]]], Choice]


def read_choices(choices: list[Choice]) -> list[tuple[list[list[int]], list[list[float]]]]:
    """Per choice: its tokens and log-probabilities as host lists, all read in one device-to-host copy."""
    flat = torch.cat([t for c in choices for t in (c.tokens.reshape(-1).double(), c.logp.reshape(-1).double())])
    values, out, at = flat.tolist(), [], 0
    for c in choices:
        k, n = c.tokens.shape[0], c.tokens.numel()
        width = n // k if k else 0
        tokens = [[int(v) for v in values[at + i * width : at + (i + 1) * width]] for i in range(k)]
        logp = [values[at + n + i * width : at + n + (i + 1) * width] for i in range(k)]
        out.append((tokens, logp))
        at += 2 * n
    return out


class Candidates:
    """One row's drafts so far, on the host; node ids are candidate indices + 1 (0 is the root)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.parent: list[int] = []  # node id of each candidate's parent
        self.score: list[float] = []  # cumulative log-probability
        self.own: list[float] = []  # the candidate's own (conditional) log-probability
        self.q: list[torch.Tensor | None] = []  # the distribution a sampled candidate was drawn from
        self.depth: list[int] = []  # 1 for the root's children

    def add(self, tokens: list[list[int]], logp: list[list[float]], q_logits: torch.Tensor | None,
            parents: list[int], parent_scores: list[float]) -> list[int]:
        """Append the chosen children of `parents` (node ids; per parent its tokens and their log-probabilities);
        returns their candidate indices, best first."""
        first = len(self.tokens)
        for r, parent in enumerate(parents):
            depth = 1 if parent == 0 else self.depth[parent - 1] + 1
            for c, (tok, own) in enumerate(zip(tokens[r], logp[r])):
                self.tokens.append(tok)
                self.parent.append(parent)
                self.own.append(own)
                self.score.append(parent_scores[r] + own)
                self.q.append(None if q_logits is None else q_logits[r, c])
                self.depth.append(depth)
        return sorted(range(first, len(self.tokens)), key=lambda i: -self.score[i])

    def path(self, c: int) -> list[int]:
        """Draft tokens from below the root down to candidate `c`."""
        return [self.tokens[a] for a in _ancestors(c, self.parent)] + [self.tokens[c]]


@dataclass
class _Growth:
    """One row's tree while it grows: its candidates, the nodes to expand next (`frontier`), where each of their
    parents' drafter outputs sits in the last level's output (`parent_slot`), and the candidates fed to the drafter
    so far (`fed`, -1 for padding slots; in the drafter cache's order after the real rows)."""

    depth: int  # levels to grow (0: the row drafts nothing this round, its frontier empty)
    chooser: Chooser | None = None
    cands: Candidates = field(default_factory=lambda: Candidates())
    frontier: list[int] = field(default_factory=list)
    parent_slot: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)

    def start(self, chosen: tuple, top_k: int) -> None:
        """The root's children (the first level, from the catch-up's logits)."""
        self.frontier = self.cands.add(*chosen, [0], [0.0])[:top_k]
        self.parent_slot = [0] * len(self.frontier)

    def prune(self, level: int, prune: bool, min_logp: float) -> None:
        """Keep the frontier nodes that may grow at `level`: below the row's depth, and (`prune`: cumulative,
        else own) log-probability at least `min_logp`."""
        c = self.cands
        keep = [i for i, n in enumerate(self.frontier)
                if level < self.depth and (c.score[n] if prune else c.own[n]) >= min_logp]
        self.frontier, self.parent_slot = [self.frontier[i] for i in keep], [self.parent_slot[i] for i in keep]

    def grow(self, chosen: tuple, top_k: int) -> None:
        """The frontier's chosen children become the next frontier (the best `top_k`)."""
        f, c = self.frontier, self.cands
        self.frontier = c.add(*chosen, [n + 1 for n in f], [c.score[n] for n in f])[:top_k]
        self.parent_slot = [f.index(c.parent[n] - 1) for n in self.frontier]


@torch.no_grad()
def draft_trees(
    drafter: EagleDrafter,
    state: DraftState,
    roots: list[int],
    logits: torch.Tensor,
    hidden: torch.Tensor,
    depths: list[int],
    top_k: int,
    total_tokens: list[int],
    threshold: float = 0.0,
    choosers: list[Chooser | None] | None = None,
    prune: bool = True,
    rows: list[int] | None = None,
    layout: tuple | None = None,
):
    """Grow a draft tree after the last real drafter row of each of `rows` (default: every row of `state`), with one
    drafter forward and one device-to-host read per level for all of them. logits: [B, Vd] and hidden: [B, 1, H],
    every state row's last real row's (a row not in `rows` keeps an empty frontier). roots, depths,
    total_tokens, choosers: per row of `rows`.

    Level by level, the `top_k` best frontier nodes (by cumulative log-probability) get `top_k` children each
    from the row's chooser (default: the drafter's top_k, for all rows at once); the best ``total_tokens - 1``
    drafts are kept, closed under ancestors. With ``top_k = 1`` this is a chain of `depth` drafts.

    `threshold` on the drafter's probability: with `prune`, drafts whose *cumulative* probability is below it are
    dropped (not expanded, not verified); without, a draft whose own probability is below it is kept but not
    expanded (transformers' ``assistant_confidence_threshold`` for chains).

    `layout` = (verify width W, and per state row: its root token, its verify position, its most nodes): where the
    levels run as one program over a cache without holes, the trees are laid out for the verify on the device and
    not read: returns (`TreeLayout`, verify positions [B, W]) instead (the host reads the trees with the verify's
    result: `settle_trees`).
    """
    rows = list(range(state.rows)) if rows is None else rows
    at = {b: i for i, b in enumerate(rows)}  # state row -> index in `rows`
    growth = [_Growth(depths[at[b]], choosers[at[b]] if choosers else None) if b in at else _Growth(0)
              for b in range(state.rows)]
    min_logp = math.log(threshold) if threshold > 0 else -math.inf
    real_len = state.length
    drafting = [b for b, g in enumerate(growth) if g.depth > 0]
    if state.graphs is not None and all(g.chooser is None for g in growth):  # no level needs the host's decision
        state.reserve(drafter, (max(depths, default=1) - 1) * top_k, hidden)
        if layout is not None and not state.ragged.holes:  # the trees laid out for the verify on the device
            levels = max(g.depth for g in growth)
            state.steps += max(levels - 1, 0)
            return state.programs(drafter).grow(logits, hidden, top_k, levels, min_logp, prune,
                                                [p - 1 for p in state.positions], [g.depth for g in growth],
                                                state.length, layout)
        _grow_on_device(drafter, state, growth, logits, hidden, top_k, min_logp, prune)
        return [_select(growth[b].cands, root, total, min_logp if prune else -math.inf)
                for b, root, total in zip(rows, roots, total_tokens)]
    state.launch_staged(drafter)  # (the host chooses from the catch-up's logits)
    chosen = _choose(drafter, top_k, growth, {b: logits[b : b + 1] for b in drafting}, logits[:, None],
                     {b: [[]] for b in drafting})
    for b in drafting:
        growth[b].start(chosen[b], top_k)
    parent_out = hidden  # [B, k, H] the outputs parents were fed back from
    state.reserve(drafter, (max(depths, default=1) - 1) * top_k, parent_out)
    base = None  # [B, 1] each row's root position, on the device
    for level in range(1, max(depths, default=0)):
        for g in growth:  # expand only what may grow
            g.prune(level, prune, min_logp)
        if not any(g.frontier for g in growth):
            break
        out, base = _level_step(drafter, state, growth, parent_out, top_k, level, base, real_len)
        growing = [b for b, g in enumerate(growth) if g.frontier]
        chosen = _choose(drafter, top_k, growth, {b: out.logits[b, : len(growth[b].frontier)] for b in growing},
                         out.logits, {b: [growth[b].cands.path(c) for c in growth[b].frontier] for b in growing})
        for b in growing:
            growth[b].grow(chosen[b], top_k)
        parent_out = out.hidden  # [B, k, H]
    return [_select(growth[b].cands, root, total, min_logp if prune else -math.inf)
            for b, root, total in zip(rows, roots, total_tokens)]


def _grow_on_device(drafter, state: DraftState, growth: list[_Growth], logits: torch.Tensor, hidden: torch.Tensor,
                    k: int, min_logp: float, prune: bool) -> None:
    """`draft_trees`' levels with the host's decisions taken on the device (`grow_levels`: for the default
    chooser, the drafter's top k), read once at the end. The levels run to the deepest row's depth (the host stops
    when every frontier is empty). The read-back then grows each row's `Candidates` on the host as `draft_trees`
    would, on the same numbers: the same trees, one read instead of one a level. Over a cache without holes the
    levels are one program (`DraftPrograms.grow`); with holes, one fixed-shape forward a level under the kept
    masks."""
    rows = state.rows
    levels = max((g.depth for g in growth), default=0)
    roots, depths = [p - 1 for p in state.positions], [g.depth for g in growth]
    if not state.ragged.holes:
        flat = state.programs(drafter).grow(logits, hidden, k, levels, min_logp, prune, roots, depths, state.length)
    else:
        state.launch_staged(drafter)
        host = pack(hidden.device, base=roots, depth=depths)
        base, real_len = host["base"][:, None], state.length  # [B, 1]

        def forward(feed, tokens, level, tail, fed):
            return state.level_forward(drafter, feed, tokens, (base + level).expand(rows, k), real_len + fed,
                                       state.level_mask(tail, k, fed))

        flat = flatten_kept(grow_levels(drafter, forward, logits, hidden, k, levels, host["depth"][:, None],
                                        min_logp, prune))
    state.steps += max(levels - 1, 0)
    _grow_from(growth, flat, kept_layout(rows, k, levels), k, min_logp, prune)


def settle_trees(layout, values: list[float], roots: list[int]) -> list[DraftTree]:
    """Each row's tree from its `TreeLayout` (``layout.host``, read as `values`, W nodes a row): its first `size`
    nodes below the root (tokens, parents, scores); roots: the rows' root tokens."""
    rows, per = layout.host.shape
    n = (per - 1) // 3
    trees = []
    for b in range(rows):
        row = values[b * per : (b + 1) * per]
        size = int(row[3 * n])
        trees.append(DraftTree.of_lists([roots[b]] + [int(t) for t in row[:size]],
                                        [-1] + [int(p) for p in row[n : n + size]], [0.0] + row[2 * n : 2 * n + size]))
    return trees


def _grow_from(growth: list[_Growth], flat: torch.Tensor, layout: list[list[int]], k: int, min_logp: float,
               prune: bool) -> None:
    """Each row's candidates from `grow_levels`' result (`flat`, of `layout`), read in one device-to-host copy."""
    values, at = flat.tolist(), 0

    def take(n: int):
        nonlocal at
        part = values[at : at + n]
        at += n
        return part

    read = [[take(n) for n in level] for level in layout]
    tokens0, logp0 = read[0]
    for b, g in enumerate(growth):
        if g.depth > 0:
            g.start(([[int(t) for t in tokens0[b * k : (b + 1) * k]]], [logp0[b * k : (b + 1) * k]], None), k)
    for level, (tokens, logp, grows, order) in enumerate(read[1:], start=1):
        for b, g in enumerate(growth):
            place = {n: j for j, n in enumerate(g.frontier)}  # a frontier node's place on the device: its rank
            g.prune(level, prune, min_logp)
            if not g.frontier:
                continue
            at = [place[n] for n in g.frontier]  # the kept nodes' places
            assert all(grows[b * k + i] for i in at), "the device pruned a node the host keeps"
            first = len(g.cands.tokens)
            g.grow(([[int(t) for t in tokens[(b * k + i) * k : (b * k + i + 1) * k]] for i in at],
                    [logp[(b * k + i) * k : (b * k + i + 1) * k] for i in at], None), k)
            flat = [at[(n - first) // k] * k + (n - first) % k for n in g.frontier]  # each new node on the device
            assert flat == [int(o) for o in order[b * k : b * k + len(flat)]], "the device chose other nodes"


def _level_step(drafter, state: DraftState, growth: list[_Growth], parent_out: torch.Tensor, k: int, level: int,
                base: torch.Tensor | None, real_len: int):
    """One drafter forward over every row's frontier at `level` (padded to `k` nodes a row: every level's step has
    the shape [B, k], so a captured step, a CUDA graph, never sees a new shape; padding slots are nobody's
    ancestors), fed the parents' outputs `parent_out` [B, k', H]. Returns the step's output and `base`, each
    row's root position [B, 1] on the device (copied with the first level's layout)."""
    host = pack(parent_out.device, **_level_layout(growth, k, base is None and state.positions))
    if base is None:
        base = host.pop("base")[:, None]  # [B, 1]
    feed = parent_out.gather(1, host["slot"][..., None].expand(len(growth), k, parent_out.shape[-1]))  # [B, k, H]
    mask = state.level_mask(host.get("ancestors"), k, len(growth[0].fed))
    out = state.level_forward(drafter, feed, host["tokens"], (base + level).expand(len(growth), k),
                              real_len + len(growth[0].fed), mask)
    state.steps += 1
    for g in growth:
        g.fed += g.frontier + [-1] * (k - len(g.frontier))
    return out, base


def _choose(drafter, top_k, growth: list[_Growth], logits_of: dict, all_logits: torch.Tensor, paths_of: dict) -> dict:
    """Each growing row's children of its frontier nodes (from ``logits_of[b]`` [k_b, Vd]; `all_logits` [B, k, Vd]
    are every row's at once; ``paths_of[b]``: each node's draft tokens below the root), read in one device-to-host
    copy: row -> (tokens, log-probabilities, q logits) per expanded node. Rows with the default chooser are chosen
    together."""
    growing = list(logits_of)
    default = [b for b in growing if growth[b].chooser is None]
    custom = [b for b in growing if growth[b].chooser is not None]
    choices = [growth[b].chooser(logits_of[b], paths_of[b]) for b in custom]
    if default:  # every row's at once, read as one block (no per-row slices on the device)
        batch = top_k_choice(drafter, all_logits, top_k)  # [B, k, top_k]
        width = batch.tokens.shape[1]
        choices.append(Choice(batch.tokens.flatten(0, 1), batch.logp.flatten(0, 1)))  # [B * k, top_k]
    read = read_choices(choices) if choices else []
    out = {b: (tokens, logp, c.q_logits) for b, c, (tokens, logp) in zip(custom, choices, read)}
    if default:
        tokens, logp = read[-1]
        for b in default:
            rows = slice(b * width, b * width + len(paths_of[b]))
            out[b] = (tokens[rows], logp[rows], None)
    return out


def _level_layout(growth: list[_Growth], k: int, positions) -> dict:
    """A level's host arrays, copied at once: the frontier's tokens and parent slots [B, k], each node's ancestors
    among the fed tree rows and itself [B, k, fed + k] (None for one row's chain: the plain causal layout), and at
    the first level each row's root position [B] (`positions`: the rows' next real positions)."""
    rows, fed_width = len(growth), len(growth[0].fed)
    out = {"tokens": [[g.cands.tokens[c] for c in g.frontier] + [0] * (k - len(g.frontier)) for g in growth],
           "slot": [g.parent_slot + [0] * (k - len(g.parent_slot)) for g in growth]}
    if positions:
        out["base"] = [p - 1 for p in positions]
    first = growth[0]
    chain = rows == 1 and k == 1 and _ancestors(first.frontier[0], first.cands.parent) == first.fed
    if not chain:  # built in host lists, one tensor at the end (no per-element tensor writes)
        anc = [[[False] * (fed_width + k) for _ in range(k)] for _ in range(rows)]
        for b, g in enumerate(growth):
            slot = {c: i for i, c in enumerate(g.fed) if c >= 0}
            for i, c in enumerate(g.frontier):
                for a in _ancestors(c, g.cands.parent):
                    anc[b][i][slot[a]] = True
            for i in range(k):
                anc[b][i][fed_width + i] = True  # itself (a padding node: only itself)
        out["ancestors"] = torch.tensor(anc, dtype=torch.bool)  # [B, k, fed + k]
    return out


@torch.no_grad()
def draft_tree(drafter: EagleDrafter, state: DraftState, root_token: int, logits: torch.Tensor, hidden: torch.Tensor,
               depth: int, top_k: int, total_tokens: int, threshold: float = 0.0, choose: Chooser | None = None,
               prune: bool = True) -> DraftTree:
    """`draft_trees` for a single row (logits: [1, Vd], hidden: [1, 1, H])."""
    return draft_trees(drafter, state, [root_token], logits, hidden, [depth], top_k, [total_tokens], threshold,
                       [choose], prune)[0]


def _ancestors(c: int, cand_parent: list[int]) -> list[int]:
    """Candidate indices of `c`'s draft ancestors, root-most first."""
    out, p = [], cand_parent[c]
    while p > 0:
        out.append(p - 1)
        p = cand_parent[p - 1]
    return out[::-1]


def greedy_chain(cand_parent: list[int]) -> list[bool]:
    """Which candidates lie on the drafter's greedy chain: each the first child drafted below the root or below
    another on the chain (children are drafted best first). Laid out first, the chain's accepted drafts are the
    tree's first nodes, whose keys and values the target's cache keeps where the verify wrote them."""
    on, first_below = [], set()
    for p in cand_parent:
        on.append(p not in first_below and (p == 0 or on[p - 1]))
        first_below.add(p)
    return on


def _select(cands: Candidates, root_token: int, total_tokens: int, min_logp: float) -> DraftTree:
    """The best ``total_tokens - 1`` candidates, closed under ancestors, the drafter's greedy chain first
    (`greedy_chain`), then in drafting order: parents before children, siblings in the order drafted."""
    cand_tokens, cand_parent, cand_score, cand_q = cands.tokens, cands.parent, cands.score, cands.q
    n_keep = min(total_tokens - 1, len(cand_tokens))
    # a path's score only falls with depth, so dropping low scores keeps the selection closed under ancestors
    order = sorted((c for c in range(len(cand_tokens)) if cand_score[c] >= min_logp), key=lambda c: (-cand_score[c], c))
    keep: set[int] = set()
    for c in order:
        if len(keep) >= n_keep:
            break
        chain = [c] + [a for a in _ancestors(c, cand_parent) if a not in keep]
        if len(keep) + len(chain) <= n_keep:
            keep.update(chain)
    greedy = greedy_chain(cand_parent)
    kept = sorted(keep, key=lambda c: (not greedy[c], c))
    new_id = {c: i + 1 for i, c in enumerate(kept)}
    tokens = [root_token] + [cand_tokens[c] for c in kept]
    parents = [-1] + [0 if cand_parent[c] == 0 else new_id[cand_parent[c] - 1] for c in kept]
    scores = [0.0] + [cand_score[c] for c in kept]
    q_logits = None
    if kept and cand_q[kept[0]] is not None:
        rows = [cand_q[c] for c in kept]
        q_logits = torch.cat([torch.zeros_like(rows[0])[None], torch.stack(rows)])  # [N+1, V]
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores), q_logits)
