"""Gradio demo: watch EAGLE speculative decoding accept and reject draft tokens, live.

    python demo/app.py                      # embedded default: SmolLM2-135M-Instruct + the shipped drafter
    python demo/app.py --target <hub id> --drafter <hub id or folder> [--drafter-eagle3 <...>]

Environment variables EAGLE_HF_TARGET, EAGLE_HF_DRAFTER, EAGLE_HF_DRAFTER_EAGLE3 do the same as the flags.
"""

from __future__ import annotations

import argparse
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
from eagle_hf.evaluation import load_prompt_set
from eagle_hf.visualize import CSS, TokenEvent, label_round, legend_html, token_span, tokens_html

@dataclass
class Run:
    events: list[TokenEvent] = field(default_factory=list)
    new_ids: list[int] = field(default_factory=list)
    tokenizer: object = None
    spans: list[str] = field(default_factory=list)  # each event rendered once, as it arrives

    def add(self, events: list[TokenEvent]) -> None:
        self.events.extend(events)
        self.spans.extend(token_span(e, self.tokenizer) for e in events)

    def html(self) -> str:
        return tokens_html(self.events, self.tokenizer, spans=self.spans)


class _Stop(StoppingCriteria):
    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class _Streamer:
    """Receives the chunks generate() emits (the prompt first) and forwards new tokens to a queue."""

    def __init__(self, q: queue.Queue):
        self.q, self.prompt_seen = q, False

    def put(self, ids):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.q.put(("chunk", ids.reshape(-1).tolist()))

    def end(self):
        self.q.put(("end", None))


def labelled_stream(target, tokenizer, drafter, enc, gen_kwargs, stop: threading.Event):
    """Run generate() in a thread; yield (Run, stats-or-None, error-or-None) as chunks arrive.

    Each round transformers streams a chunk (accepted drafts + the target's token) and then our listener
    reports the drafts of that round, so a chunk is labelled once the next event tells whether it was a cycle.
    """
    q: queue.Queue = queue.Queue()
    run = Run(tokenizer=tokenizer)
    result: dict = {}

    def work():
        try:
            target.generate(
                **enc, **gen_kwargs, streamer=_Streamer(q), stopping_criteria=StoppingCriteriaList([_Stop(stop)]),
                **({"assistant_model": drafter, "draft_listeners": [lambda d, n, last: q.put(("cycle", (d, n)))]} if drafter is not None else {}),
            )
            result["stats"] = eagle_hf.last_stats() if drafter is not None else None
        except Exception as err:  # shown to the user, never crashes the app
            result["error"] = f"{type(err).__name__}: {err}"
            q.put(("end", None))

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    pending: list[int] | None = None

    def flush(chunk, cycle):
        drafts, accepted = cycle if cycle is not None else (None, 0)
        run.add(label_round(chunk, drafts, accepted))
        run.new_ids.extend(chunk)

    while True:
        kind, payload = q.get()
        if kind == "chunk":
            if pending is not None:
                flush(pending, None)
            pending = payload
        elif kind == "cycle":
            if pending is not None:
                flush(pending, payload)
                pending = None
        else:
            if pending is not None:
                flush(pending, None)
            break
        yield run, None, None
    thread.join()
    yield run, result.get("stats"), result.get("error")


def stats_markdown(stats, elapsed: float, n_tokens: int, plain_tps: float | None) -> str:
    tps = n_tokens / elapsed if elapsed else 0.0
    lines = [f"**{tps:.1f} tokens/s** ({n_tokens} tokens in {elapsed:.1f} s)"]
    if stats is not None:
        lines.append(
            f"mean acceptance length **{stats.mean_acceptance_length:.2f}** (tokens per draft-and-verify cycle, "
            f"bonus counted) · {stats.cycles} cycles · fallback to plain decoding in {stats.fallback_ratio:.0%} of steps"
        )
    if plain_tps:
        lines.append(f"plain `generate()`: {plain_tps:.1f} tokens/s → **speedup {tps / plain_tps:.2f}x**")
    return "  \n".join(lines)


def acceptance_frame(stats) -> pd.DataFrame:
    acc = stats.acceptance_per_position if stats is not None else []
    # "#1", "#2", ...: categorical positions (digit strings would be read as numbers: a numeric axis, hairline bars)
    return pd.DataFrame({"draft position": [f"#{i + 1}" for i in range(len(acc))], "acceptance": acc})


