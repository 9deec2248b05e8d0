"""What the stages share: the shapes, the report (report.json, report.md), budgets and stage results, the
context of a run, random models built from a config and the calls made on them, and the models and patches used by
more than one stage (the cycle target and its oracle drafter, draft levels, the kernel cases)."""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import logging
import os
import shutil
import time
from pathlib import Path

# (before transformers is imported: the stages import it inside their functions)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

STAGES = ("env", "suite", "equality", "replay", "compiled", "sync", "profile", "memory", "kernels", "quant", "sampling",
          "training")


# ============================================================================ shapes
@dataclasses.dataclass(frozen=True)
class Shapes:
    target: dict  # the real-shape target (bf16): speed, syncs, memory, kernels, bf16 equality
    draft_vocab: int
    f32: dict  # the float32 target of the equality checks
    f32_draft_vocab: int
    contexts: tuple[int, ...]  # replay: context lengths
    batches: tuple[int, ...]  # replay: rows
    new_tokens: int  # replay / memory: tokens generated per call
    repeats: int  # replay: timed runs per mode (medians)
    equality_prompts: int
    equality_new: int
    long_context: int  # memory
    memory_batches: tuple[int, ...]
    memory_calls: int
    samples: int  # sampling: draws per mode
    sample_rows: int  # sampling: rows per call
    quant: dict  # the bitsandbytes target


LLAMA31_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=16384)
FULL = Shapes(
    target=LLAMA31_8B, draft_vocab=32000,  # the published EAGLE-3 drafter for Llama-3.1-8B: 32k drafts with d2t
    f32=dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
             intermediate_size=3584, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=16384),
    f32_draft_vocab=32000, contexts=(1024, 8192), batches=(1, 4, 16), new_tokens=96, repeats=3,
    equality_prompts=6, equality_new=48, long_context=8192, memory_batches=(1, 8), memory_calls=20,
    samples=20000, sample_rows=2000,
    quant=dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
               intermediate_size=5632, vocab_size=128256, max_position_embeddings=4096),
)
SMALL = Shapes(
    target=dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
                intermediate_size=512, vocab_size=4096, max_position_embeddings=4096),
    draft_vocab=1024,
    f32=dict(hidden_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=256, vocab_size=4096, max_position_embeddings=4096),
    f32_draft_vocab=1024, contexts=(64, 256), batches=(1, 4), new_tokens=24, repeats=2,
    equality_prompts=3, equality_new=20, long_context=512, memory_batches=(1, 2), memory_calls=5,
    samples=1200, sample_rows=400,
    quant=dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
               intermediate_size=512, vocab_size=4096, max_position_embeddings=4096),
)

#: how eagle_hf is asked for each mode (docs/usage.md); constant schedules draft every round
CHAIN = dict(draft_mode="chain", num_assistant_tokens=5)
TREE = dict(draft_mode="tree", num_assistant_tokens_schedule="constant")
MODES = {"chain": CHAIN, "tree": TREE, "default": {}}


