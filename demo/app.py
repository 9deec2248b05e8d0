"""Gradio demo: watch EAGLE speculative decoding accept and reject draft tokens, live.

    python demo/app.py                      # embedded default: SmolLM2-135M-Instruct + the shipped drafter
    python demo/app.py --target <hub id> --drafter <hub id or folder> [--drafter-eagle3 <...>]
    python demo/app.py --target <hub id> --drafter <...> --device cuda [--dtype auto] [--attn-implementation sdpa]

Environment variables EAGLE_HF_TARGET, EAGLE_HF_DRAFTER, EAGLE_HF_DRAFTER_EAGLE3 do the same as the flags.
"""

from __future__ import annotations

import argparse
import collections
import logging
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import gradio as gr
import pandas as pd
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import eagle_hf
from eagle_hf.devices import add_device_arguments, check_load_options, input_device, load_options
from eagle_hf.errors import EagleCompatibilityError
from eagle_hf.hf.call import active_call
from eagle_hf.speculation.settings import DRAFT_SOURCES, MAX_DEPTH
from eagle_hf.speculation.stats import SpecDecodeStats
from eagle_hf.tools.evaluation import load_prompt_set
from eagle_hf.tools.visualize import CSS, SpanRenderer, TokenEvent, label_round, legend_html, tokens_html

logger = logging.getLogger("eagle_hf.demo")

#: seconds between two redraws of the acceptance chart while tokens stream (the text and the numbers follow every token)
CHART_EVERY = 0.5


