"""Tree mode: our own draft-tree / verify loop, reached through the same `generate()` call.

transformers' assisted loop verifies one chain; a tree needs one target forward with a 4D ancestor mask and
tree position ids, acceptance of the best root path, and a KV cache compacted to that path. This module is the
loop; the few operations on transformers internals (cache compaction, output classes) live in
`eagle_hf.hf_integration`.
"""

from __future__ import annotations

import logging
import time

import torch

from .capture import gather_aux, hidden_state_request
from .drafting import DraftState
from .stats import SpecDecodeStats
from .tree import DraftTree, accept_greedy, accept_sampling, draft_tree

logger = logging.getLogger(__name__)


def tree_attention_mask(tree: DraftTree, past_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive float mask [1, 1, N+1, past_len + N+1]: the whole prefix, plus each node's ancestors and itself."""
    allowed = torch.cat([torch.ones(tree.size, past_len, dtype=torch.bool), tree.ancestor_mask()], 1)
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def _process(logits_processor, prefix: torch.Tensor, tree: DraftTree, logits: torch.Tensor) -> torch.Tensor:
    """Apply the logits processors to every node's logits with that node's own path as the prefix."""
    if len(logits_processor) == 0:
        return logits
    out = torch.empty_like(logits)
    for i in range(tree.size):
        path, j = [], i
        while j > 0:  # the root is already the last token of `prefix`
            path.append(int(tree.tokens[j]))
            j = int(tree.parents[j])
        ids = torch.cat([prefix, torch.tensor([path[::-1]], dtype=prefix.dtype, device=prefix.device)], 1) if path else prefix
        out[i : i + 1] = logits_processor(ids, logits[i : i + 1])
    return out


def _shown_drafts(tree: DraftTree, path: list[int]) -> list[int]:
    """For displays: the accepted drafts plus the best-scoring child of the last accepted node (the rejected one)."""
    drafts = [int(tree.tokens[n]) for n in path[1:]]
    children = [i for i in range(1, tree.size) if int(tree.parents[i]) == path[-1]]
    if children:
        drafts.append(int(tree.tokens[max(children, key=lambda i: float(tree.scores[i]))]))
    return drafts


@torch.no_grad()
def tree_generate(
    target,
    drafter,
    input_ids: torch.Tensor,
    cache,
    logits_processor,
    stopping_criteria,
    generation_config,
    aux_ids: list[int],
    settings: dict,
    stats: SpecDecodeStats,
    streamer=None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Decode with dynamic draft trees. Returns (sequences [1, T], processed scores of emitted tokens)."""
    from .hf_integration import compact_cache

    device = target.device
    input_ids = input_ids.to(device)  # plain generate() accepts CPU inputs for an accelerator target
    do_sample = bool(generation_config.do_sample)
    eos = getattr(generation_config, "_eos_token_tensor", None)
    eos_ids = set(eos.reshape(-1).tolist()) if eos is not None else set()
    max_length = generation_config.max_length
    depth, top_k, total = int(settings["depth"]), int(settings["top_k"]), int(settings["total_tokens"])
    request = hidden_state_request(aux_ids)
    listeners = list(settings.get("listeners") or [])
    scores: list[torch.Tensor] = []

    def decode_one(prefix: torch.Tensor, new_ids: torch.Tensor):
        """Plain decoding: the target reads `new_ids` (the prompt, or the last token) after the cache; returns
        its output, the processed logits [1, V] of the next token and that token."""
        out = target(input_ids=new_ids, past_key_values=cache, use_cache=True, output_hidden_states=request,
                     logits_to_keep=1)
        logits = out.logits[:, -1].float()  # [1, V]
        logits = logits_processor(prefix, logits) if len(logits_processor) else logits
        token = int(torch.multinomial(torch.softmax(logits, -1), 1)) if do_sample else int(logits.argmax(-1))
        return out, logits, token

    out, logits, token = decode_one(input_ids, input_ids)  # prefill
    scores.append(logits)
    seq = torch.cat([input_ids, torch.tensor([[token]], device=device, dtype=input_ids.dtype)], 1)
    if streamer is not None:
        streamer.put(torch.tensor([token]))
    state = DraftState()
    pending_aux = gather_aux(out.hidden_states, aux_ids)  # [1, n, A]: real rows the drafter has not seen yet
    pending_tok = seq[:, 1:]  # [1, n] the token after each of those rows
    controller = settings.get("controller")  # DraftLengthController when the schedule is adaptive
    done = token in eos_ids or seq.shape[1] >= max_length or bool(stopping_criteria(seq, None).all())
    after_cycle = False  # whether the last round was a draft-and-verify cycle
    while not done:
        round_start = time.perf_counter()
        room = max_length - seq.shape[1] - 1
        levels = controller.choose() if controller is not None else depth
        if levels <= 0 or room <= 0:  # a plain step: the target decodes one token, the drafter catches up later
            out, node_logits, token = decode_one(seq, seq[:, -1:])
            new, keep_nodes = [token], [0]
            aux = gather_aux(out.hidden_states, aux_ids)  # [1, 1, A]
            if levels <= 0:
                stats.fallback_steps += 1
            else:
                stats.final_steps += 1
            shown, accepted, after_cycle = [], 0, False
        else:
            t0 = time.perf_counter()
            w = drafter.fc.weight
            d_logits, d_hidden = state.extend(drafter, pending_aux.to(w.device, w.dtype), pending_tok.to(w.device))
            t1 = time.perf_counter()
            levels = min(levels, room)
            tree = draft_tree(drafter, state, token, d_logits, d_hidden, levels, top_k, min(total, room + 1),
                              float(settings.get("confidence_threshold") or 0.0))
            t2 = time.perf_counter()
            stats.drafter_time += t2 - t0
            if controller is not None and after_cycle:  # a backlog after plain steps is not a round's cost
                controller.observe_drafter(t1 - t0, t2 - t1, levels)

            past_len = cache.get_seq_length()
            depths = tree.depths()  # [N+1]
            positions = (past_len + depths).to(device)[None]
            mask = tree_attention_mask(tree, past_len, target.dtype, device)
            out = target(
                input_ids=tree.tokens[None].to(device), attention_mask=mask, position_ids=positions,
                past_key_values=cache, use_cache=True, output_hidden_states=request,
            )
            node_logits = _process(logits_processor, seq, tree, out.logits[0].float())  # [N+1, V]
            if do_sample:
                path, bonus = accept_sampling(tree, torch.softmax(node_logits, -1))
            else:
                path = accept_greedy(tree, node_logits.argmax(-1))
                bonus = int(node_logits[path[-1]].argmax())
            new = [int(tree.tokens[n]) for n in path[1:]] + [bonus]
            # crop at EOS and at max_length, as the assisted loop does
            new = new[: max_length - seq.shape[1]]
            for i, tok in enumerate(new):
                if tok in eos_ids:
                    new = new[: i + 1]
                    break
            accepted = len(new) - 1
            keep_nodes = path[: accepted + 1]
            compact_cache(cache, past_len, torch.tensor(keep_nodes, device=device))
            aux = gather_aux(out.hidden_states, aux_ids)[:, keep_nodes]  # [1, a+1, A]
            drafted = int(depths.max())
            if drafted == 0:  # every branch was below the confidence threshold: that was a plain step
                stats.fallback_steps += 1
            else:
                stats.record_cycle(drafted, accepted)  # per position = per tree depth
            if controller is not None and drafted:
                controller.update(drafted, accepted, None if controller.seeded else tree.confidences())
            shown = _shown_drafts(tree, path) if drafted else []
            if len(new) < len(path):  # cut at EOS / max_length: nothing after the cut was rejected
                shown = shown[:accepted]
            after_cycle = drafted > 0
            pending_aux, pending_tok = pending_aux[:, :0], pending_tok[:, :0]  # the drafter has seen them now
        seq = torch.cat([seq, torch.tensor([new], device=device, dtype=seq.dtype)], 1)
        scores.extend(node_logits[n : n + 1] for n in keep_nodes)
        if streamer is not None:
            streamer.put(torch.tensor(new))
        for listener in listeners:
            listener(shown, accepted, new[-1])
        pending_aux = torch.cat([pending_aux, aux.to(pending_aux.device)], 1)
        pending_tok = torch.cat([pending_tok, seq[:, -(accepted + 1) :]], 1)
        token = new[-1]
        done = token in eos_ids or seq.shape[1] >= max_length or bool(stopping_criteria(seq, None).all())
        if controller is not None and levels <= 0:
            controller.observe_plain_round(time.perf_counter() - round_start)
    if streamer is not None:
        streamer.end()
    return seq, scores[: seq.shape[1] - input_ids.shape[1]]