# ============================================================================ the report
class Report:
    """report.json (everything) and report.md (for people), rewritten after every stage; stages of an earlier run
    in the same folder are kept unless run again."""

    def __init__(self, out: Path, mirrors: list[Path], meta: dict):
        self.out, self.mirrors = out, mirrors
        out.mkdir(parents=True, exist_ok=True)
        old = out / "report.json"
        self.stages: dict = json.loads(old.read_text())["stages"] if old.is_file() else {}
        self.meta = meta

    def record(self, name: str, result: dict) -> None:
        self.stages[name] = result
        self.write()

    def write(self) -> None:
        data = {"meta": self.meta, "stages": {k: self.stages[k] for k in STAGES if k in self.stages}}
        (self.out / "report.json").write_text(json.dumps(data, indent=1, default=str))
        (self.out / "report.md").write_text(self.markdown(data))
        for mirror in self.mirrors:
            mirror.mkdir(parents=True, exist_ok=True)
            for f in self.out.iterdir():
                if f.is_file():
                    shutil.copy2(f, mirror / f.name)

    @staticmethod
    def markdown(data: dict) -> str:
        meta = data["meta"]
        head = (f"{meta.get('device_name')} ({meta.get('device')}); torch {meta.get('torch')}, transformers "
                f"{meta.get('transformers')}; {'small' if meta.get('small') else 'full'} shapes; run "
                f"{meta.get('started')}. Command: `{meta.get('command')}`")
        lines = ["# eagle_hf device check", "", head, ""]
        lines += ["| stage | status | seconds | summary |", "|---|---|---|---|"]
        for name, r in data["stages"].items():
            lines.append(f"| {name} | {r.get('status')} | {r.get('seconds', 0):.0f} | {_cell(r.get('summary', ''))} |")
        for name, r in data["stages"].items():
            lines += ["", f"## {name}: {r.get('status')}", "", r.get("summary", "")]
            if r.get("findings"):
                lines += [""] + [f"- {f}" for f in r["findings"]]
            for key, value in (r.get("data") or {}).items():
                lines += ["", f"**{key}**", "", *_render(value)]
            if r.get("error"):
                lines += ["", "```", r["error"].rstrip(), "```"]
        return "\n".join(lines) + "\n"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _render(value) -> list[str]:
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        keys = list(dict.fromkeys(k for v in value for k in v))
        return ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)] + [
            "| " + " | ".join(_cell(v.get(k, "")) for k in keys) + " |" for v in value]
    if isinstance(value, dict) and all(not isinstance(v, (dict, list)) for v in value.values()):
        return ["| key | value |", "|---|---|"] + [f"| {k} | {_cell(v)} |" for k, v in value.items()]
    text = json.dumps(value, indent=1, default=str)
    return ["```json", text[:4000] + ("\n..." if len(text) > 4000 else ""), "```"]


class Budget:
    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.perf_counter()

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)

    def allows(self, estimate: float = 0.0) -> bool:
        return self.left() > estimate


class StageResult(dict):
    """status ("ok", "failed": a check failed, "skipped", "partial": the budget ran out, "error"), summary,
    findings (sentences), data (tables and numbers)."""

    def __init__(self):
        super().__init__(status="ok", summary="", findings=[], data={})

    def find(self, text: str) -> None:
        self["findings"].append(text)


# ============================================================================ models and calls
class Context:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.small = args.small
        self.shapes = SMALL if args.small else FULL
        self.out = Path(args.out)
        self.cuda = self.device.type == "cuda"
        self._models: dict = {}
        self.ran: list[str] = []  # stages run before the current one, in this process
        self.report: Report | None = None
        self.stage = ""

    def partial(self, res: StageResult) -> None:
        """Write what the running stage has so far (a kill of a long stage keeps it)."""
        if self.report is not None:
            self.report.record(self.stage, dict(res, status="running", summary="(running) " + res.get("summary", "")))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def pair(self, kind: str):
        """(target, drafter), built once per process: "bf16" (the real shape) or "f32" (the equality shape)."""
        if kind not in self._models:
            s = self.shapes
            shape, dtype, vocab = (s.target, torch.bfloat16, s.draft_vocab) if kind == "bf16" else (
                s.f32, torch.float32, s.f32_draft_vocab)
            target = build_target(shape, dtype, self.device, seed=0)
            self._models[kind] = (target, build_drafter(target, vocab, seed=1))
        return self._models[kind]

    def drop(self, kind: str) -> None:
        self._models.pop(kind, None)
        if self.cuda:
            torch.cuda.empty_cache()


def build_target(shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0, attn: str = "sdpa"):
    """A random Llama of `shape`, initialised on `device` in `dtype` (no host copy, no download)."""
    import transformers as tf

    config = tf.LlamaConfig(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    with torch.device(device):
        model = tf.LlamaForCausalLM._from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model.eval()


def build_drafter(target, draft_vocab: int, seed: int = 1, eagle31: bool = False):
    """A random drafter of the published EAGLE-3 shape for `target`: the target's width and heads, one layer, a
    `draft_vocab`-row lm_head with a valid random `d2t` (every target id it maps to is distinct)."""
    from eagle_hf import EagleDrafter

    device = target.get_input_embeddings().weight.device
    torch.manual_seed(seed)
    with torch.device(device):
        drafter = EagleDrafter.for_target(target, draft_vocab_size=draft_vocab, eagle31=eagle31)
    if drafter.d2t is not None:
        used = draft_ids(drafter.config.vocab_size, draft_vocab, seed)
        drafter.d2t.copy_((used - torch.arange(draft_vocab)).to(device))
        drafter.t2d.zero_()
        drafter.t2d[used.to(device)] = True
    return drafter.to(device).eval()


def draft_ids(vocab: int, draft_vocab: int, seed: int) -> torch.Tensor:
    """The target ids `build_drafter` gives a drafter of `draft_vocab` drafts (sorted; all ids when equal)."""
    if draft_vocab >= vocab:
        return torch.arange(vocab)
    return torch.sort(torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:draft_vocab]).values


