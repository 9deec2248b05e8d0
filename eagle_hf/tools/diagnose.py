"""Attention drift made visible: per draft depth, what the drafter attends to and how large its inputs are.

For a target, a drafter and a prompt set, the target decodes greedily (its own path, captured once with the
drafter's taps), and speculative rounds are replayed along that path exactly as greedy decoding with a fixed
chain would run them: the drafter reads the verified rows, drafts a chain of `depth` tokens (`draft_tree` with
``top_k = 1``), the chain is checked against the target's tokens, and the round advances by the accepted drafts
plus one. Per depth it records

* acceptance: the fraction of rounds that reach the depth (every earlier draft accepted) and the conditional
  acceptance rate there;
* the drafter's attention mass (mean over heads) on the first `sink_tokens` positions (the sink), on the rest of
  the verified context, and on its own drafts of this round;
* the norm of the hidden state fed back to the next step (pre-norm for EAGLE-3, post-norm for EAGLE-3.1) and of
  the layer's pre-norm output (the residual stream, the same thing for EAGLE-3);

and per round the norms of the fused input parts of the last verified row (each captured target state before
and after ``fc_norm``, and the ``fc`` output that depth 1 reads). Conditions: ``clean`` (the prompt as is),
``system`` (the prompt under varied system prompts) and ``long`` (unrelated news text before the question).
See docs/drift.md.
"""

from __future__ import annotations

import copy
import json
import logging
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..devices import input_device
from ..drafter.capture import gather_aux, hidden_state_request
from ..drafter.modeling import EagleDrafter
from ..files import save_figure, write_file
from ..hf.call import check_compatible, prepare_drafter
from ..hf.version import cache_kwarg
from ..speculation.drafting import DraftState, draft_tree
from .evaluation import PROMPT_DIR, PROMPT_SETS, load_prompt_set

logger = logging.getLogger(__name__)

CONDITIONS = ("clean", "system", "long")
SYSTEM_MODES = ("cycle", "all")
MAX_DEPTH = 16

#: System prompts of the ``system`` condition, in the order ``cycle`` hands them out (prompt i gets entry i mod 6).
SYSTEM_PROMPTS: dict[str, str] = {
    "terse": "Answer in as few words as possible. No explanations.",
    "persona": (
        "You are Captain Nova, a cheerful starship engineer. Stay in character and explain everything with "
        "metaphors from life aboard your ship."
    ),
    "json": (
        'You are an API. Reply only with one JSON object of the form {"answer": string, "confidence": number '
        "between 0 and 1}. Never write text outside the JSON object."
    ),
    "french": "Tu es un assistant utile. Réponds toujours en français, de façon claire et précise.",
    "long_instructions": (
        "You are a careful assistant working for a documentation team. Follow these rules in every answer. "
        "1. Start with a one-sentence summary of your answer. 2. Then give the details as a numbered list, one idea "
        "per item. 3. Prefer plain words to jargon; when you must use a technical term, define it the first time. "
        "4. Never invent facts, names, numbers or quotations; say plainly when you are not sure. 5. Keep every "
        "sentence under twenty-five words. 6. Use British spelling. 7. Do not use emojis, exclamation marks or "
        "rhetorical questions. 8. When the user asks for code, give complete, runnable code with comments, and "
        "explain how to run it. 9. When the question is ambiguous, state the reading you chose before answering. "
        "10. End with one line that starts with 'In short:' and restates the answer."
    ),
    "empty": "",
}

#: Per-depth quantities: JSON key -> (plot title, y-axis label).
DEPTH_QUANTITIES: dict[str, tuple[str, str]] = {
    "acceptance": ("Conditional acceptance", "P(draft accepted | depth reached)"),
    "reach": ("Rounds reaching the depth", "fraction of rounds"),
    "attention_sink": ("Attention on the sink", "attention mass on the first tokens"),
    "attention_context": ("Attention on the verified context", "attention mass (sink excluded)"),
    "attention_drafts": ("Attention on its own drafts", "attention mass on this round's drafts"),
    "fed_back_norm": ("Norm of the fed-back hidden state", "mean L2 norm"),
    "residual_norm": ("Norm of the layer's pre-norm output", "mean L2 norm"),
}


class DiagnoseError(ValueError):
    """Bad settings or inputs for the drift diagnostic (raised before any model compute)."""


