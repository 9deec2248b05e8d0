"""The shared speculation round: typed settings, one drafting function, the verification rule with sampled drafts,
tree-mode parity with chain mode, device-synced timings (injected clock) and the package layout."""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import tiny_drafter, tiny_target
from reference_acceptance import accept_sampling
from scipy import stats as scipy_stats
from transformers import GenerationConfig

from eagle_hf import DraftSettings, EagleCompatibilityError
from eagle_hf.hf.version import CACHE_KEY, output_cache
from eagle_hf.speculation.costs import CostModel
from eagle_hf.speculation.drafting import DraftState, draft_tree
from eagle_hf.speculation.rounds import RoundTiming, Timer
from eagle_hf.speculation.schedule import DraftLengthController
from eagle_hf.speculation.speculator import Speculator, plan_round
from eagle_hf.speculation.stats import SpecDecodeStats
from eagle_hf.speculation.tree import DraftTree

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ settings
def test_settings_precedence_and_aliases():
    s = DraftSettings.resolve({"depth": 7, "mode": "tree"}, GenerationConfig(tree_top_k=3), {"tree_total_tokens": 9})
    assert (s.mode, s.depth, s.top_k, s.total_tokens, s.schedule) == ("tree", 7, 3, 9, "adaptive")
    assert "tree_total_tokens" in s.sources["total_tokens"] and "config.json" in s.sources["depth"]
    # transformers' fixed draft length: depth K with the constant schedule, unless a schedule is named
    s = DraftSettings.resolve({}, None, {"num_assistant_tokens": 3})
    assert (s.depth, s.schedule) == (3, "constant")
    s = DraftSettings.resolve({}, None, {"num_assistant_tokens": 3, "num_assistant_tokens_schedule": "adaptive"})
    assert (s.depth, s.schedule) == (3, "adaptive")
    # ... and a chain, whatever the default mode, unless a mode is named
    assert DraftSettings.resolve({"mode": "tree"}, None, {"num_assistant_tokens": 3}).mode == "chain"
    assert DraftSettings.resolve({}, None, {"num_assistant_tokens": 3, "draft_mode": "tree"}).mode == "tree"
    # keys saved by eagle_hf 0.1 drafters
    assert DraftSettings.resolve({"num_draft_tokens": 4}).depth == 4
    assert DraftSettings(mode="chain").branching == 1 and DraftSettings(mode="tree").branching == 4


@pytest.mark.parametrize("saved,call,message", [
    ({"depht": 3}, {}, "Unknown key 'depht'"),
    ({}, {"tree_depth": 2.5}, "depth must be an integer"),
    ({}, {"assistant_confidence_threshold": 1.5}, r"must be in \[0, 1\]"),
    ({}, {"tree_top_k": 0}, "tree_top_k must be at least 1"),
    ({"keep_gain": 1.2}, {}, "keep_gain"),
    ({}, {"draft_mode": "forest"}, "draft_mode must be 'chain' or 'tree'"),
])
def test_bad_settings_name_the_problem(saved, call, message):
    with pytest.raises(EagleCompatibilityError, match=message):
        DraftSettings.resolve(saved, None, call)


def test_unknown_saved_setting_fails_before_generation():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    drafter.config.draft_settings = {"max_draft": 4}
    with pytest.raises(EagleCompatibilityError, match="config.json `draft_settings`"):
        target.generate(torch.randint(1, 96, (1, 5)), assistant_model=drafter, max_new_tokens=4)
    drafter.config.draft_settings = {}


# ------------------------------------------------------------------------------------------------ drafting
def _drafter_state(seed=3, peaky=30.0):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, seed=seed)
    drafter.bind_target_embedding(target.get_input_embeddings())
    with torch.no_grad():
        drafter.lm_head.weight.mul_(peaky)
    ids = torch.randint(1, 96, (1, 9), generator=torch.Generator().manual_seed(seed)).to(target.device)
    from eagle_hf.drafter.capture import gather_aux
    from eagle_hf.hf import check_compatible

    out = target(ids, output_hidden_states=True)
    aux = gather_aux(out.hidden_states, check_compatible(target, drafter))[:, :-1]  # [1, 8, A]
    state = DraftState.for_drafter(drafter)
    logits, hidden = state.extend(drafter, aux, ids[:, 1:])
    return drafter, state, int(ids[0, -1]), logits, hidden