@dataclass
class Run:
    """One generate() call as it streams: the labelled tokens, the statistics so far and the timing."""

    tokenizer: object = None
    events: list[TokenEvent] = field(default_factory=list)
    new_ids: list[int] = field(default_factory=list)
    stats: SpecDecodeStats | None = None  # a snapshot after the latest round; the call's own at the end
    error: str | None = None
    start: float = 0.0  # generate() called
    first: float | None = None  # the first new token (the prefill's) arrived
    last: float | None = None  # the latest new token arrived
    done: bool = False

    def __post_init__(self):
        self.renderer = SpanRenderer(self.tokenizer)  # each event rendered once, as it arrives

    def add(self, events: list[TokenEvent]) -> None:
        self.events.extend(events)
        self.renderer.add(events)

    def html(self) -> str:
        return tokens_html(self.events, self.tokenizer, spans=self.renderer.spans)

    @property
    def prefill_seconds(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def decode_seconds(self) -> float:
        return (self.last - self.first) if self.first is not None and self.last is not None else 0.0

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Tokens after the prefill's one, per second since it arrived (None until there are two)."""
        n, s = len(self.new_ids) - 1, self.decode_seconds
        return n / s if n > 0 and s > 0 else None


class _Stop(StoppingCriteria):
    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class _Streamer:
    """Receives the chunks generate() emits (the prompt first) and forwards new tokens, with their arrival time."""

    def __init__(self, q: queue.Queue):
        self.q, self.prompt_seen = q, False

    def put(self, ids):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.q.put(("chunk", ids.reshape(-1).tolist(), time.perf_counter()))

    def end(self):
        self.q.put(("end", None, None))


def _stats_so_far() -> SpecDecodeStats | None:
    """The running call's counts so far, copied (called by a draft listener, in generate()'s own thread): what
    the live numbers and the chart show; the per-cycle records are left out (copying them every round would
    grow with the output)."""
    call = active_call()
    if call is None:
        return None
    s = call.stats
    return SpecDecodeStats(cycles=s.cycles, drafted=s.drafted, accepted=s.accepted,
                           drafted_per_position=list(s.drafted_per_position),
                           accepted_per_position=list(s.accepted_per_position),
                           fallback_steps=s.fallback_steps, final_steps=s.final_steps,
                           drafted_by_source=dict(s.drafted_by_source), accepted_by_source=dict(s.accepted_by_source))


def labelled_stream(target, tokenizer, drafter, enc, gen_kwargs, stop: threading.Event):
    """Run generate() in a thread; yield the `Run` (the same object, updated) as chunks arrive, then once done.

    Each round transformers streams a chunk (accepted drafts + the target's token) and then our listener
    reports the drafts of that round, who proposed each (drafter, copy or both) and the statistics so far, so a
    chunk is labelled once the next event tells whether it was a cycle.
    """
    q: queue.Queue = queue.Queue()
    run = Run(tokenizer=tokenizer)
    result: dict = {}

    def listener(drafts, accepted, last_token, sources=None):
        q.put(("cycle", (drafts, accepted, sources), _stats_so_far()))

    def work():
        try:
            target.generate(
                **enc, **gen_kwargs, streamer=_Streamer(q), stopping_criteria=StoppingCriteriaList([_Stop(stop)]),
                **({"assistant_model": drafter, "draft_listeners": [listener]} if drafter is not None else {}),
            )
            result["stats"] = eagle_hf.last_stats() if drafter is not None else None
        except Exception as err:  # noqa: BLE001  (shown to the user, never crashes the app)
            logger.warning("generate() failed: %s: %s", type(err).__name__, err)
            result["error"] = f"{type(err).__name__}: {err}"
            q.put(("end", None, None))

    thread = threading.Thread(target=work, daemon=True)
    run.start = time.perf_counter()
    thread.start()
    pending: list[int] | None = None

    def flush(chunk, cycle):
        drafts, accepted, sources = cycle if cycle is not None else (None, 0, None)
        run.add(label_round(chunk, drafts, accepted, sources))
        run.new_ids.extend(chunk)

    while True:
        kind, payload, extra = q.get()
        if kind == "chunk":
            if pending is not None:
                flush(pending, None)
            pending = payload
            run.first = extra if run.first is None else run.first
            run.last = extra
        elif kind == "cycle":
            if pending is not None:
                flush(pending, payload)
                pending = None
            run.stats = extra if extra is not None else run.stats
        else:
            if pending is not None:
                flush(pending, None)
            break
        yield run
    thread.join()
    run.renderer.finish()
    run.stats = result.get("stats", run.stats)
    run.error = result.get("error")
    run.done = True
    yield run


def stats_markdown(run: Run, plain: Run | None = None, stopped: bool = False, drafting: str = "") -> str:
    """The numbers beside the output: decode speed (the prefill apart), acceptance, the drafting that produced
    them and the state of the run."""
    n = len(run.new_ids)
    if run.first is None:
        lines = ["prefill… (reading the prompt)"]
    else:
        tps = run.decode_tokens_per_second
        speed = f"**{tps:.1f} tokens/s** decoding" if tps is not None else "**– tokens/s** decoding"
        total = run.prefill_seconds + run.decode_seconds
        lines = [f"{speed} ({n} tokens in {total:.1f} s: prefill {run.prefill_seconds:.2f} s, then {run.decode_seconds:.1f} s)"]
    stats = run.stats
    if stats is not None and stats.steps:
        lines.append(
            f"mean acceptance length **{stats.mean_acceptance_length:.2f}** (tokens per draft-and-verify cycle, "
            f"bonus counted) · {stats.cycles} cycles · plain decoding in {stats.fallback_ratio:.0%} of steps"
        )
    if stats is not None and stats.drafted_by_source:
        lines.append(source_line(stats))
    if drafting:
        lines.append(f"drafting: {drafting}")
    if plain is not None and plain.done and not stopped:
        mine, theirs = run.decode_tokens_per_second, plain.decode_tokens_per_second
        if mine and theirs:
            lines.append(f"plain `generate()`: {theirs:.1f} tokens/s decoding → **speedup {mine / theirs:.2f}x**")
    if stopped:
        lines.append(f"**stopped** after {n} tokens: the statistics cover the tokens so far.")
    elif not run.done or (plain is not None and not plain.done):
        lines.append("*generating…*")
    return "  \n".join(lines)


#: the statistics' names of the draft sources
SOURCE_LABELS = {"eagle": "drafter", "copy": "copy"}


def source_line(stats) -> str:
    """Accepted / drafted tokens per source; a token both proposed counts for each."""
    parts = []
    for name in ("eagle", "copy"):
        drafted = stats.drafted_by_source.get(name, 0)
        if drafted:
            accepted = stats.accepted_by_source.get(name, 0)
            parts.append(f"{SOURCE_LABELS[name]} **{accepted}/{drafted}** ({accepted / drafted:.0%})")
    return "accepted/drafted by source: " + " · ".join(parts)


#: the demo's draft-source choices (eagle_hf's `draft_sources`)
SOURCE_CHOICES = list(DRAFT_SOURCES)


def sources_text(draft_sources: str, draft_mode: str) -> str:
    """What a `draft_sources` choice means in this drafting mode (auto: both in a tree, the drafter in a chain)."""
    if draft_sources == "auto":
        return "auto (drafter alone)" if draft_mode == "fixed chain" else "auto (drafter + copies)"
    return {"eagle": "drafter alone", "copy": "copies alone", "eagle+copy": "drafter + copies"}[draft_sources]


#: the chart's x categories in order ("#10" after "#9", not after "#1")
POSITIONS = [f"#{i + 1}" for i in range(MAX_DEPTH)]


def acceptance_frame(stats) -> pd.DataFrame:
    acc = stats.acceptance_per_position if stats is not None else []
    # "#1", "#2", ...: categorical positions (digit strings would be read as numbers: a numeric axis, hairline
    # bars), typed as strings even when empty (an empty column is float: the chart would start out numeric)
    return pd.DataFrame({"draft position": pd.Series([f"#{i + 1}" for i in range(len(acc))], dtype="string"),
                         "acceptance": pd.Series(acc, dtype="float64")})


class StopFlags:
    """The stop flags of each browser session. Send (or Enter) arms a flag at once, outside the queue; the run
    claims the oldest armed flag when it starts and checks it at every step; Stop sets every flag of the session.
    A run stopped this way ends like a finished one (its statistics so far, a "stopped" note); a run still
    waiting in the queue ends as soon as it starts."""

    def __init__(self):
        self._lock = threading.Lock()
        self._armed: dict = {}  # session -> flags armed, not yet claimed (in queue order)
        self._live: dict = {}  # session -> flags armed or running

    def arm(self, key) -> threading.Event:
        flag = threading.Event()
        with self._lock:
            self._armed.setdefault(key, collections.deque()).append(flag)
            self._live.setdefault(key, set()).add(flag)
        return flag

    def claim(self, key) -> threading.Event:
        """The flag of a run that starts now (a fresh one for a call that did not arm one: the API)."""
        with self._lock:
            armed = self._armed.get(key)
            if armed:
                return armed.popleft()
            flag = threading.Event()
            self._live.setdefault(key, set()).add(flag)
            return flag

    def stop(self, key) -> None:
        with self._lock:
            flags = list(self._live.get(key, ()))
        for flag in flags:
            flag.set()

    def release(self, key, flag: threading.Event) -> None:
        with self._lock:
            live = self._live.get(key)
            if live is not None:
                live.discard(flag)
                if not live:
                    self._live.pop(key, None)
                    self._armed.pop(key, None)


class BadRequest(ValueError):
    """A value outside what the controls allow (sent through the API)."""


def _choices(radio) -> list:
    return [c[1] if isinstance(c, (tuple, list)) else c for c in radio.choices]


def _number(value, label: str, slider, whole: bool):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"{label} must be a number from {slider.minimum:g} to {slider.maximum:g}; got {value!r}")
    if not slider.minimum <= value <= slider.maximum:
        raise BadRequest(f"{label} must be from {slider.minimum:g} to {slider.maximum:g}; got {value:g}")
    if whole and value != int(value):
        raise BadRequest(f"{label} must be a whole number; got {value:g}")
    return int(value) if whole else float(value)