@dataclass
class DiagnoseSettings:
    """What `diagnose` measures. Check with :meth:`validate` (done by `diagnose` before any compute)."""

    prompts: str | list[str] = "mt_bench"  # a shipped set (mt_bench, humaneval, gsm8k, sum, qa), a JSONL path, or texts
    limit: int | None = 8  # prompts taken from the set (None: all)
    conditions: tuple[str, ...] = CONDITIONS
    depth: int = 5  # chain length drafted every round
    max_new_tokens: int = 64  # the target's greedy continuation per prompt and condition
    sink_tokens: int = 4  # the first positions counted as the attention sink
    long_context_tokens: int = 2048  # unrelated text before the question in the `long` condition
    system_mode: str = "cycle"  # "cycle": one system prompt per prompt in turn; "all": every prompt under all six

    def validate(self) -> DiagnoseSettings:
        if isinstance(self.conditions, str):
            self.conditions = tuple(c.strip() for c in self.conditions.split(",") if c.strip())
        self.conditions = tuple(self.conditions)
        unknown = [c for c in self.conditions if c not in CONDITIONS]
        if unknown or not self.conditions:
            raise DiagnoseError(
                f"Unknown condition(s) {unknown or '(none given)'}: the valid conditions are {', '.join(CONDITIONS)} "
                "(pass a comma-separated subset)."
            )
        if len(set(self.conditions)) != len(self.conditions):
            raise DiagnoseError(f"Condition listed twice in {list(self.conditions)}: name each once.")
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or not 1 <= self.depth <= MAX_DEPTH:
            raise DiagnoseError(
                f"depth must be an integer from 1 to {MAX_DEPTH} (the chain length drafted per round), got {self.depth!r}."
            )
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= self.depth:
            raise DiagnoseError(
                f"max_new_tokens={self.max_new_tokens!r} leaves no round to verify a chain of {self.depth}: "
                f"use at least {self.depth + 1} (64 or more for useful sample sizes)."
            )
        if not isinstance(self.sink_tokens, int) or self.sink_tokens < 1:
            raise DiagnoseError(f"sink_tokens must be a positive integer (e.g. 4), got {self.sink_tokens!r}.")
        if "long" in self.conditions and (not isinstance(self.long_context_tokens, int) or self.long_context_tokens < 1):
            raise DiagnoseError(
                f"long_context_tokens must be a positive integer (2048 or more for the `long` condition), got "
                f"{self.long_context_tokens!r}."
            )
        if self.system_mode not in SYSTEM_MODES:
            raise DiagnoseError(f"system_mode must be one of {', '.join(SYSTEM_MODES)}, got {self.system_mode!r}.")
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            raise DiagnoseError(f"limit must be a positive number of prompts (or None for all), got {self.limit!r}.")
        if isinstance(self.prompts, str) and self.prompts not in PROMPT_SETS and not Path(self.prompts).is_file():
            raise DiagnoseError(
                f"No prompt set {self.prompts!r}: use one of {', '.join(PROMPT_SETS)}, a JSONL file path or a list of texts."
            )
        return self


# ---------------------------------------------------------------------------------------------------- results
@dataclass
class ConditionDrift:
    """Everything measured under one condition; per-depth lists have one entry per depth 1..depth."""

    runs: int = 0
    rounds: int = 0
    context_tokens: list[int] = field(default_factory=list)  # prompt length of each run
    generated_tokens: int = 0
    reached: list[int] = field(default_factory=list)  # rounds whose drafts 1..k-1 were all accepted
    accepted: list[int] = field(default_factory=list)  # of those, rounds whose draft k was accepted too
    sums: dict[str, list[float]] = field(default_factory=dict)  # per-depth sums over rounds (attention, norms)
    tap_sums: list[float] = field(default_factory=list)  # ‖captured state i‖, before fc_norm, summed over rounds
    tap_normed_sums: list[float] | None = None  # after fc_norm (None: the drafter has no fc_norm)
    fc_sum: float = 0.0  # ‖fc(fused)‖ of the last verified row

    def per_depth(self, name: str) -> list[float | None]:
        if name == "acceptance":
            return [a / r if r else None for a, r in zip(self.accepted, self.reached)]
        if name == "reach":
            return [r / self.rounds if self.rounds else None for r in self.reached]
        return [s / self.rounds if self.rounds else None for s in self.sums[name]]

    @property
    def tau(self) -> float | None:
        """Mean acceptance length: accepted drafts per round plus the target's own token."""
        return 1 + sum(self.accepted) / self.rounds if self.rounds else None

    def fused_inputs(self) -> dict[str, list[float] | float | None]:
        n = self.rounds or 1
        return {
            "tap_norm": [s / n for s in self.tap_sums] if self.rounds else None,
            "tap_norm_after_fc_norm": [s / n for s in self.tap_normed_sums]
            if self.rounds and self.tap_normed_sums is not None else None,
            "fc_norm_output": self.fc_sum / n if self.rounds else None,
        }

    def to_dict(self) -> dict:
        return {
            "runs": self.runs,
            "rounds": self.rounds,
            "mean_context_tokens": sum(self.context_tokens) / len(self.context_tokens) if self.context_tokens else None,
            "generated_tokens": self.generated_tokens,
            "tau": self.tau,
            "rounds_reaching": self.reached,
            "accepted": self.accepted,
            **{name: self.per_depth(name) for name in DEPTH_QUANTITIES},
            "fused_inputs": self.fused_inputs(),
        }