def prompts(rows: int, lengths: list[int] | int, vocab: int, seed: int, device, repeat: bool = False):
    """Left-padded random prompts (ids, mask). `repeat`: each prompt ends with a copy of its first quarter, so copy
    drafting has something to copy."""
    g = torch.Generator().manual_seed(seed)
    lengths = [lengths] * rows if isinstance(lengths, int) else lengths
    width = max(lengths)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for r, n in enumerate(lengths):
        p = torch.randint(1, vocab, (n,), generator=g)
        if repeat and n >= 8:
            q = n // 4
            p[n - q:] = p[:q]
        ids[r, width - n:], mask[r, width - n:] = p, 1
    return ids.to(device), mask.to(device)


def generate(target, ids, mask, new: int, drafter=None, **kwargs):
    """generate() with a drafter (EAGLE) or without (plain); greedy unless kwargs say otherwise."""
    kwargs.setdefault("do_sample", False)
    if drafter is not None:
        kwargs["assistant_model"] = drafter
    with torch.no_grad():
        return target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, **kwargs)


def sequences(out):
    return getattr(out, "sequences", out)


def parse_cells(spec: str) -> list[tuple[int, int]]:
    """"8192x1,1024x4" -> [(8192, 1), (1024, 4)]: (context, batch) cells, in the order given."""
    return [tuple(int(x) for x in cell.split("x")) for cell in spec.split(",") if cell]


def save_trace(prof, path: Path) -> None:
    """The profiler's chrome trace, gzipped at `path` (``*.json.gz``)."""
    raw = path.with_suffix("")  # *.json
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as f, gzip.open(path, "wb") as g:
        shutil.copyfileobj(f, g)
    raw.unlink()


def loop_rounds(st) -> int:
    """The call's rounds after the prefill: a batch's merged stats add its rows' rounds, the loop ran the
    longest row's (one verify forward a round for all rows)."""
    return max(r.steps for r in st.per_row) if st.per_row else st.steps


def timed(ctx: Context, fn, *args, **kwargs):
    """fn(*args, **kwargs) and its wall time, the device synchronised before and after."""
    ctx.sync()
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    ctx.sync()
    return out, time.perf_counter() - start


def last_stats():
    import eagle_hf

    return eagle_hf.last_stats()


@contextlib.contextmanager
def eagle_logs():
    """Log records of the "eagle_hf" logger inside the block (what mode ran, fallbacks)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger("eagle_hf")
    handler, level = Keep(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def mode_ran(records) -> str:
    """The mode an EAGLE call ran, from its log ("EAGLE generate (tree): ..."), and whether it fell back."""
    messages = [r.getMessage() for r in records]
    ran = next((m.split("(", 1)[1].split(")", 1)[0] for m in messages if m.startswith("EAGLE generate (")), "?")
    fallback = any("falling back to chain" in m for m in messages)
    return f"{ran} (fallback from tree)" if fallback else ran


def out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


# ============================================================================ shared by several stages: the cycle target
# and its oracle drafter (compiled, sampling), draft levels (compiled, profile), kernel cases (kernels, quant)
def cycle_target(shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0, gain: float = 1.0,
                 within: torch.Tensor | None = None):
    """A random Llama whose next token is a fixed function of the current one, ``succ[token]``, by a wide margin:
    returns (target, succ on the host). `succ` is one cycle through `within` (target ids, e.g. a drafter's draft
    vocabulary: a continuation that starts there stays there) and one through the other ids. Every layer still
    runs at its full cost, but its output projections are scaled down (o_proj, down_proj x 0.01) and the token
    embeddings up (x 50), so the residual stream is the current token's embedding plus a little; the output head's
    row ``succ[t]`` is token t's unit embedding times `gain`. The successor's logit is then about
    ``gain * sqrt(hidden)`` against others of spread `gain`: at the 8B shape (gain 1) a margin of ~60 that bf16
    never flips, so identical calls give identical output and every draft tree that holds the continuation
    matches it (the tree's ceiling). A small `gain` spreads the distribution (the sampling checks)."""
    target = build_target(shape, dtype, device, seed=seed)
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(seed + 7)
    inside = torch.zeros(vocab, dtype=torch.bool)
    if within is not None:
        inside[within.cpu()] = True
    succ = torch.empty(vocab, dtype=torch.long)
    for group in (torch.nonzero(inside)[:, 0], torch.nonzero(~inside)[:, 0]):
        if len(group):
            ring = group[torch.randperm(len(group), generator=g)]
            succ[ring] = ring.roll(-1)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.01)
            layer.mlp.down_proj.weight.mul_(0.01)
        emb = target.model.embed_tokens.weight
        emb.mul_(50.0)
        unit = emb.float() / emb.float().norm(dim=-1, keepdim=True).clamp_min(1e-6)  # [V, H] (pad's: 0)
        head = torch.empty_like(unit)
        head[succ.to(unit.device)] = unit * gain  # row succ[t]: token t's direction
        target.lm_head.weight.copy_(head.to(target.lm_head.weight.dtype))
    return target, succ