def _text(prompt: str) -> str:
    """The prompt as text a tokenizer encodes: a JSON request can carry lone UTF-16 surrogates ("\\ud800"), which
    no UTF-8 tokenizer takes; each becomes U+FFFD, a pair of them (high then low) its one character."""
    return prompt.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def build_demo(target, tokenizer, drafters: dict, examples: list[str] | None = None, max_context: int | None = None):
    """The Blocks app (not launched). `drafters` maps a label (e.g. "EAGLE-3.1") to an EagleDrafter."""
    max_context = max_context or getattr(target.config.get_text_config(), "max_position_embeddings", 4096)
    names = list(drafters)
    flags = StopFlags()

    with gr.Blocks(title="eagle_hf: speculative decoding, live") as demo:
        gr.Markdown(
            "# EAGLE speculative decoding inside `model.generate()`\n"
            f"Target **{getattr(target, 'name_or_path', '') or type(target).__name__}**; the drafter proposes tokens from the target's own hidden "
            "states and the target verifies them in one forward pass. The output is exactly the target's."
        )
        gr.HTML(legend_html())
        with gr.Row():
            with gr.Column(scale=3):
                prompt = gr.Textbox(label="Prompt", lines=1, max_lines=8, elem_id="prompt",
                                    placeholder="Type a prompt; Enter sends it, Shift+Enter starts a new line")
                with gr.Row():
                    send = gr.Button("Send", variant="primary", elem_id="send")
                    stop_btn = gr.Button("Stop", elem_id="stop")
                eagle_out = gr.HTML(label="EAGLE output", elem_id="eagle-output")
                plain_out = gr.HTML(label="plain generate()", elem_id="plain-output")
            with gr.Column(scale=2):
                stats_md = gr.Markdown(label="statistics", elem_id="stats")
                chart = gr.BarPlot(acceptance_frame(None), x="draft position", y="acceptance", y_lim=[0, 1],
                                   x_title="draft position", y_title="acceptance", sort=POSITIONS,
                                   title="acceptance per draft position", label="acceptance per draft position",
                                   show_label=False, elem_id="chart")
                temperature = gr.Slider(0, 1.5, value=0, step=0.05, label="temperature (0 = greedy)")
                max_new = gr.Slider(8, 512, value=128, step=8, label="max new tokens", elem_id="max-new")
                mode = gr.Radio(["adaptive", "fixed chain", "tree"], value="adaptive", label="drafting", elem_id="mode")
                chain = gr.Slider(1, 8, value=5, step=1, label="chain length (fixed chain)", elem_id="chain")
                tree_size = gr.Slider(4, 64, value=16, step=4, label="tree size: verified tokens (tree)")
                sources = gr.Radio(SOURCE_CHOICES, value="auto", label="draft sources", elem_id="sources",
                                   info="eagle: the drafter; copy: spans of the prompt and output; auto: both in a "
                                        "tree, the drafter alone in a fixed chain")
                which = gr.Radio(names, value=names[0], label="drafter", visible=len(names) > 1)
                compare = gr.Checkbox(label="also run plain generate() and show the speedup", value=False)
        if examples:
            gr.Examples(examples=[[e] for e in examples], inputs=[prompt])

        def checked(prompt_, temperature_, max_new_tokens, draft_mode, chain_length, drafter_name, compare_, tree_size_,
                    draft_sources_):
            """The raw request values (the components' own checks are off: they print a traceback per bad call),
            checked against the controls' ranges and choices."""
            if prompt_ is not None and not isinstance(prompt_, str):
                raise BadRequest(f"prompt must be text; got {type(prompt_).__name__}")
            if draft_mode not in _choices(mode):
                raise BadRequest(f"draft_mode must be one of {_choices(mode)}; got {draft_mode!r}")
            if drafter_name not in drafters:
                raise BadRequest(f"drafter_name must be one of {names}; got {drafter_name!r}")
            if compare_ is not None and not isinstance(compare_, bool):
                raise BadRequest(f"compare must be true or false; got {compare_!r}")
            if draft_sources_ not in _choices(sources):
                raise BadRequest(f"draft_sources must be one of {_choices(sources)}; got {draft_sources_!r}")
            return (_text(prompt_ or ""), _number(temperature_, "temperature", temperature, False),
                    _number(max_new_tokens, "max_new_tokens", max_new, True), draft_mode,
                    _number(chain_length, "chain_length", chain, True), drafter_name, bool(compare_),
                    _number(tree_size_, "tree_size", tree_size, True), draft_sources_)

        def respond(prompt, temperature, max_new_tokens, draft_mode, chain_length, drafter_name, compare, tree_size=16,
                    draft_sources="auto", request: gr.Request = None):
            try:
                (prompt, temperature, max_new_tokens, draft_mode, chain_length, drafter_name, compare,
                 tree_size, draft_sources) = checked(prompt, temperature, max_new_tokens, draft_mode, chain_length,
                                                     drafter_name, compare, tree_size, draft_sources)
            except BadRequest as err:
                logger.warning("Rejected a request: %s", err)  # one line in the server log; the client gets the message
                raise gr.Error(str(err), print_exception=False) from None
            key = getattr(request, "session_hash", None) or object()
            stop = flags.claim(key)
            try:
                if stop.is_set():
                    yield "", "", "**stopped** before it started.", acceptance_frame(None)
                    return
                if not prompt.strip():
                    gr.Warning("Please type a prompt first.")
                    yield "", "", "Type a prompt and press Enter or Send.", acceptance_frame(None)
                    return
                try:
                    enc = tokenizer.apply_chat_template(
                        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt",
                        return_dict=True
                    )
                except Exception as err:  # noqa: BLE001  (a prompt the tokenizer refuses: a message, never a crash)
                    msg = f"The tokenizer cannot encode this prompt ({type(err).__name__}: {err}). Edit it and send it again."
                    logger.warning("Rejected a request: %s", msg)
                    gr.Warning(msg)
                    yield "", "", msg, acceptance_frame(None)
                    return
                enc = {k: v.to(input_device(target)) for k, v in enc.items()}  # [1, P] each
                n_prompt = enc["input_ids"].shape[1]
                if n_prompt + max_new_tokens > max_context:
                    msg = (f"The prompt has {n_prompt} tokens; with {max_new_tokens} new tokens it exceeds the model's "
                           f"context of {max_context}. Shorten it.")
                    gr.Warning(msg)
                    yield "", "", msg, acceptance_frame(None)
                    return
                base = {"max_new_tokens": max_new_tokens}  # what plain generate() gets too
                if temperature > 0:
                    base.update(do_sample=True, temperature=temperature)
                else:
                    base.update(do_sample=False)
                gen = dict(base)  # + the drafting keywords, which plain generate() must not see
                drafting = "adaptive (the default)"
                if draft_mode == "fixed chain":
                    gen["num_assistant_tokens"] = chain_length
                    drafting = f"fixed chain of {chain_length}"
                elif draft_mode == "tree":
                    # a fixed tree, as "fixed chain" is a fixed chain ("adaptive" is the adaptive tree)
                    gen.update(draft_mode="tree", tree_total_tokens=tree_size, num_assistant_tokens_schedule="constant")
                    drafting = f"fixed tree of {tree_size} verified tokens"
                gen["draft_sources"] = draft_sources
                drafting += f" · sources: {sources_text(draft_sources, draft_mode)}"
                drafter = drafters[drafter_name]
                chart_at, plain = 0.0, None
                for run in labelled_stream(target, tokenizer, drafter, enc, gen, stop):
                    if run.error:
                        gr.Warning(run.error)
                    now = time.perf_counter()
                    redraw = run.done or now - chart_at >= CHART_EVERY
                    chart_at = now if redraw else chart_at
                    yield (run.html(), "", stats_markdown(run, stopped=run.done and stop.is_set(), drafting=drafting),
                           acceptance_frame(run.stats) if redraw else gr.skip())
                if compare and not stop.is_set():
                    for plain in labelled_stream(target, tokenizer, None, enc, base, stop):
                        yield run.html(), plain.html(), stats_markdown(run, plain, stop.is_set(), drafting), gr.skip()
                yield (run.html(), plain.html() if plain is not None else "",
                       stats_markdown(run, plain, stop.is_set(), drafting), acceptance_frame(run.stats))
            finally:
                stop.set()  # a cancelled or closed session stops its own generation thread
                flags.release(key, stop)

        def arm(request: gr.Request):
            flags.arm(request.session_hash)

        def request_stop(request: gr.Request):
            flags.stop(request.session_hash)

        run_args = {
            "fn": respond, "inputs": [prompt, temperature, max_new, mode, chain, which, compare, tree_size, sources],
            "outputs": [eagle_out, plain_out, stats_md, chart], "concurrency_limit": 1, "concurrency_id": "generate",
            "preprocess": False, "show_progress_on": [eagle_out],  # one spinner and queue line, on the output
        }
        quick = {"inputs": None, "outputs": None, "queue": False, "show_progress": "hidden", "api_visibility": "private"}
        send.click(arm, **quick).then(**run_args, api_name="generate")
        prompt.submit(arm, **quick).then(**run_args, api_visibility="private")  # Enter sends
        stop_btn.click(request_stop, **quick)
    demo.queue(default_concurrency_limit=1)
    return demo


