"""Tree mode: our own decoding loop, reached through the same `generate()` call as a ``custom_generate``.

transformers' assisted loop verifies one chain; a tree needs one target forward with a 4D ancestor mask and
tree position ids, acceptance of the best root path, and a KV cache compacted to that path. The loop is
prefill / draft / verify / commit; the drafter's side of each round is the `Speculator`'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..capture import gather_aux, hidden_state_request
from ..speculation import Speculator
from ..verification import process_logits, verify
from .cache import check_tree_cache, compact_cache, tree_attention_mask
from .stopping import eos_ids

logger = logging.getLogger(__name__)


@dataclass
class Emitted:
    """What the loop hands back per emitted token (as plain generate() does per step)."""

    scores: list[torch.Tensor] = field(default_factory=list)  # processed logits [1, V]
    logits: list[torch.Tensor] = field(default_factory=list)  # raw logits [1, V]
    hidden_states: list[tuple[torch.Tensor, ...]] = field(default_factory=list)  # per step: per layer [1, t, H]


class TreeLoop:
    """Decode one sequence with draft trees. `run()` returns (sequences [1, T], Emitted)."""

    def __init__(self, target, speculator: Speculator, aux_ids, cache, logits_processor, stopping_criteria,
                 generation_config, streamer=None):
        self.target, self.sp, self.aux_ids, self.cache = target, speculator, list(aux_ids), cache
        self.logits_processor, self.stopping_criteria, self.streamer = logits_processor, stopping_criteria, streamer
        self.do_sample = bool(generation_config.do_sample)
        self.max_length = generation_config.max_length
        self.eos = eos_ids(generation_config)
        self.keep_hidden = bool(generation_config.output_hidden_states)
        self.keep_logits = bool(generation_config.output_logits)
        self.uses_eagle = speculator.settings.uses_eagle  # copy drafting alone needs no target features
        self.request = True if self.keep_hidden else (hidden_state_request(self.aux_ids) if self.uses_eagle else None)
        self.total_tokens = int(speculator.settings.total_tokens)
        self.emitted = Emitted()
        check_tree_cache(cache)

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor):
        device = self.target.device
        seq = input_ids.to(device)  # plain generate() accepts CPU inputs for an accelerator target
        cached = self.cache.get_seq_length()  # a past_key_values passed in already holds this prefix
        self.sp.extend_context(seq[0].tolist())
        token = self.prefill(seq, cached)
        seq = self.append(seq, [token])
        while not self.done(seq, token):
            self.sp.begin_round()
            room = self.max_length - seq.shape[1] - 1
            depth = self.sp.choose_depth(room)
            if self.sp.round != "draft":
                token = self.plain_step(seq)
                new, path, cut = [token], [0], False
            else:
                tree = self.sp.draft(token, depth, min(self.total_tokens, room + 1))
                if tree.num_drafts == 0:  # fully pruned: the target decodes the root alone
                    token = self.plain_step(seq)
                    new, path, cut = [token], [0], False
                else:
                    new, path, cut = self.verify_and_commit(seq, tree)
            seq = self.append(seq, new)
            token = new[-1]
            self.sp.record(len(new) - 1, token, path=path, cut=cut)
        if self.streamer is not None:
            self.streamer.end()
        return seq, self.emitted

    # ------------------------------------------------------------------ steps
    def prefill(self, seq: torch.Tensor, cached: int) -> int:
        """The target reads the uncached prompt; the drafter gets its rows (read at the first draft)."""
        out = self.forward(seq[:, cached:])
        return self.emit_plain(seq, out, position=cached)

    def plain_step(self, seq: torch.Tensor) -> int:
        out = self.forward(seq[:, -1:])
        return self.emit_plain(seq, out, position=seq.shape[1] - 1)

    def verify_and_commit(self, seq: torch.Tensor, tree):
        """One target forward over the tree; accept a path; keep its KV; commit its rows to the drafter."""
        device = self.target.device
        past_len = self.cache.get_seq_length()
        positions = (past_len + tree.depths()).to(device)[None]  # [1, N+1]
        mask = tree_attention_mask(tree, past_len, self.target.dtype, device)  # [1, 1, N+1, past_len + N+1]
        out = self.forward(tree.tokens[None].to(device), attention_mask=mask, position_ids=positions, all_rows=True)
        raw = out.logits[0].float()  # [N+1, V]
        paths = [tree.path_tokens(n) for n in range(tree.size)] if len(self.logits_processor) else []
        node_logits = process_logits(self.logits_processor, seq, paths, raw)  # [N+1, V]
        path, bonus = verify(tree, node_logits, self.do_sample)
        new = [int(tree.tokens[n]) for n in path[1:]] + [bonus]
        full = len(new)
        new = new[: self.max_length - seq.shape[1]]  # crop at max_length and EOS, as the assisted loop does
        for i, tok in enumerate(new):
            if tok in self.eos:
                new = new[: i + 1]
                break
        keep = path[: len(new)]  # the nodes whose tokens were emitted ... their successors' features
        compact_cache(self.cache, past_len, torch.tensor(keep, device=device))
        if self.uses_eagle:
            aux = gather_aux(out.hidden_states, self.aux_ids)[:, keep]  # [1, a+1, A*H_t]
            self.sp.commit(aux, torch.tensor([new], device=device), position=past_len)
        self.keep_outputs(node_logits[keep], raw[keep], out.hidden_states, keep)
        return new, keep, len(new) < full

    # ------------------------------------------------------------------ helpers
    def forward(self, ids: torch.Tensor, all_rows: bool = False, **kwargs):
        hidden = {} if self.request is None else {"output_hidden_states": self.request}
        return self.target(input_ids=ids, past_key_values=self.cache, use_cache=True,
                           logits_to_keep=0 if all_rows else 1, **hidden, **kwargs)

    def emit_plain(self, seq: torch.Tensor, out, position: int) -> int:
        """The target's own next token after a plain forward; its rows go to the drafter."""
        raw = out.logits[:, -1].float()  # [1, V]
        scores = process_logits(self.logits_processor, seq, [[]], raw)
        token = int(torch.multinomial(torch.softmax(scores, -1), 1)) if self.do_sample else int(scores.argmax(-1))
        if self.uses_eagle:
            aux = gather_aux(out.hidden_states, self.aux_ids)  # [1, n, A*H_t]
            n = aux.shape[1]
            tokens = torch.cat([seq[:, position + 1 :], torch.tensor([[token]], device=seq.device, dtype=seq.dtype)], 1)
            self.sp.commit(aux, tokens[:, -n:], position=position)
        self.keep_outputs(scores, raw, out.hidden_states, None)
        return token

    def keep_outputs(self, scores, raw, hidden_states, rows) -> None:
        for i in range(scores.shape[0]):
            self.emitted.scores.append(scores[i : i + 1])
            if self.keep_logits:
                self.emitted.logits.append(raw[i : i + 1])
            if self.keep_hidden:
                self.emitted.hidden_states.append(
                    tuple(h if rows is None else h[:, rows[i] : rows[i] + 1] for h in hidden_states))

    def append(self, seq: torch.Tensor, new: list[int]) -> torch.Tensor:
        self.sp.extend_context(new)
        if self.streamer is not None:
            self.streamer.put(torch.tensor(new))
        return torch.cat([seq, torch.tensor([new], device=seq.device, dtype=seq.dtype)], 1)

    def done(self, seq: torch.Tensor, token: int) -> bool:
        return token in self.eos or seq.shape[1] >= self.max_length or bool(self.stopping_criteria(seq, None).all())


def tree_custom_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
    """`custom_generate` callable: generate() has prepared processors, criteria and the cache."""
    from .hooks import speculator_for

    cache = model_kwargs.get("past_key_values")
    call, speculator = speculator_for(model)
    loop = TreeLoop(model, speculator, call.aux_ids, cache, logits_processor, stopping_criteria, generation_config,
                    call.streamer)
    seq, emitted = loop.run(input_ids)
    if not generation_config.return_dict_in_generate:
        return seq
    g = generation_config
    return GenerateDecoderOnlyOutput(
        sequences=seq,
        scores=tuple(emitted.scores) if g.output_scores else None,
        logits=tuple(emitted.logits) if g.output_logits else None,
        hidden_states=tuple(emitted.hidden_states) if g.output_hidden_states else None,
        past_key_values=cache,
    )
