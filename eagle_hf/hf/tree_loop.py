"""Tree mode: our own decoding loop, reached through the same `generate()` call as a ``custom_generate``.

transformers' assisted loop verifies one chain of one sequence; a tree needs one target forward with a 4D
ancestor mask and tree position ids, acceptance of the best root path, and a KV cache compacted to that path.
The loop is prefill / draft / verify / commit for a batch of rows: each row drafts its own tree (its own
`Speculator`), one target forward verifies every row's tree, and each row keeps its own accepted path.

Ragged rows: row b's cache slots are valid or holes (`valid` [B, L]); a round appends the longest accepted path's
length to every row, a shorter path leaves holes its row's mask hides, and positions are counted per row. Holes
are compacted away once they are a quarter of the cache (amortised O(1) per token); a finished row leaves the
batch, unless the batch with it is measured to be cheaper than without it: then it stays as a *padding row*
(its root token verified every round, its output ignored) until more rows finish. Batch size 1 never has holes.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .. import programs
from ..devices import input_device
from ..drafter.capture import gather_aux, hidden_state_request
from ..programs import how_to_run, pack, to_device
from ..speculation.drafting import PendingTrees
from ..speculation.ragged import Ragged
from ..speculation.rounds import RoundTiming, report_round
from ..speculation.speculator import RoundPlan, Speculator, draft_round, plan_round, round_facts
from ..speculation.tree import DraftTree, accept_paths, draw, greedy, process_logits, sampling_draws
from .attention import TREE_PREFIX, routed_kernel, split_keys_from
from .cache import VERIFY_BUCKETS, key_positions, layer_windows, tree_cache, window_masks
from .call import active_call, finish_rows, speculators_for
from .costs import cost_model
from .indexed import has_indexed_layers
from .models import (
    compiled_graphs,
    head_on_positions,
    query_scale_step,
    slots_before_step,
    specialise_width,
    warming_up,
)
from .recurrent import Snapshot, is_hybrid, steps_tokens, stepwise
from .stopping import eos_ids
from .version import cache_in, cache_kwarg

logger = logging.getLogger(__name__)

@dataclass
class Emitted:
    """What the loop hands back per emitted token of one row (as plain generate() does per step)."""

    scores: list[torch.Tensor] = field(default_factory=list)  # processed logits [1, V]
    logits: list[torch.Tensor] = field(default_factory=list)  # raw logits [1, V]
    hidden_states: list[tuple[torch.Tensor, ...]] = field(default_factory=list)  # per step: per layer [1, t, H]


@dataclass
class Row:
    """One sequence of the batch: its tokens live in the loop's device buffer ``ids`` [B, max_length] (row
    `index`, the first `length` of them), written in place as the row grows."""

    ids: torch.Tensor  # [B, max_length] the batch's tokens, left padding included (shared by the rows)
    index: int  # this row's row of `ids` (its row of the call's batch)
    length: int  # its tokens so far
    sp: Speculator
    position: int = 0  # position of the next token to enter the cache: the row's count of real tokens
    token: int = -1  # the last emitted token (the next tree's root)
    done: bool = False
    emitted: Emitted = field(default_factory=Emitted)

    @property
    def seq(self) -> torch.Tensor:
        """[1, T] the row as plain generate() holds it (a view)."""
        return self.ids[self.index : self.index + 1, : self.length]


@dataclass
class Outcome:
    """What one row's verification gave: the emitted tokens, the accepted node path they came from (cut as the
    tokens are: its columns in the verify and its nodes in the tree), the logits kept for generate()'s outputs,
    and whether a stop cut the round's tokens."""

    new: list[int]
    keep: list[int]  # the accepted nodes' columns in the verify forward
    raw: torch.Tensor | None = None  # [n, V] the target's logits per node (only where outputs need them)
    scores: torch.Tensor | None = None  # [n, V] the same, processed
    cut: bool = False
    path: list[int] | None = None  # the accepted nodes in the tree (None: `keep`)


