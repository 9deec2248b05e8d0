"""Chain mode: the `Speculator` behind transformers' `CandidateGenerator` seam (its assisted loop verifies)."""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from ..drafter.capture import gather_aux, hidden_state_request
from ..programs import to_device
from ..speculation.drafting import Choice
from ..speculation.rounds import Round, RoundTiming, report_round
from ..speculation.speculator import Speculator, plan_round, round_facts
from ..speculation.tree import draw, greedy, process_logits


class EagleCandidateGenerator(CandidateGenerator):
    """Chain drafting for transformers' assisted-decoding loop, from the target's own hidden states.

    Each round: the target's last forward returned aux taps for the positions it verified; the accepted ones are
    committed as real drafter rows, then the speculator drafts a chain. With ``do_sample`` drafts are sampled
    from the drafter's distribution after the same logits processors as the target, and those exact
    distributions are returned as ``candidate_logits`` for transformers' lossless rejection sampling.
    """

    requires_model_outputs = True

    def __init__(self, generation_config, logits_processor, call, speculator: Speculator):
        self.aux_ids = list(call.aux_ids)
        # a user who asked for all hidden states keeps them; we read our taps from the full tuple
        wanted = True if generation_config.output_hidden_states else hidden_state_request(self.aux_ids)
        self.model_kwargs_overrides = {"output_hidden_states": wanted}
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        self.max_length = generation_config.max_length
        self.speculator = speculator
        self.drafter = speculator.drafter
        self._marks: dict | None = None  # the current round's named marks (`RoundTiming`), ended by the next round
        self._facts: dict = {}  # ... and what the round did (`round_facts`)
        self._drafting: list = []  # ... and whether its drafter drafted

    @property
    def state(self):
        return self.speculator.state

    @property
    def stats(self):
        return self.speculator.stats

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens a round drafts (transformers 5.25's loop keeps that many recurrent states)."""
        return self.speculator.settings.depth

    def _choose(self, draft_logits: torch.Tensor, prefix: torch.Tensor, drafted: torch.Tensor):
        """draft_logits: [1, Vd], drafted: [1, d] the drafts so far -> (target id [1], processed target logits
        [1, V] or None, its log-probability [1]), on the device: nothing is read while the chain grows."""
        if not self.do_sample and len(self.logits_processor) == 0:
            logp, idx = torch.log_softmax(draft_logits.float(), dim=-1).max(dim=-1)  # [1]
            return self.drafter.draft_to_target(idx), None, logp
        logits = self.drafter.target_logits(draft_logits.float())  # [1, V]
        logits = process_logits(self.logits_processor, prefix, drafted, logits)  # drafted: [1, d]
        logp = torch.log_softmax(logits, dim=-1)  # [1, V]
        token = draw(logp.exp()) if self.do_sample else greedy(logp)  # [1]
        return token, (logits if self.do_sample else None), logp.gather(1, token[:, None])[:, 0].clamp(min=-69.0)

    def _chooser(self, prefix: torch.Tensor, drawn: list[torch.Tensor]):
        """The chain's chooser (one child per node) over `_choose`, for `draft_trees`; the distributions sampled
        drafts were drawn from go to `drawn` ([1, V] each, a level's after the level before)."""

        def choose(logits: torch.Tensor, paths: torch.Tensor) -> Choice:  # logits: [1, 1, Vd], paths: [1, 1, d]
            token, q, logp = self._choose(logits[0], prefix, paths[0])
            if q is not None:
                drawn.append(q)
            return Choice(token.view(1, 1, 1), logp.view(1, 1, 1))

        return choose

    # -- CandidateGenerator API ---------------------------------------------------------------------------
    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False, n_last_matches=0):
        sp = self.speculator
        if is_first_iteration or model_outputs is None:
            sp.prefill()
            return input_ids, None  # the target prefills; drafting starts from its hidden states
        sp.timer.read_back()  # transformers' loop has read the last verification back: its marks are done
        self._end_timing()
        self._marks = {"start": sp.timer.mark()}
        device = self.drafter.fc.weight.device
        with torch.no_grad():
            aux = gather_aux(model_outputs.hidden_states, self.aux_ids, device)  # [1, t, A*H_t]
            n_new = aux.shape[1] if sp.round == Round.PREFILL else n_last_matches + 1
            sp.commit(aux[:, :n_new], input_ids[:, -n_new:].to(device), position=input_ids.shape[1] - 1 - n_new)
            room = self.max_length - input_ids.shape[1] - 1
            depth = plan_round([sp], [room]).depths[0]
            if depth == 0:  # plain decoding this round; the drafter catches up when drafting resumes
                return self._verified(input_ids, 1), None
            drawn: list[torch.Tensor] = []
            tree = sp.draft(int(input_ids[0, -1]), depth, depth + 1, self._chooser(input_ids.to(device), drawn),
                            self._marks)
        if tree.num_drafts == 0:
            return self._verified(input_ids, 1), None
        self._verified(None, tree.size)
        drafts = to_device(tree.tokens[1:], input_ids.device).to(input_ids.dtype)[None]  # [1, k]
        q = torch.cat(drawn[: tree.num_drafts])[None] if drawn else None  # [1, k, V]
        return torch.cat([input_ids, drafts], 1), q

    def _verified(self, input_ids, width: int):
        """Mark where transformers' verify forward over `width` tokens starts."""
        sp = self.speculator
        self._marks["verify"] = sp.timer.mark()
        self._facts = round_facts([sp], width)
        self._drafting = [sp] if sp.eagle_depth > 0 else []
        return input_ids

    def _end_timing(self) -> None:
        """The last round's timings, from its marks to now (the next round's start), through the round's one
        door (`report_round`), as the tree loop's."""
        marks, sp = self._marks, self.speculator
        self._marks = None
        if marks is None or "verified" not in marks:
            return
        marks["end"] = sp.timer.mark()
        facts = self._facts

        drafting = self._drafting
        sp.timer.measure_marks(marks, lambda at: report_round(RoundTiming.from_marks(at, **facts), [sp], drafting))

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        sp = self.speculator
        if self._marks is not None:  # the verify forward (and transformers' acceptance) just ran
            self._marks["verified"] = sp.timer.mark()
            self._facts["tokens"] = float(num_matches) + 1.0
        sp.end_round(int(num_matches), int(input_ids[0, -1]))