def load_everything(target_name: str, drafter_name: str, drafter_eagle3: str | None, dtype="bfloat16",
                    **load_kwargs):
    """The target (`load_kwargs`: `load_target`'s device, device_map, attn_implementation, ...) and its drafters."""
    target, tok = eagle_hf.load_target(target_name, dtype=dtype, **load_kwargs)
    drafter, label = eagle_hf.load_drafter(drafter_name, target)
    version = drafter.config.version
    drafters = {f"{version} ({label})": drafter}
    if drafter_eagle3:
        d3, label3 = eagle_hf.load_drafter(drafter_eagle3, target)
        drafters[f"EAGLE-3 ({label3})"] = d3
    return target, tok, drafters


def default_examples(n: int = 2) -> list[str]:
    out = []
    for name in ("mt_bench", "gsm8k", "humaneval", "qa"):
        out += [text for _, text in load_prompt_set(name, limit=n)]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=os.environ.get("EAGLE_HF_TARGET", "default"))
    p.add_argument("--drafter", default=os.environ.get("EAGLE_HF_DRAFTER", "default"))
    p.add_argument("--drafter-eagle3", default=os.environ.get("EAGLE_HF_DRAFTER_EAGLE3"))
    add_device_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7860)
    args = p.parse_args(argv)
    try:  # bad device options fail before anything loads
        check_load_options(**load_options(args))
    except EagleCompatibilityError as err:
        p.error(str(err))
    # the server log: eagle_hf's one line per request and per rejected request, no tracebacks for bad input
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("eagle_hf").setLevel(logging.INFO)
    target, tok, drafters = load_everything(args.target, args.drafter, args.drafter_eagle3, **load_options(args))
    demo = build_demo(target, tok, drafters, default_examples())
    print(f"eagle_hf demo on http://{args.host}:{args.port}  (drafters: {', '.join(drafters)})")
    demo.launch(server_name=args.host, server_port=args.port, css=CSS)


if __name__ == "__main__":
    main()