def draft_vocabulary(drafter) -> torch.Tensor:
    """The target ids a drafter can propose (``draft + d2t[draft]``), on the host."""
    ids = torch.arange(drafter.config.draft_vocab_size)
    return ids if drafter.d2t is None else ids + drafter.d2t.cpu()


#: per oracle case: its tensors and the drafter's graphs captured with it (`oracle_drafter`)
_ORACLES: dict[tuple, list] = {}


@contextlib.contextmanager
def oracle_drafter(drafter, succ: torch.Tensor, corrupt: float = 0.0, seed: int = 0, rows: int = 1,
                   length: int = 16384):
    """The drafter's own logits follow a `cycle_target`'s continuation: each pass adds 1e4 to the draft logit of
    ``succ[token]`` for the token each row reads (it predicts the next position's), so the drafter's top choice
    is the continuation with probability ~1 and its other top-k are its own. Every path of eagle_hf runs as with a
    real drafter: choices on the device or the host, chains and trees, CUDA graphs (captured with the oracle in
    them), sampling (q is the drafter's distribution). With `corrupt` = r the continuation's token at a
    (row, position) is withheld with probability r (a fixed hash of the two: every run and mode loses the same
    positions), so a chain's acceptance falls as (1 - r) a level: the acceptance curve."""
    import random

    from eagle_hf.programs import to_device
    from eagle_hf.speculation import drafting as graphs
    from eagle_hf.speculation.drafting import DraftState

    device = drafter.fc.weight.device
    case = (id(drafter), id(succ), corrupt, seed, rows, length)
    if case not in _ORACLES:  # (kept: the drafter's graphs captured with this oracle read these tensors)
        draft_of = torch.full((succ.numel(),), -1, dtype=torch.long)
        draft_of[draft_vocabulary(drafter)] = torch.arange(drafter.config.draft_vocab_size)
        nxt = draft_of[succ].to(device)  # [V] the draft id of each token's successor (-1: not in the draft vocabulary)
        held = torch.tensor([[random.Random(f"{seed}:{r}:{p}").random() < corrupt for p in range(length)]
                             for r in range(rows)], device=device) if corrupt > 0 else None  # [rows, length]
        _ORACLES[case] = [nxt, held, None]
    nxt, held, kept_graphs = _ORACLES[case]
    def bonus(logits: torch.Tensor, tokens: torch.Tensor, child_positions: torch.Tensor) -> torch.Tensor:
        """logits [..., Vd] for rows that read `tokens` [...], their children at `child_positions` [...]."""
        target = nxt[tokens]
        ok = target >= 0
        if held is not None:
            at = child_positions.clamp(max=length - 1).reshape(tokens.shape[0], -1)
            ok = ok & ~held[: tokens.shape[0]].gather(1, at).reshape(target.shape)
        ok = ok[..., None]
        return logits + torch.zeros_like(logits).scatter_(-1, target.clamp(min=0)[..., None], 1e4) * ok

    before = drafter.__dict__.get("step")
    step = drafter.step

    def oracle_step(hidden, input_ids, position_ids, past=None, mask=None, compute_logits=True):
        # row t reads token input_ids[t] at position position_ids[t] + 1: its child sits one further
        out = step(hidden, input_ids, position_ids, past=past, mask=mask, compute_logits=compute_logits)
        if out.logits is None:
            return out
        return dataclasses.replace(out, logits=bonus(out.logits, input_ids, position_ids + 2))

    extend = DraftState.extend

    def oracle_extend(state, draft_model, aux, next_tokens, counts=None, staged=None):  # the catch-up's logits:
        # the first level
        positions = list(state.positions)
        logits, hidden = extend(state, draft_model, aux, next_tokens, counts, staged)
        if draft_model is not drafter or (state.graphs is not None and state.keys is not None
                                          and logits is state.programs(draft_model).logits):
            return logits, hidden  # (the catch-up program's logits come from `oracle_step`: already the oracle's)
        n = next_tokens.shape[1]
        counts = counts or [n] * len(positions)
        last = to_device(torch.tensor([[max(c, 1) - 1] for c in counts]), next_tokens.device)  # [B, 1]
        child = to_device(torch.tensor([p + c + 1 for p, c in zip(positions, counts)]), next_tokens.device)
        return bonus(logits, next_tokens.gather(1, last)[:, 0], child), hidden

    # the graphs captured with this oracle (a timed run replays its warm-up's), not those of another case
    graphs._PER_DRAFTER.pop(drafter, None)
    if kept_graphs is not None:
        graphs._PER_DRAFTER[drafter] = kept_graphs
    drafter.step, DraftState.extend = oracle_step, oracle_extend
    try:
        yield
    finally:
        DraftState.extend = extend
        _ORACLES[case][2] = graphs._PER_DRAFTER.pop(drafter, None)
        if before is None:
            del drafter.step
        else:
            drafter.step = before


