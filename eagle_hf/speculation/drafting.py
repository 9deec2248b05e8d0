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

from ..drafter.modeling import KV, DraftStep, EagleDrafter, KVWriter
from ..programs import pack, to_device
from ..speculation.draft_programs import LevelGraphs
from .draft_programs import Chooser, DraftPrograms, TreeLayout, TreeRequest, grow_levels, host_trees, tree_layout
from .ragged import KeptMask, Ragged, SlotBuffers, new_buffers
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
    #: draft levels at fixed shapes (captured on CUDA; `eagle_hf.speculation.draft_programs`), None: eager
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
        slots ``at ..`` (`reserve` first), `mask` [B|1, 1, k, at+k] (None: the plain causal layout), eagerly at
        the level's shapes."""
        return drafter.step(feed, ids, positions, past=self.writer(at), mask=mask)

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


@torch.no_grad()
def draft_trees(drafter: EagleDrafter, state: DraftState, logits: torch.Tensor, hidden: torch.Tensor,
                depths: list[int], top_k: int, layout: TreeRequest, threshold: float = 0.0, prune: bool = True,
                choose: Chooser | None = None) -> tuple[TreeLayout, torch.Tensor]:
    """Grow every row's draft tree after its last real drafter row and lay it out for the verify, on the device
    (`grow_levels`, then `tree_layout`): nothing is read. logits [B, Vd] and hidden [B, 1, H]: each state row's last
    real row's; depths: each state row's levels (0: it drafts nothing, its tree the root alone).

    Level by level, the `top_k` best frontier nodes (by cumulative log-probability) get `top_k` children each (the
    drafter's top k, or `choose`'s); the best ``sizes[b] - 1`` drafts are kept, closed under ancestors, the
    drafter's greedy chain first. With ``top_k = 1`` this is a chain. `threshold` on the drafter's probability:
    with `prune`, drafts whose *cumulative* probability is below it are dropped (not expanded, not verified);
    without, a draft whose own probability is below it is kept but not expanded (transformers'
    ``assistant_confidence_threshold`` for chains).

    How it runs is a launch: one program over the cache's whole storage (`DraftPrograms.grow`, with the staged
    catch-up first) where the levels run at fixed shapes and every slot is real; otherwise eagerly at the round's
    shapes, each level under the kept mask (which hides a batch's holes). Returns the `TreeLayout` and the verify
    positions [B, W]."""
    min_logp = math.log(threshold) if threshold > 0 else -math.inf
    levels = max(depths, default=0)
    state.reserve(drafter, max(levels - 1, 0) * top_k, hidden)
    state.steps += max(levels - 1, 0)
    roots = [p - 1 for p in state.positions]  # each row's root position
    if state.graphs is not None and not state.ragged.holes and choose is None:
        return state.programs(drafter).grow(logits, hidden, top_k, levels, min_logp, prune, roots, depths,
                                            state.length, layout)
    state.launch_staged(drafter)
    host = pack(hidden.device, base=roots, depth=depths, tokens=layout.roots, position=layout.positions,
                sizes=layout.sizes)
    rows, base, real_len = state.rows, host["base"][:, None], state.length  # [B, 1]

    causal = top_k == 1 and not state.ragged.holes  # (a chain over every slot: the plain causal layout, no mask)

    def forward(feed, tokens, level, tail, fed):
        return state.level_forward(drafter, feed, tokens, (base + level).expand(rows, top_k), real_len + fed,
                                   None if causal else state.level_mask(tail, top_k, fed))

    depth = host["depth"][:, None]  # [B, 1]
    kept = grow_levels(drafter, forward, logits, hidden, top_k, levels, depth, min_logp, prune, choose)
    laid = tree_layout(kept, host["tokens"], top_k, layout.width, min_logp if prune else -math.inf,
                       torch.where(depth > 0, host["sizes"][:, None], 1))
    return laid, host["position"][:, None] + laid.depths


def draft_tree(drafter: EagleDrafter, state: DraftState, root_token: int, logits: torch.Tensor, hidden: torch.Tensor,
               depth: int, top_k: int, total_tokens: int, threshold: float = 0.0, prune: bool = True) -> DraftTree:
    """`draft_trees` for a single row, read on the host (logits: [1, Vd], hidden: [1, 1, H])."""
    laid, _ = draft_trees(drafter, state, logits, hidden, [depth], top_k,
                          TreeRequest(total_tokens, [root_token], [0], [total_tokens]), threshold, prune)
    return DraftTree.of_lists(*host_trees(laid.host.flatten().tolist(), [root_token])[0])