def test_a_chain_is_the_tree_with_top_k_one():
    """top_k=1 grows the greedy chain: each draft is the argmax after its parent, parents are the previous node."""
    drafter, state, root, logits, hidden = _drafter_state()
    tree = draft_tree(drafter, state, root, logits, hidden, 5, 1, 6)
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 4] and tree.depths().tolist() == [0, 1, 2, 3, 4, 5]
    # recompute the chain step by step with the drafter's cache: same tokens
    past, pos, h, lg, tokens = state.kv, state.next_position - 1, hidden, logits, []
    for _ in range(5):
        tok = int(drafter.draft_to_target(lg.argmax(-1))[0])
        tokens.append(tok)
        pos += 1
        out = drafter.step(h, torch.tensor([[tok]], device=h.device), torch.tensor([[pos]], device=h.device), past=past)
        past, lg, h = past.append(out.kv), out.logits[:, -1], out.hidden
    assert tree.tokens[1:].tolist() == tokens
    # the chain's confidences are each draft's own probability
    own = [math.exp(float(tree.scores[i]) - float(tree.scores[i - 1])) for i in range(1, 6)]
    assert tree.confidences() == pytest.approx(own)


def test_chain_threshold_keeps_the_first_unsure_draft_and_tree_threshold_prunes_it():
    drafter, state, root, logits, hidden = _drafter_state(peaky=1.0)  # unsure: probabilities ~1/96
    chain = draft_tree(drafter, state, root, logits, hidden, 5, 1, 6, 0.5, prune=False)
    tree = draft_tree(drafter, state, root, logits, hidden, 5, 1, 6, 0.5, prune=True)
    assert chain.num_drafts == 1 and tree.num_drafts == 0


# ------------------------------------------------------------------------------------------------ verification
def test_sampled_and_deterministic_siblings_are_accepted_exactly():
    """A root with a sampled child (drawn from q, with q recorded) and a deterministic sibling: the first emitted
    token is distributed as the target's p (chi-square), whichever child is tried and whatever q is."""
    vocab = 8
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    q_logits = torch.randn(vocab, generator=g) * 2.0
    q = torch.softmax(q_logits, -1)
    first, n = [], 6000
    for _ in range(n):
        x = int(torch.multinomial(q, 1, generator=g))  # the sampled draft
        tree = DraftTree(torch.tensor([0, x, 3]), torch.tensor([-1, 0, 0]), torch.zeros(3))
        q_rows = torch.stack([torch.zeros(vocab), q_logits, torch.full((vocab,), -1e9)])  # [3, V]
        q_rows[2, 3] = 0.0  # node 2 is deterministic: one-hot on token 3
        path, token = accept_sampling(tree, torch.stack([p, p, p]), q_rows, generator=g)
        first.append(int(tree.tokens[path[1]]) if len(path) > 1 else token)
    observed = torch.bincount(torch.tensor(first), minlength=vocab).double()
    assert scipy_stats.chisquare(observed.numpy(), (p.double() * n).numpy()).pvalue > 1e-3


# ------------------------------------------------------------------------------------------------ tree parity
def test_tree_mode_returns_what_chain_mode_returns():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids = torch.randint(1, 96, (1, 7), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_scores=True,
              output_logits=True, output_hidden_states=True)
    plain = target.generate(ids, **kw)
    tree = target.generate(ids, assistant_model=drafter, draft_mode="tree", tree_depth=3, tree_top_k=2,
                           tree_total_tokens=6, num_assistant_tokens_schedule="constant", **kw)
    assert torch.equal(tree.sequences, plain.sequences)
    assert len(tree.scores) == len(tree.logits) == len(tree.hidden_states) == 12
    for a, b in zip(tree.logits, plain.logits):
        assert torch.allclose(a, b, atol=1e-4)
    assert tree.hidden_states[0][0].shape[1] == 7 and tree.hidden_states[5][-1].shape[1] == 1
    assert torch.allclose(tree.hidden_states[5][-1], plain.hidden_states[5][-1], atol=1e-4)
    # each step's own copy, as plain generate() keeps its logits (not a view of a verify's outputs: a compiled
    # forward's CUDA graphs write the next ones over those)
    kept = [*tree.scores, *tree.logits, *(h for step in tree.hidden_states[1:] for h in step)]
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in kept)