class TreeLoop:
    """Decode a batch with draft trees. `run()` returns (sequences [B, T'], the rows)."""

    def __init__(self, target, speculators: list[Speculator], aux_ids, cache, logits_processor, stopping_criteria,
                 generation_config, streamer=None, compiled=None):
        self.target, self.speculators, self.aux_ids = target, speculators, list(aux_ids)
        # transformers' compiled forward (static cache, automatic compile): the verify forwards run it, on widths
        # padded to a few buckets (`verify_width`), so that it compiles once per bucket; the prefill does not
        self.compiled = compiled
        # the tree-cache protocol over the call's cache (dynamic or static: room for the longest row and a verify)
        self.cache = tree_cache(cache, slots=generation_config.max_length - 1 + VERIFY_BUCKETS[-1])
        self.cache.how = how_to_run(input_device(target), compiled is not None)  # its commits' programs
        self.tree_kwargs = routed_kernel(target)  # a drafting round's verify forward: eagle_hf's tree attention
        self.device = input_device(target)  # where the inputs go (looked up once: it walks the modules)
        self.dtype = target.dtype  # its masks' (the same)
        # (None: never; nor where an indexer selects keys among the committed slots: `eagle_hf.hf.indexed`)
        self.split_from = None if has_indexed_layers(target) else split_keys_from(self.tree_kwargs, self.cache,
                                                                                  compiled, self.device)
        self.windows = layer_windows(target)  # per layer type its window (None: every layer reads everything)
        self.scale_step = query_scale_step(target)  # slots between the query scale's steps (None: no steps)
        self.logits_processor, self.streamer = logits_processor, streamer
        # EOS and max_length are checked directly; the other criteria (stop strings, the user's) on every prefix
        self.criteria = [c for c in stopping_criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
        self.do_sample = bool(generation_config.do_sample)
        self.max_length = generation_config.max_length
        self.eos = eos_ids(generation_config)
        pad = generation_config._pad_token_tensor
        self.pad = int(pad) if pad is not None else (min(self.eos) if self.eos else 0)
        self.keep_hidden = bool(generation_config.output_hidden_states)
        self.keep_logits = bool(generation_config.output_logits)
        self.keep_scores = bool(generation_config.output_scores and generation_config.return_dict_in_generate)
        # greedy, unprocessed and nothing kept: verification needs only each node's argmax
        self.greedy_batch = not (self.do_sample or len(logits_processor) or self.keep_scores or self.keep_logits)
        settings = speculators[0].settings
        self.uses_eagle = settings.uses_eagle  # copy drafting alone needs no target features
        self.request = True if self.keep_hidden else (hidden_state_request(self.aux_ids) if self.uses_eagle else None)
        self.controller = speculators[0].controller  # shared by the rows: it plans for the whole batch
        # the target's costs: the timed forwards teach it, a shrinking batch asks it (`cheapest_size`)
        self.cost = (self.controller.costs.cost if self.controller is not None
                     else cost_model(target, compiled=compiled is not None))
        self.compiling = False  # whether this round's verify forward compiled a graph
        self.timer = speculators[0].timer  # shared by the rows
        # a hybrid target's recurrent layers: copied before each verify, rewound where a round keeps fewer tokens
        # than it verified (`eagle_hf.hf.recurrent`); the verify's inputs, kept for that replay
        self.rewinds = is_hybrid(target)
        # (and whose recurrent layers take a verify's tokens one at a time: their several-token form drops the state)
        self.stepwise = self.rewinds and steps_tokens(target)
        self.saved: Snapshot | None = None
        self.fed: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def valid(self) -> torch.Tensor | None:
        """[B, L] which cache slots each active row reads (None: all)."""
        return self.cache.ragged.valid

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """Decode in inference mode: the loop's tensors are its own, and no operation of a round keeps autograd's
        bookkeeping (version counters, view tracking): a round's host time on a CPU is mostly such small
        operations. What leaves the loop for the caller is made a normal tensor again (`as_normal`), as plain
        generate() returns them: the sequences here, the kept outputs in `tree_custom_generate`."""
        device = self.device
        with torch.inference_mode():
            ids = input_ids.to(device)  # plain generate() accepts CPU inputs for an accelerator target
            mask = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.to(device).bool()
            buffer = ids.new_full((ids.shape[0], max(self.max_length, ids.shape[1])), self.pad)  # [B, max_length]
            buffer[:, : ids.shape[1]] = ids
            rows = [Row(buffer, b, ids.shape[1], sp) for b, sp in enumerate(self.speculators)]
            try:
                self.cache.begin(slot_limit=self.max_length + VERIFY_BUCKETS[-1])  # the longest row and a verify
                sequences, rows = self._decode(rows, ids, mask)
            finally:
                self.cache.release()
        return as_normal(sequences), rows

    def _decode(self, rows: list[Row], ids: torch.Tensor, mask: torch.Tensor):
        self.prefill(rows, ids, mask)
        active = self.retire(rows) if any(r.done for r in rows) else rows
        while live := sum(not r.done for r in active):
            marks = {"start": self.timer.mark()}  # the round's named marks (`RoundTiming`)
            captures = programs.CAPTURES
            plan, trees = self.draft(active, len(rows) > 1, marks)
            drafting = [r.sp for r in active if r.sp.eagle_depth > 0]
            facts = round_facts([r.sp for r in active], trees.width, batch=len(rows) > 1, kind=plan.kind)
            before = sum(r.length for r in active)  # the rows' tokens before the round
            self.verify_and_commit(active, trees, marks)
            marks["end"] = self.timer.mark()
            facts["tokens"] = (sum(r.length for r in active) - before) / live
            # (a round that compiled a shape, or captured a drafter graph, teaches no cost)
            if not self.compiling and programs.CAPTURES == captures:
                self.timer.measure_marks(marks, lambda at, f=facts, d=drafting, a=[r.sp for r in active]:
                                         report_round(RoundTiming.from_marks(at, **f), a, d, self.cost))
            if sum(not r.done for r in active) < live:
                active = self.retire(active)
            else:
                self.cache.compact()
        if self.streamer is not None:
            self.streamer.end()
        return self.sequences(rows), rows

    # ------------------------------------------------------------------ steps
    def prefill(self, rows: list[Row], ids: torch.Tensor, mask: torch.Tensor) -> None:
        """The target reads the uncached prompts; each row's drafter gets its real rows (read at its first draft)."""
        cached = self.cache.length  # a past_key_values passed in already holds this prefix
        host_mask = mask.tolist()  # [B, T] (the prompts' layout, read once)
        for b, row in enumerate(rows):
            row.sp.extend_context([t for t, m in zip(ids[b].tolist(), host_mask[b]) if m])
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, T] as generate() numbers a left-padded batch
        padded = not all(all(m) for m in host_mask)
        out = self.forward(ids[:, cached:], attention_mask=mask.long() if padded else None,
                           position_ids=positions[:, cached:], prefill=True)
        raw = out.logits[:, -1].float()  # [B, V]
        aux = gather_aux(out.hidden_states, self.aux_ids) if self.uses_eagle else None  # [B, T - cached, A*H_t]
        counts = [sum(m) for m in host_mask]
        self.cache.ragged = Ragged(counts, ids.shape[1], mask.clone() if padded else None)
        # the processors see the batch as at plain generate()'s first step: [B, T] ids, [B, V] scores
        scores = self.logits_processor(ids, raw) if len(self.logits_processor) else raw  # [B, V]
        tokens = (draw(torch.softmax(scores, -1)) if self.do_sample else greedy(scores)).tolist()  # [B]
        for b, (row, token) in enumerate(zip(rows, tokens)):
            if aux is not None:
                real = [i for i, m in enumerate(host_mask[b][cached:]) if m]  # the row's uncached real tokens
                after = [*ids[b, cached + 1 :].tolist(), token]
                index = torch.tensor(real, dtype=torch.long, device=ids.device)
                row.sp.commit(aux[b : b + 1].index_select(1, index),
                              torch.tensor([[after[i] for i in real]], device=ids.device),
                              position=sum(host_mask[b][:cached]))
            row.position = counts[b]
            self.keep_outputs(row, scores[b : b + 1], raw[b : b + 1], out.hidden_states, b, None)
            self.append(row, self.cut(row, [token]))

    def draft(self, active: list[Row], batch: bool, marks: dict | None = None) -> tuple[RoundPlan, PendingTrees]:
        """The round's plan (`plan_round`: who drafts for each row, how deep and how wide) and each row's tree: its
        drafter's and copy source's, or the root alone for a plain step (or a fully pruned tree), laid out for the
        verify. The rows draft together: one drafter forward per level. `batch`: the call decodes several rows
        (its schedule plans for all of them)."""
        # a static cache's free slots, up to the widest verify it keeps room for (copy branches are not sized by
        # the drafter's budget); None: a dynamic cache grows
        fits = self.cache.room(VERIFY_BUCKETS[-1])
        if self.scale_step is not None:  # (Llama 4: short of the query scale's next step)
            scaled = slots_before_step(self.scale_step, self.cache.length)
            fits = scaled if fits is None else min(fits, scaled)
        rooms = [None if row.done else self.max_length - row.length - 1 for row in active]  # (done: a padding row)
        speculators = [r.sp for r in active]
        plan = plan_round(speculators, rooms, fits, batch=batch)
        trees = draft_round(speculators, [r.token for r in active], plan.depths, plan.sizes, marks=marks,
                            positions=[r.position for r in active], pad=self.verify_width, beside=self.greedy_batch)
        if isinstance(trees, PendingTrees):
            if self.greedy_batch:  # the verify reads the layout as it is; the host reads it with the verify's result
                return plan, trees
            trees = trees.settle(trees.read())[0]  # (sampling, processing, kept scores: the host's trees)
        # (N: padded to the largest, or a compiled bucket; a compiled forward keeps one shape: every node's logits)
        return plan, PendingTrees.on_host(trees, self.verify_width, [r.position for r in active], self.device,
                                          parents=self.do_sample, real=self.compiled is None)

    def verify_and_commit(self, active: list[Row], trees: PendingTrees, marks: dict) -> None:
        """One target forward over every row's laid-out tree; each row accepts a path (the round's one read-back,
        with the trees where the host reads them with the verify's result), keeps its nodes' KV in place and
        commits its rows to the drafter."""
        past_len, layout, width = self.cache.length, trees.layout, trees.width
        out = self.verify(layout.tokens, trees.positions, layout.ancestors, width, marks, past_len, layout.real)
        settled, outcomes, chosen = self.accept(active, trees, out.logits)  # chosen: [B, W] or None
        self.timer.read_back()
        slots = self.rewind(active, in_lockstep(active, outcomes), past_len, width) if self.rewinds else width
        self.commit(active, settled, outcomes, chosen, out.hidden_states, past_len, width, slots)

    def verify(self, tokens: torch.Tensor, positions: torch.Tensor, tree: torch.Tensor | None, width: int,
               marks: dict, past_len: int, real: torch.Tensor | None = None):
        """The round's target forward over the rows' nodes: tokens and positions [B, N], each tree's ancestor mask
        [B, N, N] (None: plain steps), `real`: the flat positions of real nodes (None: all), from `past_len`."""
        rows = tokens.shape[0]
        mask = self.verify_mask(tree, positions)
        if self.rewinds:
            self.saved = Snapshot(self.cache.cache) if width > 1 else None
            self.fed = tokens, positions
        marks["verify"] = self.timer.mark()
        graphs = compiled_graphs() if self.compiled is not None else 0
        kernel = {}
        if tree is not None:
            kernel = dict(self.tree_kwargs)
            if self.split_from is not None and past_len >= self.split_from and not self.cache.ragged.holes:
                kernel[TREE_PREFIX] = past_len  # every node sees the committed slots: split them (long contexts)
        with head_on_positions(self.target, real, (rows, width)), self.recurrent_steps():  # padding: no logits
            out = self.forward(tokens, attention_mask=mask, position_ids=positions, all_rows=width > 1, **kernel)
        marks["verified"] = self.timer.mark()
        if self.compiled is not None:  # (a forward that compiled a graph, or recorded one: its time is no cost)
            shape = (rows, width, getattr(self.cache, "capacity", None))
            self.compiling = warming_up(self.target, shape) or compiled_graphs() != graphs
        return out

    def rewind(self, active: list[Row], outcomes: list[Outcome], past_len: int, written: int) -> int:
        """A hybrid target's cache after a round that keeps fewer tokens than its verify wrote (`written`): the
        recurrent layers' states put back as they were before the verify and the kept tokens replayed over them;
        the attention layers' slots after the committed ones are rewritten by the replay, as the verify wrote
        them (`eagle_hf.hf.recurrent`). The rows keep as many tokens each (`in_lockstep`). Returns the slots
        the cache now holds after the committed ones."""
        kept = max(len(o.keep) for o in outcomes)
        if self.saved is None or kept == written:
            return written
        self.saved.restore()
        self.cache.drop_written(past_len, written)  # the attention layers end at the committed slots
        tokens, positions = (t[:, :kept] for t in self.fed)  # [B, K] the kept nodes: a chain's first K
        chain = torch.ones(kept, kept, dtype=torch.bool, device=tokens.device).tril()  # [K, K]
        mask = self.verify_mask(chain.expand(len(active), -1, -1), positions)
        with self.recurrent_steps():
            self.target(input_ids=tokens, attention_mask=mask, position_ids=positions, **self.cache.forward_kwargs(),
                        use_cache=True, logits_to_keep=1, **self.tree_kwargs)
        return kept

    def recurrent_steps(self):
        """Where a hybrid target's recurrent layers take a forward's tokens one at a time (`stepwise`)."""
        return stepwise(self.target) if self.stepwise else contextlib.nullcontext()

    def verify_width(self, largest: int) -> int:
        """The verify forward's width for trees of at most `largest` nodes: that, or with a compiled forward the
        next of a few buckets (1, 4, 8, 16, 32, 64, then multiples of 64) where the cache has the room."""
        if self.compiled is None or largest == 1:
            return largest
        bucket = next((b for b in VERIFY_BUCKETS if b >= largest), -(-largest // 64) * 64)
        free = self.cache.free
        return bucket if free is None or bucket <= free else largest

    def verify_mask(self, tree: torch.Tensor | None, positions: torch.Tensor):
        """The verify forward's attention mask: a 4D float mask over the cache and the trees (drafting rounds),
        the 2D padding mask (plain steps with holes), or None (plain steps without). A target with sliding-window
        layers gets its 4D masks by layer type (`eagle_hf.hf.cache.Window`), plain steps with holes too (their
        windows count tokens, not slots). positions: [B, N] the nodes' (device)."""
        if tree is None and self.windows is not None and self.cache.ragged.holes:
            tree = positions.new_ones(positions.shape[0], 1, 1, dtype=torch.bool)  # [B, 1, 1] each its root
        if tree is None:
            return self.cache.padding_mask()
        mask = self.cache.tree_mask(tree.bool(), self.dtype)  # [B, 1, N, C]: L committed, N nodes, rest hidden
        if self.windows is None:
            return mask
        (rows, width), length = positions.shape, self.cache.length
        keys = positions.new_zeros(rows, mask.shape[-1])  # [B, C] each column's position (the hidden rest: 0)
        keys[:, :length] = key_positions(self.valid, rows, length, positions.device)
        keys[:, length : length + width] = positions
        return window_masks(mask, self.windows, keys, positions)

    def accept(self, active: list[Row], pending: PendingTrees, logits: torch.Tensor):
        """Each row's accepted path from the target's logits [B, W, V], read back once for all rows with the trees
        where the host reads them then (greedy rounds: `PendingTrees.settle`): (the rows' trees, their outcomes,
        the target's greedy token after each node [B, W] on the device, or None when sampling or processing)."""
        layout, width, known = pending.layout, pending.width, pending.trees
        front = [] if known is not None else [layout.host.flatten()]  # the drafter's trees, where still unread
        chosen, raws, scores, draws = None, [], [], []
        if self.greedy_batch:  # the target's token after each node, for every row at once
            chosen = greedy(logits)  # [B, W]
            draws = [chosen.flatten()]  # (read with the trees' float64 part: `cat` promotes it)
        else:
            for b, (row, tree) in enumerate(zip(active, known)):
                raw = logits[b, : tree.size].float()  # [n, V] (n = 1 for plain steps)
                paths = [tree.path_tokens(n) for n in range(tree.size)] if len(self.logits_processor) else []
                node_scores = process_logits(self.logits_processor, row.seq, paths, raw, row.index)  # [n, V]
                raws.append(raw), scores.append(node_scores)
                n = tree.size
                draws.append(sampling_draws(torch.softmax(node_scores, -1), layout.parents[b, 1:n],
                                            layout.tokens[b, 1:n]) if self.do_sample
                             else greedy(node_scores).double())
        parts = front + draws
        values = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()  # the round's one read-back
        at = len(values) - sum(d.numel() for d in draws)
        trees, columns = pending.settle(values[:at], grafted=True)
        accepted = accept_paths(trees, values[at:], self.do_sample, width if self.greedy_batch else None, columns)
        outcomes = [self.outcome(row, tree, path, token, raws[b] if raws else None, scores[b] if scores else None,
                                 columns=columns and columns[b])
                    for b, (row, tree, (path, token)) in enumerate(zip(active, trees, accepted))]
        return trees, outcomes, chosen

    def outcome(self, row: Row, tree: DraftTree, path: list[int], token: int, raw=None, scores=None,
                columns: list[int] | None = None) -> Outcome:
        """A row's verified path as emitted tokens, cut at EOS, max_length and the stopping criteria (as plain
        decoding stops). A padding row emits nothing. `columns`: each tree node's column in the verify (None:
        its own index)."""
        if row.done:  # a padding row: nothing to verify, its slot is never read again
            return Outcome([], [0])
        proposed = [tree.host.tokens[n] for n in path[1:]] + [token]
        new = self.cut(row, proposed)
        path = path[: len(new)]
        return Outcome(new, path if columns is None else [columns[n] for n in path], raw, scores,
                       len(new) < len(proposed), path)

    def commit(self, active: list[Row], trees: list[DraftTree], outcomes: list[Outcome], chosen, hidden_states,
               past_len: int, written: int, slots: int | None = None) -> None:
        """Keep each row's accepted nodes in the cache (in place), hand them to the drafter with the tokens that
        follow them, and append the emitted tokens. `written`: the nodes the verify forward wrote per row (N);
        `slots`: those the cache holds after the committed ones now (None: `written`; fewer after a rewind)."""
        keeps = [o.keep for o in outcomes]
        lengths = [len(k) for k in keeps]
        width = max(lengths)  # K: every row's cache grows by the longest path
        arrays = {}
        if any(k != list(range(len(k))) for k in keeps):  # (chains and plain steps keep the first K nodes)
            arrays["index"] = [k + [0] * (width - len(k)) for k in keeps]
        if chosen is None:
            arrays["new"] = [o.new + [0] * (width - len(o.new)) for o in outcomes]
        if any(n != width for n in lengths):
            arrays["valid"] = [[i < n for i in range(width)] for n in lengths]
        host = pack(self.device, **arrays) if arrays else {}
        index = host.get("index")  # [B, K] or None: the first K nodes
        self.cache.commit(past_len, index, lengths, host["valid"].bool() if "valid" in host else None, self.device,
                          written if slots is None else slots)
        if chosen is not None:  # greedy: the emitted token after node n is the target's choice there
            new_tokens = (chosen if width == written else chosen[:, :width]) if index is None \
                else chosen.gather(1, index)  # [B, K]
        else:
            new_tokens = host["new"]
        aux = gather_aux(hidden_states, self.aux_ids) if self.uses_eagle else None  # [B, N, A*H_t]
        if aux is not None and (index is not None or width < written):
            aux = aux[:, :width] if index is None else aux.gather(1, index[..., None].expand(-1, -1, aux.shape[-1]))
        whole = len(active) == 1  # one row keeping every kept node: its tensors need no slicing
        for b, (row, tree, o) in enumerate(zip(active, trees, outcomes)):
            if row.done and not o.new:  # a padding row
                continue
            n = len(o.new)
            mine = new_tokens if whole and n == width else new_tokens[b : b + 1, :n]  # [1, n]
            if aux is not None:  # the kept nodes' features, each with the token that follows it
                row.sp.commit(aux if whole and n == width else aux[b : b + 1, :n], mine, position=row.position)
            self.keep_outputs(row, o.scores, o.raw, hidden_states, b, o.keep)
            row.position += n
            self.append(row, o.new, mine[0])
            row.sp.end_round(n - 1, row.token, path=o.keep if o.path is None else o.path, cut=o.cut, tree=tree)

    def retire(self, rows: list[Row]) -> list[Row]:
        """Finished rows leave the batch (and the cache), but as few as are needed for the cheapest forward that
        keeps every unfinished row (`cheapest_size`): the others stay as padding rows. Slots no remaining row reads are
        dropped."""
        live = [i for i, r in enumerate(rows) if not r.done]
        if not live:
            return []
        size = self.cheapest_size(len(live), len(rows))
        padding = [i for i, r in enumerate(rows) if r.done][: size - len(live)]
        for i in padding:
            rows[i].sp.keep_as_padding()
        if size == len(rows):
            return rows
        stay = sorted(live + padding)
        index = to_device(torch.tensor(stay), self.device)
        self.cache.select_rows(stay, index)
        rows[0].sp.state.select(stay)  # the drafter's cache, shared by the rows
        for slot, b in enumerate(stay):
            rows[b].sp.move_to(slot)
        return [rows[i] for i in stay]

    def cheapest_size(self, live: int, current: int) -> int:
        """The batch size between `live` and `current` rows whose plain round the cost model knows as cheapest (a
        larger one only where it saves at least 5%: single forwards are noisy). Sizes never timed follow the
        model's prior, which grows with the rows: a batch shrinks unless a larger size was timed cheaper."""
        if live == current:
            return live
        best = live
        for size in range(live + 1, current + 1):
            if self.cost.forward(size) < 0.95 * self.cost.forward(best):
                best = size
        return best

    # ------------------------------------------------------------------ helpers
    def forward(self, ids: torch.Tensor, all_rows: bool = False, prefill: bool = False, **kwargs):
        hidden = {} if self.request is None else {"output_hidden_states": self.request}
        model = self.target if prefill or self.compiled is None else self.compiled
        if model is self.compiled:
            specialise_width(ids, kwargs)
        return model(input_ids=ids, **self.cache.forward_kwargs(), use_cache=True,
                     logits_to_keep=0 if all_rows else 1, **hidden, **kwargs)

    def cut(self, row: Row, new: list[int]) -> list[int]:
        """The tokens of `new` plain decoding emits before it stops (EOS, max_length, the stopping criteria on
        every prefix); marks the row done when it stops."""
        for i, tok in enumerate(new):
            ends = tok in self.eos or row.length + i + 1 >= self.max_length
            if ends or (self.criteria and self.stops(row.seq, new[: i + 1])):  # (the row's view only where read)
                row.done = True
                return new[: i + 1]
        return new

    def stops(self, seq: torch.Tensor, new: list[int]) -> bool:
        """Whether a stopping criterion other than EOS and the length stops the row `seq` [1, T] after `new`."""
        ids = torch.cat([seq, torch.tensor([new], device=seq.device, dtype=seq.dtype)], 1)
        return any(bool(torch.as_tensor(c(ids, None)).all()) for c in self.criteria)

    def keep_outputs(self, row: Row, scores, raw, hidden_states, b: int, nodes: list[int] | None) -> None:
        """What generate() returns per step, only where asked for (every step's [1, V] float logits add up).
        scores, raw: [n, V] per tree node (nodes: the emitted ones) or [1, V] for the prefill (nodes None). Kept
        as copies (as plain generate() keeps its logits): a view would hold the whole verify's outputs, and a
        compiled forward's CUDA graphs write its next outputs over them."""
        if not (self.keep_scores or self.keep_logits or self.keep_hidden):
            return
        for n in nodes if nodes is not None else range(scores.shape[0]):
            if self.keep_scores:
                row.emitted.scores.append(scores[n : n + 1].clone())
            if self.keep_logits:
                row.emitted.logits.append(raw[n : n + 1].clone())
            if self.keep_hidden:
                row.emitted.hidden_states.append(
                    tuple((h[b : b + 1] if nodes is None else h[b : b + 1, n : n + 1]).clone() for h in hidden_states))

    def append(self, row: Row, new: list[int], on_device: torch.Tensor | None = None) -> None:
        """The row's new tokens (`on_device`: the same [n], already on the device) into its buffer, in place."""
        row.sp.extend_context(new)
        if self.streamer is not None:
            self.streamer.put(torch.tensor(new))
        if on_device is None:
            on_device = torch.tensor(new, device=row.ids.device, dtype=row.ids.dtype)
        row.ids[row.index, row.length : row.length + len(new)] = on_device
        row.length += len(new)
        row.token = new[-1]

    def sequences(self, rows: list[Row]) -> torch.Tensor:
        """[B, T'] the rows, finished ones padded with the pad token after their end (as plain generate(), and as
        the buffer holds them)."""
        return rows[0].ids[:, : max(r.length for r in rows)]


def in_lockstep(active: list[Row], outcomes: list[Outcome]) -> list[Outcome]:
    """Every row keeps as many tokens as the row that emitted fewest this round (a hybrid target's recurrent
    state advances for the whole batch at once: `eagle_hf.hf.recurrent`). A row cut back drops verified tokens,
    which it drafts again, and its stop if it had one (the stop came last): as exact as a shorter accepted run.
    Padding rows emit nothing and are left as they are. Changes `outcomes` in place; returns them."""
    least = min((len(o.new) for o in outcomes if o.new), default=0)
    for row, o in zip(active, outcomes):
        if len(o.new) > least:
            o.new, o.keep, o.cut = o.new[:least], o.keep[:least], False
            o.path = None if o.path is None else o.path[:least]
            row.done = False
    return outcomes


def as_normal(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as a normal tensor (a copy where it was made in inference mode): one the caller may write in place
    or use in autograd, as plain generate()'s outputs."""
    return tensor.clone() if tensor.is_inference() else tensor


def stack_steps(per_row: list[list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """Per step [B, V]: the rows' entries; a row that had already finished gets -inf (plain decoding computes
    scores for its padding, which mean nothing)."""
    steps = max(len(r) for r in per_row)
    filler = next(r[0] for r in per_row if r)
    out = []
    for i in range(steps):
        out.append(torch.cat([r[i] if i < len(r) else torch.full_like(filler, float("-inf")) for r in per_row]))
    return tuple(out)


def tree_custom_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
    """`custom_generate` callable: generate() has prepared processors, criteria, the cache and the batch."""
    cache = cache_in(model_kwargs)
    call = active_call()
    compiled = (model.get_compiled_call(generation_config.compile_config)
                if model._valid_auto_compile_criteria(model_kwargs, generation_config) else None)
    call, speculators = speculators_for(model, input_ids.shape[0], eos_ids(generation_config), compiled is not None)
    loop = TreeLoop(model, speculators, call.aux_ids, cache, logits_processor, stopping_criteria, generation_config,
                    call.streamer, compiled)
    seq, rows = loop.run(input_ids, model_kwargs.get("attention_mask"))
    finish_rows(call, speculators, [r.length - input_ids.shape[1] for r in rows])
    emitted = [r.emitted for r in rows]
    if not generation_config.return_dict_in_generate:
        return seq
    g = generation_config
    batched = len(emitted) > 1
    return GenerateDecoderOnlyOutput(
        sequences=seq,
        scores=stack_steps([e.scores for e in emitted]) if g.output_scores else None,
        logits=stack_steps([e.logits for e in emitted]) if g.output_logits else None,
        hidden_states=tuple(tuple(as_normal(h) for h in step) for step in emitted[0].hidden_states)
        if g.output_hidden_states else None,
        **cache_kwarg(None if batched else cache),  # a batch's cache has holes: it cannot continue a generate()
    )
