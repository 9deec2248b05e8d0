"""The replay stage: the eager loop's ceiling. A replay drafter (the real drafter runs, its choices replaced by the
target's own greedy continuation) in chain 3/5/8 and a tree against plain generate(), per context length and batch
size: interleaved timed runs after a warm-up, medians, the round's time split into the drafter's and the rest."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter

import torch

from .common import (
    TREE,
    Budget,
    Context,
    StageResult,
    generate,
    last_stats,
    loop_rounds,
    out_of_memory,
    parse_cells,
    prompts,
    timed,
)


@contextlib.contextmanager
def chooser_of(make):
    """Every drafting round's children chosen by ``make(drafter, top_k, positions, roots)`` (per row of the
    drafter's cache: `positions`, its next real position, `roots`, its tree's root token), a chooser of the whole
    batch's children (`eagle_hf.speculation.drafting.Chooser`), in place of the call's own. Patches
    eagle_hf.speculation.speculator.draft_trees, the seam the tests patch too (tests/conftest.py, patch_drafts)."""
    import inspect

    from eagle_hf.speculation import speculator as speculation

    original = speculation.draft_trees
    signature = inspect.signature(original)

    def draft_trees(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        a["choose"] = make(a["drafter"], a["top_k"], a["state"].positions, a["layout"].roots)
        return original(*bound.args, **bound.kwargs)

    speculation.draft_trees = draft_trees
    try:
        yield
    finally:
        speculation.draft_trees = original


#: the most draft levels the replay drafter follows the continuation for
REPLAY_DEPTH = 64


@contextlib.contextmanager
def replay_drafts(truth: list[list[int]]):
    """The replay drafter: the real drafter runs (its cost is real) but each row's chooser puts the target's own
    greedy continuation (`truth`, per row, in the row's positions) first, with probability 1, beside the drafter's
    own top-k: a chain is the continuation, a tree holds it as its deepest branch and the drafter's other
    proposals around it. Every draft on the continuation is accepted: the loop's ceiling (`chooser_of`; greedy
    calls only). Yields counts of drafted trees ("replayed", "unmatched": the row has left the recorded continuation)."""
    from eagle_hf.speculation.drafting import Choice

    counts = Counter()

    def _replay_chooser(drafter, top_k, positions, roots):
        wants = []
        for row, (position, root) in enumerate(zip(positions, roots)):
            seq = truth[row] if row < len(truth) and position < len(truth[row]) and truth[row][position] == root \
                else None
            seq = seq or next((t for t in truth if position < len(t) and t[position] == root), None)
            counts["replayed" if seq is not None else "unmatched"] += 1
            ahead = list(seq[position + 1 : position + 1 + REPLAY_DEPTH]) if seq is not None else []
            wants.append(ahead + [-1] * (REPLAY_DEPTH + 1 - len(ahead)))
        device = drafter.fc.weight.device
        want = torch.tensor(wants, device=device)  # [B, D + 1] each row's continuation after its root (-1: none)

        def choose(logits, paths):  # logits [B, k, Vd], paths [B, k, level]
            top = torch.topk(torch.log_softmax(logits.float(), dim=-1), top_k, dim=-1)
            tokens, logp = drafter.draft_to_target(top.indices), top.values  # [B, k, top_k]
            level = paths.shape[2]
            ahead = want[:, level][:, None, None].expand(-1, tokens.shape[1], 1)  # [B, k, 1] the next true token
            on = (paths == want[:, None, :level]).all(-1)[..., None] & (ahead >= 0)  # [B, k, 1] on the continuation
            rest = torch.sort((tokens == ahead).long(), dim=-1, stable=True).indices  # the others first, in order
            others = tokens.gather(-1, rest)[..., : top_k - 1]
            tokens = torch.where(on, torch.cat([ahead, others], -1), tokens)
            first = torch.arange(top_k, device=device) == 0
            return Choice(tokens, torch.where(on & first, 0.0, logp))  # probability 1: kept and grown

        return choose

    with chooser_of(_replay_chooser):  # (in place of any chooser: transformers' loop passes one for its chain)
        yield counts


def stage_replay(ctx: Context, budget: Budget) -> StageResult:
    """The loop's ceiling: chain 3/5/8 and a tree with a replay drafter against plain generate() (interleaved
    runs after a warm-up, medians), per context length and batch size, with the round's time split."""
    res = StageResult()
    s = ctx.shapes
    target, drafter = ctx.pair("bf16")
    vocab = target.config.vocab_size
    modes = {f"chain {k}": dict(draft_mode="chain", num_assistant_tokens=k, draft_sources="eagle") for k in (3, 5, 8)}
    modes["tree (depth 5, top-k 4, 16 tokens)"] = dict(TREE, draft_sources="eagle")
    cells = [(c, b) for b in s.batches for c in s.contexts]
    cells.sort(key=lambda cb: (cb[1] > 1, cb[0] > s.contexts[0], cb[1]))  # batch 1 first, then the short context
    if ctx.args.replay_cells:  # CONTEXTxBATCH,... in the order given
        cells = parse_cells(ctx.args.replay_cells)
    table, last_cell = [], 0.0
    for ctx_len, rows in cells:
        if not budget.allows(last_cell * 1.2 + 5):
            res.find(f"budget: skipped context {ctx_len} x batch {rows}")
            res["status"] = "partial"
            continue
        start = time.perf_counter()
        try:
            table += _replay_cell(ctx, target, drafter, vocab, ctx_len, rows, modes, budget)
        except Exception as err:
            if not out_of_memory(err):
                raise
            res.find(f"context {ctx_len} x batch {rows}: out of memory ({str(err).splitlines()[0][:160]})")
            torch.cuda.empty_cache() if ctx.cuda else None
        last_cell = time.perf_counter() - start
        res["data"] = {"speed": table}
        ctx.partial(res)
    res.find("times per round (from the last timed run): ms_per_round = median time / rounds (a batch's: its "
             "longest row's, one verify forward each); drafter = eagle_hf's "
             "own drafter clock (stats.drafter_time), rest = the target's "
             "verify forward plus bookkeeping; host clocks, on a GPU only approximate (no device sync per call)")
    off = [r for r in table if r.get("timed_runs_off_table")]
    if off:
        res.find(f"{len(off)} modes' timed runs left the output their warm-up reached (identical calls, different "
                 "bf16 output: timed_runs_off_table, first_off_column); their tau is not a ceiling")
    unequal = [r for r in table if r.get("equal") is False]
    if unequal:
        res.find(f"{len(unequal)} replay runs differ from plain greedy output (bf16 near-ties, see equality): each "
                 "mode replays its own output, found in up to three warm-up runs (fixed_point: found)")
    untimed = [r for r in table if r["mode"] != "plain" and not r.get("runs")]
    if untimed:
        res.find(f"{len(untimed)} modes warmed up but never timed (the budget): warmup_s says where it went")
    best = max((r for r in table if r["mode"] != "plain" and r.get("runs")), key=lambda r: r["speedup"], default=None)
    res["summary"] = (f"{len(table)} rows; best {best['mode']} at context {best['context']} x batch {best['batch']}: "
                      f"{best['speedup']:.2f}x plain (tau {best['tau']:.2f})" if best else "no measurements")
    return res


