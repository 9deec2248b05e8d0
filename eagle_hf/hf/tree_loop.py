"""Tree mode: our own decoding loop, reached through the same `generate()` call as a ``custom_generate``.

transformers' assisted loop verifies one chain of one sequence; a tree needs one target forward with a 4D
ancestor mask and tree position ids, acceptance of the best root path, and a KV cache compacted to that path.
The loop is prefill / draft / verify / commit for a batch of rows: each row drafts its own tree (its own
`Speculator`), one target forward verifies every row's tree, and each row keeps its own accepted path.

Ragged rows: row b's cache slots are valid or holes (`valid` [B, L]); a round appends the longest accepted path's
length to every row, a shorter path leaves holes its row's mask hides, and positions are counted per row. Holes
are compacted away once they are a quarter of the cache (amortised O(1) per token); a finished row leaves the
batch, unless the batch with it is measured to be cheaper than without it: then it rides along as a *passenger*
(its root token verified every round, its output ignored) until more rows finish. Batch size 1 never has holes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..capture import gather_aux, hidden_state_request
from ..ragged import packed_index, worth_compacting
from ..speculation import Speculator, draft_round
from ..tree import DraftTree
from ..verification import process_logits, verify, verify_greedy
from .cache import check_tree_cache, commit_paths, regather_cache, select_cache, tree_attention_mask
from .costs import row_costs
from .models import head_on_positions
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
    """One sequence of the batch."""

    seq: torch.Tensor  # [1, T] the row as plain generate() holds it (left padding included)
    sp: Speculator
    position: int = 0  # position of the next token to enter the cache: the row's count of real tokens
    token: int = -1  # the last emitted token (the next tree's root)
    done: bool = False
    emitted: Emitted = field(default_factory=Emitted)


class TreeLoop:
    """Decode a batch with draft trees. `run()` returns (sequences [B, T'], the rows)."""

    def __init__(self, target, speculators: list[Speculator], aux_ids, cache, logits_processor, stopping_criteria,
                 generation_config, streamer=None):
        self.target, self.speculators, self.aux_ids, self.cache = target, speculators, list(aux_ids), cache
        self.device = target.device  # (looked up once: the property walks the parameters)
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
        self.total_tokens = int(settings.total_tokens)
        self.controller = speculators[0].controller  # shared by the rows: it plans for the whole batch
        self.valid: torch.Tensor | None = None  # [B, L] which cache slots each active row reads
        check_tree_cache(cache)

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        device = self.device
        ids = input_ids.to(device)  # plain generate() accepts CPU inputs for an accelerator target
        mask = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.to(device).bool()
        rows = [Row(ids[b : b + 1], sp) for b, sp in enumerate(self.speculators)]
        self.prefill(rows, ids, mask)
        active = self.retire(rows) if any(r.done for r in rows) else rows
        clock = self.speculators[0].clock
        while live := sum(not r.done for r in active):
            start = clock()
            if self.controller is not None:
                self.controller.rows = len(active)
            planned = self.controller.choose() if self.controller is not None and len(rows) > 1 else None
            trees = self.plan(active, planned)
            steps, backlog = max(r.sp.eagle_depth for r in active), any(r.sp.backlog for r in active)
            before = sum(r.seq.shape[1] for r in active)  # the rows' tokens before the round
            self.verify_and_commit(active, trees)
            if self.controller is not None:
                self.observe(clock() - start, max(t.size for t in trees), steps, backlog, len(rows) > 1,
                             (sum(r.seq.shape[1] for r in active) - before) / live)
            if sum(not r.done for r in active) < live:
                active = self.retire(active)
            else:
                self.compact_holes()
        if self.streamer is not None:
            self.streamer.end()
        return self.sequences(rows), rows

    # ------------------------------------------------------------------ steps
    def prefill(self, rows: list[Row], ids: torch.Tensor, mask: torch.Tensor) -> None:
        """The target reads the uncached prompts; each row's drafter gets its real rows (read at its first draft)."""
        cached = self.cache.get_seq_length()  # a past_key_values passed in already holds this prefix
        for b, row in enumerate(rows):
            row.sp.extend_context(ids[b][mask[b]].tolist())
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, T] as generate() numbers a left-padded batch
        padded = not bool(mask.all())
        out = self.forward(ids[:, cached:], attention_mask=mask.long() if padded else None,
                           position_ids=positions[:, cached:])
        raw = out.logits[:, -1].float()  # [B, V]
        aux = gather_aux(out.hidden_states, self.aux_ids) if self.uses_eagle else None  # [B, T - cached, A*H_t]
        self.valid = mask.clone()
        for b, row in enumerate(rows):
            scores = process_logits(self.logits_processor, row.seq, [[]], raw[b : b + 1])
            token = int(torch.multinomial(torch.softmax(scores, -1), 1)) if self.do_sample else int(scores.argmax(-1))
            real = mask[b, cached:]  # [T - cached] the row's uncached real tokens
            if aux is not None:
                after = torch.cat([ids[b, cached + 1 :], torch.tensor([token], device=ids.device)])[real]
                row.sp.commit(aux[b : b + 1][:, real], after[None], position=int(mask[b, :cached].sum()))
            row.position = int(mask[b].sum())
            self.keep_outputs(row, scores, raw[b : b + 1], out.hidden_states, b, None)
            self.append(row, self.cut(row, [token]))

    def plan(self, active: list[Row], planned: int | None = None) -> list[DraftTree]:
        """Each row's tree this round: its drafter's and copy source's, or the root alone for a plain step (or a
        fully pruned tree). The rows draft together: one drafter forward per level. `planned`: the drafter depth
        the shared controller chose for the batch's round."""
        depths, sizes = [], []
        for row in active:
            if row.done:  # a passenger: its root alone
                depths.append(0)
                sizes.append(1)
                continue
            row.sp.begin_round()
            room = self.max_length - row.seq.shape[1] - 1
            depths.append(row.sp.choose_depth(room, planned))
            sizes.append(min(self.total_tokens, room + 1))
        return draft_round([r.sp for r in active], [r.token for r in active], depths, sizes)

    def verify_and_commit(self, active: list[Row], trees: list[DraftTree]) -> None:
        """One target forward over every row's tree; each row accepts a path, keeps its KV, commits its rows."""
        device = self.device
        past_len = self.cache.get_seq_length()
        width = max(t.size for t in trees)  # N: the trees are padded to the largest
        tokens = torch.stack([_pad(t.tokens, width, int(t.tokens[0])) for t in trees]).to(device)  # [B, N]
        positions = torch.stack([_pad(r.position + t.depths(), width, r.position) for r, t in zip(active, trees)])
        mask = None
        if width > 1:
            mask = tree_attention_mask(trees, self.valid, self.target.dtype)  # [B, 1, N, L + N]
        elif not bool(self.valid.all()):  # plain steps with holes: a 2D mask, as plain generate() passes padding
            mask = torch.cat([self.valid, self.valid.new_ones(len(trees), 1)], 1).long()  # [B, L + 1]
        real = None if width == 1 else torch.arange(width) < torch.tensor([t.size for t in trees])[:, None]  # [B, N]
        clock = self.speculators[0].clock
        start = clock()
        with head_on_positions(self.target, None if real is None else real.to(device)):  # padding needs no logits
            out = self.forward(tokens, attention_mask=mask, position_ids=positions.to(device), all_rows=width > 1)
        if self.controller is not None:
            self.controller.observe_verify(width, clock() - start)
        # [B, N] the target's token after each node, for every row at once (its logits are never read then;
        # float32 first: a bf16 argmax is several times slower on CPU)
        choices = out.logits.float().argmax(-1).tolist() if self.greedy_batch else None
        rounds = []
        for b, (row, tree) in enumerate(zip(active, trees)):
            if row.done:  # a passenger: nothing to verify, its slot is never read again
                rounds.append(([], [0], None, None, False))
                continue
            if choices is not None:
                raw = node_logits = None
                path, bonus = verify_greedy(tree, choices[b][: tree.size])
            else:
                raw = out.logits[b, : tree.size].float()  # [n, V] (n = 1 for plain steps)
                paths = [tree.path_tokens(n) for n in range(tree.size)] if len(self.logits_processor) else []
                node_logits = process_logits(self.logits_processor, row.seq, paths, raw)  # [n, V]
                path, bonus = verify(tree, node_logits, self.do_sample)
            proposed = [int(tree.tokens[n]) for n in path[1:]] + [bonus]
            new = self.cut(row, proposed)  # cut at EOS, max_length and stopping criteria, as plain decoding stops
            rounds.append((new, path[: len(new)], raw, node_logits, len(new) < len(proposed)))
        self.valid = torch.cat([self.valid, commit_paths(self.cache, past_len, [r[1] for r in rounds])], 1)
        aux = gather_aux(out.hidden_states, self.aux_ids) if self.uses_eagle else None  # [B, N, A*H_t]
        for b, (row, (new, keep, raw, node_logits, cut)) in enumerate(zip(active, rounds)):
            if row.done and not new:  # a passenger
                continue
            if aux is not None:  # the kept nodes' features, each with the token that follows it
                row.sp.commit(aux[b : b + 1, keep], torch.tensor([new], device=device), position=row.position)
            self.keep_outputs(row, node_logits, raw, out.hidden_states, b, keep)
            row.position += len(new)
            self.append(row, new)
            row.sp.record(len(new) - 1, row.token, path=keep, cut=cut)

    def observe(self, seconds: float, width: int, steps: int, backlog: bool, batch: bool, tokens: float) -> None:
        """Whole rounds teach the controller the loop's own costs (a drafter catching up on plain rounds' rows is
        neither a regular drafting round nor a plain one) and count against a batch's loss budget (every round:
        catching up is part of what drafting costs). `tokens`: what each live row emitted on average."""
        wide = width > 1 or steps > 0  # (a drafter whose every draft was pruned ran all the same)
        if width > 1 and not backlog:
            self.controller.observe_cycle_round(seconds, width, steps, tokens)
        elif batch and not wide:  # (one row's plain rounds are timed by its speculator)
            self.controller.observe_plain_round(seconds)
        if batch:
            self.controller.account(seconds, tokens, wide)

    def retire(self, rows: list[Row]) -> list[Row]:
        """Finished rows leave the batch (and the cache), but as few as are needed for the cheapest forward that
        keeps every unfinished row (`row_costs`): the others stay as passengers. Slots no remaining row reads are
        dropped."""
        live = [i for i, r in enumerate(rows) if not r.done]
        if not live:
            return []
        size = self.cheapest_size(len(live), len(rows))
        passengers = [i for i, r in enumerate(rows) if r.done][: size - len(live)]
        for i in passengers:
            rows[i].sp.round = "passenger"  # (never a drafting round again)
        if size == len(rows):
            return rows
        stay = sorted(live + passengers)
        index = torch.tensor(stay, device=self.valid.device)
        self.valid = self.valid.index_select(0, index)
        read = self.valid.any(0)  # [L]
        slots = None if bool(read.all()) else read.nonzero()[:, 0]
        select_cache(self.cache, rows=index, slots=slots)
        if slots is not None:
            self.valid = self.valid[:, read]
        rows[0].sp.state.select(stay)  # the drafter's cache, shared by the rows
        for slot, b in enumerate(stay):
            rows[b].sp.slot = slot
        return [rows[i] for i in stay]

    def cheapest_size(self, live: int, current: int) -> int:
        """The batch size between `live` and `current` rows whose one-token forward was measured cheapest (a
        larger one only where it saves at least 5%: measurements of single forwards are noisy)."""
        if live == current:
            return live
        costs = row_costs(self.target, range(live, current + 1))
        best = live
        for size in range(live + 1, current + 1):
            if costs[size] < 0.95 * costs[best]:
                best = size
        return best

    def compact_holes(self) -> None:
        """Move each row's valid slots to the end of a shorter cache once every row has many holes."""
        if not worth_compacting(self.valid):
            return
        index, self.valid = packed_index(self.valid)
        regather_cache(self.cache, index)

    # ------------------------------------------------------------------ helpers
    def forward(self, ids: torch.Tensor, all_rows: bool = False, **kwargs):
        hidden = {} if self.request is None else {"output_hidden_states": self.request}
        return self.target(input_ids=ids, **cache_kwarg(self.cache), use_cache=True,
                           logits_to_keep=0 if all_rows else 1, **hidden, **kwargs)

    def cut(self, row: Row, new: list[int]) -> list[int]:
        """The tokens of `new` plain decoding emits before it stops (EOS, max_length, the stopping criteria on
        every prefix); marks the row done when it stops."""
        for i, tok in enumerate(new):
            if tok in self.eos or row.seq.shape[1] + i + 1 >= self.max_length or self.stops(row.seq, new[: i + 1]):
                row.done = True
                return new[: i + 1]
        return new

    def stops(self, seq: torch.Tensor, new: list[int]) -> bool:
        if not self.criteria:
            return False
        ids = torch.cat([seq, torch.tensor([new], device=seq.device, dtype=seq.dtype)], 1)
        return any(bool(torch.as_tensor(c(ids, None)).all()) for c in self.criteria)

    def keep_outputs(self, row: Row, scores, raw, hidden_states, b: int, nodes: list[int] | None) -> None:
        """What generate() returns per step, only where asked for (every step's [1, V] float logits add up).
        scores, raw: [n, V] per tree node (nodes: the emitted ones) or [1, V] for the prefill (nodes None)."""
        if not (self.keep_scores or self.keep_logits or self.keep_hidden):
            return
        for n in nodes if nodes is not None else range(scores.shape[0]):
            if self.keep_scores:
                row.emitted.scores.append(scores[n : n + 1])
            if self.keep_logits:
                row.emitted.logits.append(raw[n : n + 1])
            if self.keep_hidden:
                row.emitted.hidden_states.append(
                    tuple(h[b : b + 1] if nodes is None else h[b : b + 1, n : n + 1] for h in hidden_states))

    def append(self, row: Row, new: list[int]) -> None:
        row.sp.extend_context(new)
        if self.streamer is not None:
            self.streamer.put(torch.tensor(new))
        row.seq = torch.cat([row.seq, torch.tensor([new], device=row.seq.device, dtype=row.seq.dtype)], 1)
        row.token = new[-1]

    def sequences(self, rows: list[Row]) -> torch.Tensor:
        """[B, T'] the rows, finished ones padded with the pad token after their end (as plain generate())."""
        width = max(r.seq.shape[1] for r in rows)
        return torch.cat([_pad(r.seq[0], width, self.pad)[None] for r in rows])


def _pad(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
    return torch.cat([t, t.new_full((width - t.shape[0],), value)]) if t.shape[0] < width else t


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
    from .hooks import finish_rows, speculators_for

    cache = cache_in(model_kwargs)
    call, speculators = speculators_for(model, input_ids.shape[0], eos_ids(generation_config))
    loop = TreeLoop(model, speculators, call.aux_ids, cache, logits_processor, stopping_criteria, generation_config,
                    call.streamer)
    seq, rows = loop.run(input_ids, model_kwargs.get("attention_mask"))
    finish_rows(call, speculators, [r.seq.shape[1] - input_ids.shape[1] for r in rows])
    emitted = [r.emitted for r in rows]
    if not generation_config.return_dict_in_generate:
        return seq
    g = generation_config
    batched = len(emitted) > 1
    return GenerateDecoderOnlyOutput(
        sequences=seq,
        scores=stack_steps([e.scores for e in emitted]) if g.output_scores else None,
        logits=stack_steps([e.logits for e in emitted]) if g.output_logits else None,
        hidden_states=tuple(emitted[0].hidden_states) if g.output_hidden_states else None,
        **cache_kwarg(None if batched else cache),  # a batch's cache has holes: it cannot continue a generate()
    )