@dataclass
class DriftReport:
    """The diagnostic's result: per condition, per depth. `save` writes drift.json, drift.md and the PNGs."""

    settings: dict
    meta: dict
    conditions: dict[str, ConditionDrift]
    runs: list[dict]

    def to_dict(self) -> dict:
        return {
            "settings": self.settings,
            "meta": self.meta,
            "conditions": {name: c.to_dict() for name, c in self.conditions.items()},
            "runs": self.runs,
        }

    def markdown(self) -> str:
        return drift_markdown(self.to_dict())

    def save(self, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        data = self.to_dict()
        write_file(out / "drift.json", json.dumps(data, indent=2, ensure_ascii=False))
        write_file(out / "drift.md", drift_markdown(data))
        plot_drift(data, out)
        logger.info("Drift diagnostic written to %s", out)
        return out


def _fmt(x, digits: int) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def drift_markdown(data: dict) -> str:
    """The two result tables (per condition, per condition and depth) from `DriftReport.to_dict()` / drift.json."""
    s, m, conds = data["settings"], data["meta"], data["conditions"]
    ids = m["aux_layer_ids"]
    lines = [
        (f"Drift diagnostic: {m['drafter']} on {m['target']}; {m['prompts']} prompts "
         f"({s['prompts'] if isinstance(s['prompts'], str) else 'given texts'}), greedy, chain of {s['depth']}, "
         f"up to {s['max_new_tokens']} new tokens per run, sink = first {s['sink_tokens']} positions, "
         f"system prompts: {s['system_mode']}. Wall time {m['wall_s']:.0f} s."),
        "",
        ("| condition | runs | rounds | mean context tokens | τ | "
         + " | ".join(f"‖layer {i}‖ raw → fc_norm" for i in ids) + " | ‖fc out‖ |"),
        "|---|---|---|---|---|" + "---|" * (len(ids) + 1),
    ]
    for name, c in conds.items():
        f = c["fused_inputs"]
        taps = []
        for j in range(len(ids)):
            raw = _fmt(f["tap_norm"][j] if f["tap_norm"] else None, 1)
            after = f["tap_norm_after_fc_norm"]
            taps.append(raw if after is None else f"{raw} → {_fmt(after[j], 1)}")
        lines.append(
            f"| {name} | {c['runs']} | {c['rounds']} | {_fmt(c['mean_context_tokens'], 0)} | {_fmt(c['tau'], 2)} | "
            + " | ".join(taps) + f" | {_fmt(f['fc_norm_output'], 1)} |"
        )
    lines += [
        "",
        ("| condition | depth | rounds reaching | reach | P(accept \\| reached) | attn sink | attn context | "
         "attn drafts | ‖fed back‖ | ‖pre-norm out‖ |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c in conds.items():
        for k in range(s["depth"]):
            lines.append(
                f"| {name} | {k + 1} | {c['rounds_reaching'][k]} | {_fmt(c['reach'][k], 3)} | "
                f"{_fmt(c['acceptance'][k], 3)} | {_fmt(c['attention_sink'][k], 3)} | "
                f"{_fmt(c['attention_context'][k], 3)} | {_fmt(c['attention_drafts'][k], 3)} | "
                f"{_fmt(c['fed_back_norm'][k], 1)} | {_fmt(c['residual_norm'][k], 1)} |"
            )
    return "\n".join(lines) + "\n"


def plot_drift(data: dict, out_dir: str | Path) -> list[Path]:
    """From `DriftReport.to_dict()` / drift.json: one PNG per per-depth quantity (one line per condition) and
    ``fused_inputs.png`` (bars per condition)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, paths = Path(out_dir), []
    conds, ids = data["conditions"], data["meta"]["aux_layer_ids"]
    depths = list(range(1, data["settings"]["depth"] + 1))
    subtitle = f"{data['meta']['drafter']}, {data['meta']['prompts']} prompts, chain of {len(depths)}"
    for name, (title, ylabel) in DEPTH_QUANTITIES.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for cond, c in conds.items():
            ax.plot(depths, [float("nan") if v is None else v for v in c[name]], marker="o",
                    label=f"{cond} ({c['rounds']} rounds)")
        ax.set_xlabel("draft depth")
        ax.set_ylabel(ylabel)
        ax.set_xticks(depths)
        ax.set_title(f"{title}\n{subtitle}", fontsize=10)
        if name in ("acceptance", "reach"):
            ax.set_ylim(0, 1.02)
        elif name.startswith("attention"):
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / f"{name}.png")
        try:
            save_figure(fig, paths[-1], dpi=100)
        finally:
            plt.close(fig)
    # the fused inputs: one group per condition, bars per captured state (raw, after fc_norm) and the fc output
    fig, ax = plt.subplots(figsize=(8, 4))
    bars = [(f"layer {i} raw", "tap_norm", j) for j, i in enumerate(ids)]
    bars += [(f"layer {i} after fc_norm", "tap_norm_after_fc_norm", j) for j, i in enumerate(ids)]
    bars += [("fc output", "fc_norm_output", None)]
    width = 0.8 / len(bars)
    for b, (label, key, j) in enumerate(bars):
        heights = []
        for c in conds.values():
            v = c["fused_inputs"][key]
            v = v[j] if j is not None and v is not None else v
            heights.append(float("nan") if v is None else v)
        ax.bar([i + b * width for i in range(len(conds))], heights, width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(conds))], list(conds))
    ax.set_ylabel("mean L2 norm (last verified row)")
    ax.set_yscale("log")
    ax.set_title(f"Fused input parts\n{subtitle}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    paths.append(out / "fused_inputs.png")
    try:
        save_figure(fig, paths[-1], dpi=100)
    finally:
        plt.close(fig)
    return paths


# ---------------------------------------------------------------------------------------------------- inputs
@dataclass
class Run:
    """One prompt under one condition."""

    prompt_id: str
    condition: str
    variant: str  # the system prompt's name, "long" or "clean"
    input_ids: torch.Tensor  # [1, P]
    shared: int = 0  # leading tokens every run of this condition shares (prefilled once: the long news text)


@dataclass
class PrefixStore:
    """The target's cache and taps over a prompt prefix several runs share, prefilled once."""

    ids: torch.Tensor | None = None  # [1, n]
    cache: object = None
    taps: torch.Tensor | None = None  # [1, n, A*H_t]


MIN_SHARED_PREFIX = 64  # shorter shared prefixes are not worth a cache copy


def unrelated_text(tokenizer, n_tokens: int, index: int = 0, avoid: str = "") -> str:
    """About `n_tokens` tokens of CNN/DailyMail news (the shipped ``sum`` set), starting at article `index`."""
    path = PROMPT_DIR / "sum.jsonl"
    articles = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            text = json.loads(line)["turns"][0]
            articles.append(text.removeprefix("Summarize: ").strip())
    ids: list[int] = []
    for j in range(len(articles)):
        article = articles[(index + j) % len(articles)]
        if article[:200] in avoid:  # never the question's own article
            continue
        ids += tokenizer(article + "\n\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= n_tokens:
            break
    return tokenizer.decode(ids[:n_tokens]).strip()


def build_runs(tokenizer, prompts: list[tuple[str, str]], settings: DiagnoseSettings) -> list[Run]:
    """Tokenised inputs of every (prompt, condition) run, prompts outermost."""
    if not getattr(tokenizer, "chat_template", None):
        raise DiagnoseError(
            "The tokenizer has no chat template: the conditions (system prompts) are chat messages. Use an "
            "instruct model's tokenizer or set `tokenizer.chat_template`."
        )
    names = list(SYSTEM_PROMPTS)
    runs = []
    for i, (pid, text) in enumerate(prompts):
        for cond in settings.conditions:
            if cond == "clean":
                variants = [("clean", [{"role": "user", "content": text}])]
            elif cond == "long":
                context = unrelated_text(tokenizer, settings.long_context_tokens, avoid=text)  # the same for all
                variants = [("long", [{"role": "user", "content": f"{context}\n\n{text}"}])]
            else:
                chosen = names if settings.system_mode == "all" else [names[i % len(names)]]
                variants = [(n, [{"role": "system", "content": SYSTEM_PROMPTS[n]}, {"role": "user", "content": text}])
                            for n in chosen]
            for variant, messages in variants:
                enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                    return_dict=True)
                runs.append(Run(pid, cond, variant, enc["input_ids"]))
    for cond in settings.conditions:  # the shared prefix of each condition's runs (long: the chat head + news text)
        same = [r for r in runs if r.condition == cond]
        n = min(r.input_ids.shape[1] for r in same) - 1  # at least one token of each run is its own
        for r in same[1:]:
            equal = (r.input_ids[0, :n] == same[0].input_ids[0, :n]).long()  # [n]
            n = int(equal.cumprod(0).sum())
        if len(same) > 1 and n >= MIN_SHARED_PREFIX:
            for r in same:
                r.shared = n
    return runs


# ---------------------------------------------------------------------------------------------------- compute
@torch.no_grad()
def greedy_path(target, input_ids: torch.Tensor, aux_ids: list[int], max_new_tokens: int, eos_ids: set[int],
                shared: int = 0, store: PrefixStore | None = None):
    """The target's greedy continuation and its taps: tokens ``[1, P + n]``, aux ``[1, P + n - 1, A*H_t]``.

    With `store`, the first `shared` prompt tokens are prefilled once and their cache copied for later runs.
    """
    from transformers import DynamicCache

    request = hidden_state_request(aux_ids)
    input_ids = input_ids.to(input_device(target))  # [1, P]
    tokens, taps, step = [input_ids], [], input_ids
    cache = DynamicCache(config=target.config)
    if shared and store is not None:
        prefix = input_ids[:, :shared]  # [1, shared]
        if store.ids is None or not torch.equal(store.ids, prefix):
            out = target(input_ids=prefix, **cache_kwarg(cache), use_cache=True, output_hidden_states=request,
                         logits_to_keep=1)
            store.ids, store.cache, store.taps = prefix, cache, gather_aux(out.hidden_states, aux_ids)
        cache = copy.deepcopy(store.cache)
        taps.append(store.taps)
        step = input_ids[:, shared:]  # [1, P - shared]
    for i in range(max_new_tokens):
        out = target(input_ids=step, **cache_kwarg(cache), use_cache=True, output_hidden_states=request,
                     logits_to_keep=1)
        taps.append(gather_aux(out.hidden_states, aux_ids))  # [1, t, A*H_t]
        step = out.logits[:, -1].argmax(-1, keepdim=True).to(input_ids.device)  # [1, 1] (the head may sit elsewhere)
        tokens.append(step)
        if int(step) in eos_ids:
            break
    return torch.cat(tokens, 1), torch.cat(taps, 1)


@torch.no_grad()
def replay_rounds(drafter: EagleDrafter, tokens: torch.Tensor, aux: torch.Tensor, prompt_len: int,
                  acc: ConditionDrift, depth: int, sink_tokens: int) -> int:
    """Greedy chain rounds along the target's path; adds each round's measurements to `acc`. Returns the rounds.

    tokens: [1, L] (prompt + the target's continuation); aux: [1, L-1, A*H_t] (row t pairs with token t+1).
    """
    w = drafter.fc.weight
    aux = aux.to(w.device, w.dtype)
    tokens = tokens.to(w.device)
    state, p, rows_done, rounds = DraftState.for_drafter(drafter), prompt_len, 0, 0  # p: index of the newest verified token
    residuals: list[torch.Tensor] = []
    hook = drafter.midlayer.register_forward_hook(lambda mod, args, out: residuals.append(out[0][:, -1]))
    try:
        while p + depth < tokens.shape[1]:  # the target's tokens p+1..p+depth exist to check the chain against
            if p - 1 > rows_done:  # rows the drafter has not read yet, all but the last (nothing recorded)
                state.extend(drafter, aux[:, rows_done:p - 1], tokens[:, rows_done + 1:p])
            residuals.clear()
            with drafter.recording_attention() as probs:
                logits, hidden = state.extend(drafter, aux[:, p - 1:p], tokens[:, p:p + 1])  # depth 1 drafts from here
                chain = draft_tree(drafter, state, int(tokens[0, p]), logits, hidden, depth=depth, top_k=1,
                                   total_tokens=depth + 1)
            rows_done, real = p, state.length  # real rows: positions 0..p-1
            drafts = chain.tokens[1:].to(tokens.device)  # [depth], depth order
            truth = tokens[0, p + 1:p + 1 + depth]  # [depth]
            a = int((drafts == truth).long().cumprod(0).sum())
            _add_round(drafter, acc, probs, residuals, aux[:, p - 1], real, a, depth, sink_tokens)
            rounds += 1
            p += a + 1
    finally:
        hook.remove()
    return rounds


def _add_round(drafter, acc: ConditionDrift, probs, residuals, last_aux, real: int, a: int, depth: int, sink: int):
    """One round's measurements. probs: per pass [1, h, T, S]; residuals: per pass [1, H]; last_aux: [1, A*H_t]."""
    if len(probs) != depth or len(residuals) != depth:
        raise RuntimeError(f"Expected {depth} drafter passes in a chain round, recorded {len(probs)}.")
    acc.rounds += 1
    for k in range(depth):  # depth k+1: draft k+1 read the pass k output
        if k <= a:
            acc.reached[k] += 1
        if k < a:
            acc.accepted[k] += 1
        mass = probs[k][0, :, -1].mean(0)  # [S] = real rows + the k draft rows fed so far
        if mass.shape[0] != real + k:
            raise RuntimeError(f"Depth {k + 1} attends {mass.shape[0]} keys, expected {real + k}.")
        acc.sums["attention_sink"][k] += float(mass[:sink].sum())
        acc.sums["attention_context"][k] += float(mass[sink:real].sum())
        acc.sums["attention_drafts"][k] += float(mass[real:].sum())
        pre = residuals[k]  # [1, H] the layer's pre-norm output at this depth
        fed = drafter.norm(pre) if drafter.config.norm_output else pre  # as DraftStep.hidden
        acc.sums["residual_norm"][k] += float(pre.float().norm())
        acc.sums["fed_back_norm"][k] += float(fed.float().norm())
    chunks = last_aux.chunk(drafter.config.num_aux_hidden_states, dim=-1)  # A x [1, H_t]
    for i, c in enumerate(chunks):
        acc.tap_sums[i] += float(c.float().norm())
        if acc.tap_normed_sums is not None:
            acc.tap_normed_sums[i] += float(drafter.fc_norm[i](c).float().norm())
    acc.fc_sum += float(drafter.fuse(last_aux).float().norm())


def _new_condition(drafter: EagleDrafter, depth: int) -> ConditionDrift:
    n = drafter.config.num_aux_hidden_states
    return ConditionDrift(
        reached=[0] * depth, accepted=[0] * depth,
        sums={k: [0.0] * depth for k in DEPTH_QUANTITIES if k not in ("acceptance", "reach")},
        tap_sums=[0.0] * n, tap_normed_sums=[0.0] * n if drafter.fc_norm is not None else None,
    )


def diagnose(target, tokenizer, drafter: EagleDrafter, settings: DiagnoseSettings | None = None, *,
             progress: bool = True, drafter_label: str | None = None, **overrides) -> DriftReport:
    """Run the drift diagnostic (greedy, batch 1). `overrides` set `DiagnoseSettings` fields by name.

    Everything is checked before any model compute: the settings, the drafter against the target, the chat
    template and every run's length against the target's context window.
    """
    label = drafter_label or drafter.config.name_or_path or "drafter"
    return diagnose_drafters(target, tokenizer, {label: drafter}, settings, progress=progress, **overrides)[label]


def diagnose_drafters(target, tokenizer, drafters: dict[str, EagleDrafter], settings: DiagnoseSettings | None = None,
                      *, progress: bool = True, **overrides) -> dict[str, DriftReport]:
    """`diagnose` for several drafters of one target (label -> drafter), replayed over the same target paths:
    the target decodes each run once, so the drafters are compared on identical rounds' contexts (a paired
    comparison: `compare_markdown`, `plot_comparison`)."""
    settings = DiagnoseSettings(**{**(asdict(settings) if settings else {}), **overrides}).validate()
    if not drafters:
        raise DiagnoseError("No drafter given: pass at least one (label -> EagleDrafter).")
    aux_ids = None
    for label, drafter in drafters.items():
        ids = check_compatible(target, drafter)
        if aux_ids is not None and ids != aux_ids:
            raise DiagnoseError(
                f"Drafter {label!r} reads target layers {ids}, the first one {aux_ids}: drafters compared over the "
                "same target paths must read the same layers. Diagnose them one at a time instead."
            )
        aux_ids = ids
    prompts = ([(str(i), t) for i, t in enumerate(settings.prompts)] if isinstance(settings.prompts, list)
               else load_prompt_set(settings.prompts))
    prompts = prompts[: settings.limit] if settings.limit else prompts
    if not prompts:
        raise DiagnoseError(f"The prompt set {settings.prompts!r} holds no prompts.")
    runs = build_runs(tokenizer, prompts, settings)
    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    window = getattr(text, "max_position_embeddings", None)
    longest = max(r.input_ids.shape[1] for r in runs)
    if window and longest + settings.max_new_tokens > window:
        raise DiagnoseError(
            f"The longest run has {longest} prompt tokens; with max_new_tokens={settings.max_new_tokens} it exceeds "
            f"the target's context window of {window}. Lower long_context_tokens or max_new_tokens."
        )
    drafters = {label: prepare_drafter(target, d) for label, d in drafters.items()}  # (in the target's dtype)
    eos = target.generation_config.eos_token_id
    eos_ids = set([eos] if isinstance(eos, int) else list(eos or []))
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    results = {label: {c: _new_condition(d, settings.depth) for c in settings.conditions} for label, d in drafters.items()}
    records: dict[str, list[dict]] = {label: [] for label in drafters}
    stores = {c: PrefixStore() for c in settings.conditions}
    start = time.perf_counter()
    for run in tqdm(runs, desc="diagnose (prompts x conditions)", disable=not progress):
        tokens, aux = greedy_path(target, run.input_ids, aux_ids, settings.max_new_tokens, eos_ids, run.shared,
                                  stores[run.condition])
        generated = tokens.shape[1] - run.input_ids.shape[1]
        for label, drafter in drafters.items():
            acc = results[label][run.condition]
            accepted_before = sum(acc.accepted)
            n = replay_rounds(drafter, tokens, aux, run.input_ids.shape[1], acc, settings.depth, settings.sink_tokens)
            acc.runs += 1
            acc.context_tokens.append(run.input_ids.shape[1])
            acc.generated_tokens += generated
            records[label].append({"prompt_id": run.prompt_id, "condition": run.condition, "variant": run.variant,
                                   "context_tokens": run.input_ids.shape[1], "generated_tokens": generated,
                                   "rounds": n, "accepted": sum(acc.accepted) - accepted_before})
            logger.info("%s: %s / %s (%s): %d context tokens, %d generated, %d rounds", label, run.prompt_id,
                        run.condition, run.variant, run.input_ids.shape[1], generated, n)
    wall = time.perf_counter() - start
    reports = {}
    for label, drafter in drafters.items():
        meta = {
            "target": getattr(target, "name_or_path", None) or "target",
            "drafter": label,
            "eagle31": {"fc_norm": bool(drafter.config.fc_norm), "norm_output": bool(drafter.config.norm_output)},
            "aux_layer_ids": aux_ids,
            "prompts": len(prompts),
            "prompt_ids": [pid for pid, _ in prompts],
            "system_prompts": SYSTEM_PROMPTS if "system" in settings.conditions else None,
            "dtype": str(target.dtype),
            "wall_s": wall,
            "drafters_in_run": list(drafters),
            "machine": {"torch": torch.__version__, "platform": platform.platform(),
                        "threads": torch.get_num_threads()},
        }
        reports[label] = DriftReport(settings=asdict(settings), meta=meta, conditions=results[label],
                                     runs=records[label])
    return reports