@pytest.mark.parametrize("key", sorted({CACHE_KEY, "past_key_values"}))
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_a_cache_passed_in_is_used_and_returned(mode, key):
    """Multi-turn reuse: generate once, then continue from the returned cache with a longer prompt (under the
    installed transformers' name for it, and the old name `past_key_values`, which 5.24+ still takes)."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    first = torch.randint(1, 96, (1, 6), generator=torch.Generator().manual_seed(4))
    kw = dict(do_sample=False, return_dict_in_generate=True, assistant_model=drafter, draft_mode=mode)
    res = target.generate(first, max_new_tokens=8, **kw)
    follow = torch.cat([res.sequences, torch.randint(1, 96, (1, 3), generator=torch.Generator().manual_seed(5))], 1)
    out = target.generate(follow, max_new_tokens=10, **{key: output_cache(res)}, **kw)
    assert torch.equal(out.sequences, target.generate(follow, max_new_tokens=10, do_sample=False))
    assert output_cache(out).get_seq_length() == out.sequences.shape[1] - 1


def test_streamer_in_tree_mode():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids = torch.randint(1, 96, (1, 6), generator=torch.Generator().manual_seed(6))
    ref = target.generate(ids, max_new_tokens=16, do_sample=False)

    class Ids:
        def __init__(self):
            self.seen = []

        def put(self, value):
            self.seen += value.reshape(-1).tolist()

        def end(self):
            self.ended = True

    streamer = Ids()
    out = target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=drafter, draft_mode="tree",
                          streamer=streamer)
    assert torch.equal(out, ref) and streamer.ended
    assert streamer.seen[-(out.shape[1] - 6):] == out[0, 6:].tolist()


def test_tree_fallback_warns_once_per_model(caplog):
    from test_tree import unmaskable_target

    target = unmaskable_target()
    drafter = tiny_drafter(target)
    ids = torch.randint(1, 96, (1, 6))
    with caplog.at_level("WARNING", logger="eagle_hf"):
        for _ in range(3):
            target.generate(ids, max_new_tokens=4, do_sample=False, assistant_model=drafter, draft_mode="tree")
    assert caplog.text.count("falling back to chain") == 1


# ------------------------------------------------------------------------------------------------ timings
class FakeQueue:
    """An asynchronous device: work runs in order, and an event records when the queue reaches it."""

    def __init__(self):
        self.done_at = 0.0  # device time at which the work queued so far is done

    def event(self):
        queue = self

        class Event:
            def record(self):
                self.at = queue.done_at

            def elapsed_time(self, other):  # milliseconds, as torch.cuda.Event's
                return (other.at - self.at) * 1000.0

        return Event()


def test_drafter_costs_are_timed_on_the_device_without_a_sync(monkeypatch):
    """On an asynchronous device the drafter's time is the device's, read from events once the round's read-back
    has passed them (one round late), never by synchronising. Each drafter step queues 0.002 s of device work."""
    drafter, state, root, _, _ = _drafter_state()
    queue = FakeQueue()
    original = type(drafter).step

    def step(self, *args, **kwargs):
        queue.done_at += 0.002
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(drafter), "step", step)
    cost = CostModel(verify=[1.0] * 9, draft_step=0.5, base_seconds=0.01)
    controller = DraftLengthController(cost, max_draft=4)
    stats = SpecDecodeStats()
    timer = Timer(time_fn=lambda: pytest.fail("the wall clock was read"), event_fn=queue.event)
    sp = Speculator(drafter, DraftSettings(), stats, controller, timer=timer)
    sp.state = state
    aux = torch.zeros(1, 1, drafter.fc.weight.shape[1], device=drafter.device)
    timings = []

    def observe(at):  # what the decoding loops do with a round's marks
        timing = RoundTiming.from_marks(at, width=5, drafting_rows=1, levels=levels, drafter_prefill=drafter_prefill)
        timings.append(timing)
        controller.observe(timing)  # (the schedule's one door: it teaches the cost model too)

    for i in range(40):  # regular cycles: commit one real row, draft 4, all rejected
        sp.commit(aux, torch.tensor([[5]], device=aux.device), position=sp.state.next_position)
        plan_round([sp], [8])
        sp.this_round.kind = "draft"
        marks = {"start": timer.mark()}
        sp.draft(root, 4, 5, marks=marks)
        drafter_prefill, levels = sp.drafter_prefill, sp.this_round.drafter_levels
        marks["end"] = timer.mark()
        timer.measure_marks(marks, observe)
        assert len(timings) == i  # not before the read-back
        timer.read_back()
        sp.end_round(0, 7)
    # a chain of 4: 1 catch-up step (its logits give the first draft), then 3 level forwards (the last draft needs
    # none), 0.002 s each; the first round's catch-up read the prompt's rows (a drafter_prefill: not a regular round's cost)
    assert timings[0].drafter_prefill and not timings[1].drafter_prefill and timings[1].levels == 3
    assert timings[1].catch_up == pytest.approx(0.002) and timings[1].draft == pytest.approx(0.006)
    assert controller.costs.draft_step == pytest.approx(0.002 / 0.01, rel=1e-3)
    assert controller.costs.round_overhead == pytest.approx(0.002 / 0.01, rel=1e-3)
    assert not timer.pending


def test_a_cpu_timer_measures_at_once():
    times = iter([1.0, 1.5])
    timer, seen = Timer(time_fn=lambda: next(times)), []
    timer.measure([timer.mark(), timer.mark()], seen.append)
    assert seen == [0.5] and not timer.events


def test_closing_a_timer_hands_over_what_the_device_finished_and_drops_the_rest():
    """The end of a call (no read-back follows its last round): a measurement whose last mark the device has
    passed (a non-blocking query) reaches its callback, one it has not is dropped, nothing stays pending; after an
    error nothing is handed over."""
    queue = FakeQueue()
    done = {"now": False}

    def event():
        e = queue.event()
        e.query = lambda: done["now"] or e.at < 1.0
        return e

    for hand_over, expected in ((True, [0.5]), (False, [])):
        timer, seen = Timer(time_fn=lambda: pytest.fail("the wall clock was read"), event_fn=event), []
        queue.done_at = 0.0
        a = timer.mark()
        queue.done_at = 0.5
        b = timer.mark()
        timer.measure([a, b], seen.append)  # finished: its last mark is before the device's position 1.0
        queue.done_at = 2.0
        timer.measure([b, timer.mark()], seen.append)  # not finished
        timer.close(hand_over)
        assert seen == pytest.approx(expected) and not timer.pending


# ------------------------------------------------------------------------------------------------ layout
def _module_imports(path: Path, package: str, modules) -> set[str]:
    """eagle_hf modules imported by `path`, at module level or inside functions (``from . import name`` imports
    the module `name`, or the package when `name` is not one of its modules)."""
    tree = ast.parse(path.read_text())
    here = package.split(".")
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[: len(here) - node.level + 1]
            mod = ".".join(base + ([node.module] if node.module else []))
            out.update([mod] if node.module else
                       [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eagle_hf"):
            out.add(node.module)
    return out


def test_no_import_cycles_and_transformers_internals_stay_in_eagle_hf_hf():
    pkg = ROOT / "eagle_hf"
    modules = {}
    for path in pkg.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        package = name if rel.name == "__init__" else ".".join(rel.parts[:-1])
        modules[name] = (path, package)
    graph = {n: {m for m in _module_imports(p, pkg_, modules) if m in modules} for n, (p, pkg_) in modules.items()}

    def visit(node, stack):
        assert node not in stack, f"import cycle: {' -> '.join(stack[stack.index(node):] + [node])}"
        for nxt in graph[node]:
            visit(nxt, stack + [node])

    for name in graph:
        visit(name, [])
    private = ("transformers.generation", "transformers.cache_utils", "transformers.modeling_rope_utils",
               "_eos_token_tensor", "_attn_implementation", "_get_candidate_generator", "_is_stateful")
    for name, (path, _) in modules.items():
        if name.startswith("eagle_hf.hf") or name == "eagle_hf.compat":
            continue
        text = path.read_text()
        found = [p for p in private if re.search(r"(?<!\w)" + re.escape(p), text)]  # (public set_attn_implementation
        # is not the private _attn_implementation)
        assert not found, f"{name} reads transformers internals {found}: move it to eagle_hf.hf or eagle_hf.compat"
    for name, (path, _) in modules.items():  # the speculation round stays free of transformers and the loops
        if name.startswith("eagle_hf.speculation"):
            wrong = sorted(m for m in graph[name] if m.startswith(("eagle_hf.hf", "eagle_hf.tools", "eagle_hf.training")))
            assert not wrong, f"{name} imports {wrong}: eagle_hf.speculation must not import the loops or the tools"
            text = path.read_text()
            assert not re.search(r"^\s*(from|import) transformers", text, re.MULTILINE), f"{name} imports transformers"


def test_a_rounds_timings_enter_through_one_door():
    """Both loops report a round's timings through `report_round` (the schedule, or the loop's cost model, and
    the rows' stats) with facts from `round_facts`; nothing else feeds them."""
    pkg = ROOT / "eagle_hf"
    found = {}
    for path in pkg.rglob("*.py"):
        text = path.read_text()
        for pattern in ("record_timing(timing", ".observe(timing", "round_facts(", "report_round("):
            if pattern in text:
                found.setdefault(pattern, set()).add(path.relative_to(pkg).as_posix())
    assert found["record_timing(timing"] == found[".observe(timing"] == {"speculation/rounds.py"}
    assert found["report_round("] == {"speculation/rounds.py", "hf/tree_loop.py", "hf/candidate.py"}
    assert found["round_facts("] == {"speculation/speculator.py", "hf/tree_loop.py", "hf/candidate.py"}