@contextlib.contextmanager
def draft_levels(kwargs: dict):
    """generate() keyword arguments, with ``levels="eager"`` (draft levels eager, not at fixed shapes),
    ``split_keys="off"`` (tree attention in one masked call) and ``widths="dynamic"`` (the compiled verify
    forward's width left to automatic dynamic shapes) turned into eagle_hf's settings for the call."""
    from eagle_hf.hf import attention, models
    from eagle_hf.speculation.drafting import GRAPHS_ENV

    kwargs = dict(kwargs)
    kwargs.pop("cache", None)  # (the stage's, `compiled.cache_of`)
    settings = {GRAPHS_ENV: "off" if kwargs.pop("levels", None) == "eager" else None}
    constants = {(attention, "SPLIT_KEY_FROM"): {} if kwargs.pop("split_keys", None) == "off" else None,
                 (models, "STATIC_WIDTHS"): False if kwargs.pop("widths", None) == "dynamic" else None}
    before = {name: os.environ.get(name) for name in settings}
    kept = {key: getattr(*key) for key, value in constants.items() if value is not None}
    for name, value in settings.items():
        if value is not None:
            os.environ[name] = value
    for (module, name), value in constants.items():
        if value is not None:
            setattr(module, name, value)
    try:
        yield kwargs
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for (module, name), value in kept.items():
            setattr(module, name, value)


def _kernel_cases(ctx, target, drafter, ids, mask, new, cases, label: dict, extra: dict | None = None) -> list[dict]:
    extra = extra or {}
    rows = []
    try:
        generate(target, ids, mask, new, **extra)  # warm-up (a compiled forward compiles here)
        ref, plain_t = timed(ctx, generate, target, ids, mask, new, **extra)
        rows.append(dict(label, case="plain", runs=True, seconds=plain_t))
    except Exception as err:  # noqa: BLE001
        return [dict(label, case="plain", runs=False, note=f"{type(err).__name__}: {err}"[:200])]
    for name, kwargs in cases.items():
        try:
            with eagle_logs() as records:
                generate(target, ids, mask, new, drafter, **kwargs, **extra)  # warm-up
                out, t = timed(ctx, generate, target, ids, mask, new, drafter, **kwargs, **extra)
            rows.append(dict(label, case=name, runs=True, ran=mode_ran(records[-50:]),
                             equal=bool(torch.equal(sequences(out), sequences(ref))), seconds=t,
                             speedup=plain_t / t))
        except Exception as err:  # noqa: BLE001 - what does not run is recorded, not raised
            rows.append(dict(label, case=name, runs=False, note=f"{type(err).__name__}: {err}"[:200]))
    return rows