def _replay_cell(ctx, target, drafter, vocab, ctx_len, rows, modes, budget) -> list[dict]:
    s = ctx.shapes
    ids, mask = prompts(rows, ctx_len, vocab, seed=ctx_len + rows, device=ctx.device)
    plain_out, _ = timed(ctx, generate, target, ids, mask, s.new_tokens)  # also the plain warm-up
    times = {m: [] for m in ["plain", *modes]}
    info, truths = {}, {}
    truth: list[list[int]] = []  # what the replay drafter proposes; per mode, its own output (below)
    with replay_drafts(truth) as counts:
        for mode, kwargs in modes.items():  # warm-up: each mode's replay table, to its fixed point
            truth[:] = [t.tolist() for t in plain_out]  # no padding: a row's positions are its columns
            start = time.perf_counter()
            for tries in range(1, 4):
                # bf16: a verify forward over many tokens rounds differently from a one-token step, so a random
                # model's near-ties flip and the mode leaves plain's continuation; replaying the mode's own
                # output instead reproduces it (every draft on it accepted), usually after one more run
                out, _ = timed(ctx, generate, target, ids, mask, s.new_tokens, drafter, **kwargs)
                if out.tolist() == truth:
                    break
                truth[:] = [t.tolist() for t in out]
                if not budget.allows(4 * (time.perf_counter() - start) / tries):  # no room for another try and the
                    break  # timed runs: time what was found (a batch of 16 at the 8B shape spent 180 s here)
            truths[mode] = [list(t) for t in truth]
            info[mode] = dict(equal=bool(torch.equal(out, plain_out)), fixed_point=out.tolist() == truth,
                              warmup_s=round(time.perf_counter() - start, 1))
        for _ in range(s.repeats):
            if not budget.allows(5):
                break
            for mode, t_list in times.items():
                kwargs = modes.get(mode)
                if kwargs is not None:
                    truth[:] = truths[mode]
                    counts.clear()
                got, t = timed(ctx, generate, target, ids, mask, s.new_tokens,
                               drafter if kwargs is not None else None, **(kwargs or {}))
                t_list.append(t)
                if kwargs is not None and got.tolist() != truths[mode]:  # left the table it found in the warm-up
                    info[mode]["off_table"] = info[mode].get("off_table", 0) + 1
                    flat = [t for row in truths[mode] for t in row]
                    first = next(i for i, (x, y) in enumerate(zip(got.flatten().tolist(), flat)) if x != y)
                    info[mode]["first_off"] = min(info[mode].get("first_off", 1 << 30), first % got.shape[1])
                if kwargs is not None:  # the round's split, from a timed (warm) run
                    st = last_stats()
                    info[mode].update(tau=st.mean_acceptance_length, rounds=loop_rounds(st) + 1, drafter=st.drafter_time,
                                      total=st.total_time, replayed=counts["replayed"], unmatched=counts["unmatched"])
    plain = statistics.median(times["plain"]) if times["plain"] else float("nan")
    out = [{"context": ctx_len, "batch": rows, "mode": "plain", "median_s": plain, "runs": len(times["plain"]),
            "tok_per_s": rows * s.new_tokens / plain, "speedup": 1.0, "tau": 1.0}]
    for mode in modes:
        med = statistics.median(times[mode]) if times[mode] else float("nan")
        i = info[mode]
        if "rounds" not in i:  # warmed up, never timed: where the budget went
            out.append({"context": ctx_len, "batch": rows, "mode": mode, "runs": 0, "warmup_s": i["warmup_s"]})
            continue
        out.append({"context": ctx_len, "batch": rows, "mode": mode, "median_s": med, "runs": len(times[mode]),
                    "tok_per_s": rows * s.new_tokens / med, "speedup": plain / med, "tau": i["tau"],
                    "rounds": i["rounds"], "ms_per_round": 1e3 * med / i["rounds"],
                    "drafter_ms_per_round": 1e3 * i["drafter"] / i["rounds"],
                    "rest_ms_per_round": 1e3 * (i["total"] - i["drafter"]) / i["rounds"],
                    "plain_ms_per_token": 1e3 * plain / s.new_tokens, "equal": i["equal"],
                    "fixed_point": i["fixed_point"], "replayed_trees": i["replayed"],
                    "unmatched_trees": i["unmatched"], "timed_runs_off_table": i.get("off_table", 0),
                    "first_off_column": i.get("first_off"), "warmup_s": i["warmup_s"]})
    return out