def build_demo(target, tokenizer, drafters: dict, examples: list[str] | None = None, max_context: int | None = None):
    """The Blocks app (not launched). `drafters` maps a label (e.g. "EAGLE-3.1") to an EagleDrafter."""
    max_context = max_context or getattr(target.config.get_text_config(), "max_position_embeddings", 4096)
    names = list(drafters)

    def respond(prompt, temperature, max_new_tokens, draft_mode, chain_length, drafter_name, compare, tree_size=16):
        if not prompt or not prompt.strip():
            gr.Warning("Please type a prompt first.")
            yield "", "", "Type a prompt and press Send.", acceptance_frame(None)
            return
        enc = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        enc = {k: v.to(target.device) for k, v in enc.items()}
        n_prompt = enc["input_ids"].shape[1]
        if n_prompt + int(max_new_tokens) > max_context:
            msg = f"The prompt has {n_prompt} tokens; with {int(max_new_tokens)} new tokens it exceeds the model's context of {max_context}. Shorten it."
            gr.Warning(msg)
            yield "", "", msg, acceptance_frame(None)
            return
        gen = dict(max_new_tokens=int(max_new_tokens))
        if temperature > 0:
            gen.update(do_sample=True, temperature=float(temperature))
        else:
            gen.update(do_sample=False)
        if draft_mode == "fixed chain":
            gen["num_assistant_tokens"] = int(chain_length)
        elif draft_mode == "tree":
            gen.update(draft_mode="tree", tree_total_tokens=int(tree_size))
        drafter = drafters[drafter_name]
        stop = threading.Event()
        try:
            start = time.perf_counter()
            run, stats = Run(tokenizer=tokenizer), None
            for run, stats, error in labelled_stream(target, tokenizer, drafter, enc, gen, stop):
                if error:
                    gr.Warning(error)
                elapsed = time.perf_counter() - start
                yield run.html(), "", stats_markdown(stats, elapsed, len(run.new_ids), None), acceptance_frame(stats)
            elapsed = time.perf_counter() - start
            plain_html, plain_tps = "", None
            if compare:
                p_start = time.perf_counter()
                for prun, _, _ in labelled_stream(target, tokenizer, None, enc, gen, stop):
                    plain_html = prun.html()
                    yield run.html(), plain_html, stats_markdown(stats, elapsed, len(run.new_ids), None), acceptance_frame(stats)
                plain_tps = len(prun.new_ids) / (time.perf_counter() - p_start)
            yield run.html(), plain_html, stats_markdown(stats, elapsed, len(run.new_ids), plain_tps), acceptance_frame(stats)
        finally:
            stop.set()  # a cancelled or closed session stops its own generation thread

    with gr.Blocks(title="eagle_hf: speculative decoding, live") as demo:
        gr.Markdown(
            "# EAGLE speculative decoding inside `model.generate()`\n"
            f"Target **{getattr(target, 'name_or_path', 'model')}**; the drafter proposes tokens from the target's own hidden "
            "states and the target verifies them in one forward pass. The output is exactly the target's."
        )
        gr.HTML(legend_html())
        with gr.Row():
            with gr.Column(scale=3):
                prompt = gr.Textbox(label="Prompt", lines=3, elem_id="prompt")
                with gr.Row():
                    send = gr.Button("Send", variant="primary", elem_id="send")
                    stop_btn = gr.Button("Stop", elem_id="stop")
                eagle_out = gr.HTML(label="EAGLE output", elem_id="eagle-output")
                plain_out = gr.HTML(label="plain generate()", elem_id="plain-output")
            with gr.Column(scale=2):
                stats_md = gr.Markdown(label="statistics", elem_id="stats")
                chart = gr.BarPlot(acceptance_frame(None), x="draft position", y="acceptance", y_lim=[0, 1],
                                   x_title="draft position", y_title="acceptance", sort="x",
                                   title="acceptance per draft position", elem_id="chart")
                temperature = gr.Slider(0, 1.5, value=0, step=0.05, label="temperature (0 = greedy)")
                max_new = gr.Slider(8, 512, value=128, step=8, label="max new tokens")
                mode = gr.Radio(["adaptive", "fixed chain", "tree"], value="adaptive", label="drafting")
                chain = gr.Slider(1, 8, value=5, step=1, label="chain length (fixed chain)")
                tree_size = gr.Slider(4, 64, value=16, step=4, label="tree size: verified tokens (tree)")
                which = gr.Radio(names, value=names[0], label="drafter", visible=len(names) > 1)
                compare = gr.Checkbox(label="also run plain generate() and show the speedup", value=False)
        if examples:
            gr.Examples(examples=[[e] for e in examples], inputs=[prompt])
        event = send.click(
            respond, [prompt, temperature, max_new, mode, chain, which, compare, tree_size], [eagle_out, plain_out, stats_md, chart],
            api_name="generate", concurrency_limit=1,
        )
        submitted = prompt.submit(
            respond, [prompt, temperature, max_new, mode, chain, which, compare, tree_size], [eagle_out, plain_out, stats_md, chart],
            concurrency_limit=1,
        )
        stop_btn.click(None, None, None, cancels=[event, submitted])  # Stop ends a run started either way
    demo.queue(default_concurrency_limit=1)
    return demo


def load_everything(target_name: str, drafter_name: str, drafter_eagle3: str | None, dtype: str):
    target, tok = eagle_hf.load_target(target_name, dtype=getattr(torch, dtype))
    drafter, label = eagle_hf.load_drafter(drafter_name, target)
    version = "EAGLE-3.1" if drafter.config.fc_norm and drafter.config.norm_output else "EAGLE-3"
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
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7860)
    args = p.parse_args(argv)
    target, tok, drafters = load_everything(args.target, args.drafter, args.drafter_eagle3, args.dtype)
    demo = build_demo(target, tok, drafters, default_examples())
    print(f"eagle_hf demo on http://{args.host}:{args.port}  (drafters: {', '.join(drafters)})")
    demo.launch(server_name=args.host, server_port=args.port, css=CSS)


if __name__ == "__main__":
    main()
