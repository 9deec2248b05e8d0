"""Gradio demo: builds without launching; streams labelled tokens and live statistics over HTTP; validates API
input; a real headless browser uses it (Enter sends, the visible text is the output, the chart is categorical, Stop
and the queue). Accepted drafts are marked by source (drafter, copied, both), with a legend."""

import html
import logging
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_drafter, tiny_target
from conftest import word_tokenizer as demo_tokenizer  # (the demo's tests name it so)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "demo"))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

gr = pytest.importorskip("gradio")
import app  # demo/app.py, imported after its folder joined sys.path

from eagle_hf.tools.visualize import (
    CSS,
    DraftRecorder,
    LabelledTokens,
    SpanRenderer,
    TextPieces,
    TokenEvent,
    label_round,
    legend_html,
    token_span,
)


@pytest.fixture(scope="module")
def parts():
    torch.set_num_threads(1)  # tiny models: thread-pool overhead dominates, and the browser needs the other core
    target = tiny_target("llama")
    with torch.no_grad():
        target.lm_head.weight.mul_(40)
    return target, demo_tokenizer(), {"random": tiny_drafter(target)}


def encode(tok, prompt):
    return tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)


def plain_text(target, tok, prompt, max_new_tokens):
    """What plain greedy generate() answers, decoded as a user reads it."""
    enc = encode(tok, prompt)
    out = target.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


SPAN = re.compile(r'class="tok tok-(\w+)(?: src-(\w+))?" title="[\w :]+">(.*?)</span>', re.DOTALL)


def shown_text(page_html: str) -> str:
    """The output's text without the rejected drafts."""
    return "".join(html.unescape(t) for label, _, t in SPAN.findall(page_html) if label != "rejected")


def marks(page_html: str) -> set[tuple[str, str]]:
    """(label, source) of the spans: source "" for target/plain tokens, else "eagle", "copy" or "both"."""
    return {(label, source) for label, source, _ in SPAN.findall(page_html)}


def test_text_pieces_follow_the_whole_decoding():
    tok = demo_tokenizer()
    ids = tok.convert_tokens_to_ids(["wa", "Ġwb", "Ċ", "Ã", "©", "ĠÃ©", "<|im_end|>", "ĊĊ", "wc", "Ã"])
    pieces = TextPieces(tok)
    got = [pieces.add(i) for i in ids]
    assert got == ["wa", " wb", "\n", "", "é", " é", "", "\n\n", "wc", ""]  # "é" waits for its second byte
    assert pieces.flush() == "\ufffd"  # an output that ends inside a character shows what it has
    assert "".join(got) + "\ufffd" == tok.decode(ids, skip_special_tokens=True)


def test_draft_tokens_are_marked_by_source_with_a_legend():
    tok = demo_tokenizer()
    wa, wb, wc, wd, we, wf = tok.convert_tokens_to_ids(["wa", "Ġwb", "Ġwc", "Ġwd", "Ġwe", "Ġwf"])
    recorder = DraftRecorder()
    recorder([wb, wc, wd], 3, we, sources=["eagle", "eagle+copy", "copy"])  # all accepted; we: the bonus token
    recorder([wb, wc], 1, wf, sources=["copy", "eagle"])  # wc rejected, wf recovered
    recorder([], 0, wa, sources=[])  # a plain step
    assert recorder.rounds[0] == ([wb, wc, wd], 3, we)  # rounds keep their (drafts, accepted, token) shape
    events = recorder.events([wa, wb, wc, wd, we, wb, wf, wa])
    assert [(e.label, e.source) for e in events] == [
        ("target", None), ("accepted", "eagle"), ("accepted", "eagle+copy"), ("accepted", "copy"), ("target", None),
        ("accepted", "copy"), ("rejected", "eagle"), ("target", None), ("plain", None)]
    view = LabelledTokens(events, tok)
    assert view.counts() == {"accepted": 4, "target": 3, "rejected": 1, "plain": 1}
    assert view.accepted_by_source() == {"eagle": 1, "copy": 2, "eagle+copy": 1}
    page = view._repr_html_()
    assert marks(page) == {("target", ""), ("accepted", "eagle"), ("accepted", "both"), ("accepted", "copy"),
                           ("rejected", "eagle"), ("plain", "")}
    assert 'title="accepted: copied and drafted"' in page and 'title="rejected: drafter"' in page
    assert shown_text(page) == "wa wb wc wd we wb wfwa"
    # the legend names the three sources of accepted drafts next to the other labels, in their colours
    legend = legend_html()
    for css, name in (("src-eagle", "accepted · drafter"), ("src-copy", "accepted · copied"),
                      ("src-both", "accepted · both")):
        assert f'<span class="tok tok-accepted {css}">&nbsp;{name}&nbsp;</span>' in legend
    assert all(f'class="tok tok-{k}"' in legend for k in ("target", "rejected", "plain"))
    assert "accepted · " not in legend_html(sources=False) and 'class="tok tok-accepted"' in legend_html(sources=False)
    assert ".tok-accepted.src-copy {background: #ffe08a}" in CSS and "src-both" in CSS  # amber, green underline
    # a listener without `sources` (or an older recording): accepted drafts unmarked, as before
    old = label_round([wb, we], [wb, wc], 1)
    assert [(e.label, e.source) for e in old] == [("accepted", None), ("rejected", None), ("target", None)]
    assert token_span(old[0], tok) == '<span class="tok tok-accepted" title="accepted"> wb</span>'
    # bytes held back to the end keep the last token's label and source
    renderer = SpanRenderer(tok)
    renderer.add([TokenEvent(tok.convert_tokens_to_ids("Ã"), "accepted", "copy")])
    renderer.finish()
    assert marks("".join(renderer.spans)) == {("accepted", "copy")}


def test_app_builds_and_its_api_names_every_output(parts):
    target, tok, drafters = parts
    demo = app.build_demo(target, tok, drafters, examples=["wa wb"])
    assert isinstance(demo, gr.Blocks)
    info = demo.get_api_info()
    assert list(info["named_endpoints"]) == ["/generate"] and not info["unnamed_endpoints"]  # arm/stop are private
    returns = [r["label"] for r in info["named_endpoints"]["/generate"]["returns"]]
    assert returns == ["EAGLE output", "plain generate()", "statistics", "acceptance per draft position"]
    params = [p["parameter_name"] for p in info["named_endpoints"]["/generate"]["parameters"]]
    assert params == ["prompt", "temperature", "max_new_tokens", "draft_mode", "chain_length", "drafter_name",
                      "compare", "tree_size", "draft_sources"]


def test_labelled_stream_rebuilds_the_exact_output_with_live_statistics(parts):
    target, tok, drafters = parts
    enc = encode(tok, "wd we wf")
    gen = {"max_new_tokens": 24, "do_sample": False, "num_assistant_tokens": 3}
    cycles = []
    for run in app.labelled_stream(target, tok, drafters["random"], dict(enc), gen, threading.Event()):
        if run.stats is not None:
            cycles.append(run.stats.cycles)
    assert run.done and run.error is None and run.stats is not None
    assert cycles == sorted(cycles) and 0 < cycles[0] < run.stats.cycles  # live: the statistics grow as tokens stream
    ref = target.generate(**enc, max_new_tokens=24, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
    assert run.new_ids == ref
    kept = [e for e in run.events if e.label != "rejected"]
    assert len(kept) == len(ref)
    assert sum(e.label == "rejected" for e in run.events) == run.stats.drafted - run.stats.accepted
    assert {e.source for e in run.events if e.label in ("accepted", "rejected")} == {"eagle"}  # a chain: the drafter's
    assert shown_text(run.html()) == tok.decode(ref, skip_special_tokens=True)
    assert run.prefill_seconds > 0 and run.decode_tokens_per_second > 0
    md = app.stats_markdown(run, drafting="fixed chain of 3")
    assert "tokens/s** decoding" in md and "prefill" in md and "mean acceptance length" in md and "generating" not in md
    assert "stopped" in app.stats_markdown(run, stopped=True)
    assert list(app.acceptance_frame(run.stats)["draft position"]) == ["#1", "#2", "#3"]


def _serve(demo):
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=None, css=app.CSS, quiet=True)
    return url


def _generate_fn(demo):
    """The function behind the app's /generate endpoint, called here without a server."""
    (fn,) = [f.fn for f in demo.fns.values() if f.api_name == "generate"]
    return fn


def test_a_prompt_with_lone_surrogates_reaches_the_model(parts):
    """A JSON API call can send "\\ud800", which no tokenizer encodes: each lone surrogate reaches the model as
    U+FFFD, a proper pair of them as its character."""
    target, tok, drafters = parts
    respond = _generate_fn(app.build_demo(target, tok, drafters))
    for prompt, clean in [("wd \ud800we", "wd \ufffdwe"), ("wd\udfff", "wd\ufffd"), ("wd \ud83d\ude00", "wd \U0001f600")]:
        *_, (eagle, _, stats, _) = respond(prompt, 0, 8, "fixed chain", 3, "random", False, 16, "eagle")
        assert shown_text(eagle) == plain_text(target, tok, clean, 8), prompt
        assert "tokens/s** decoding" in stats

    class Refusing:  # a tokenizer that cannot encode some text: the client gets a message, nothing raises
        def __getattr__(self, name):
            return getattr(tok, name)

        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("cannot encode this")

    respond = _generate_fn(app.build_demo(target, Refusing(), drafters))
    *_, (eagle, _, message, _) = respond("wd", 0, 8, "adaptive", 3, "random", False, 16, "eagle")
    assert eagle == "" and "tokenizer cannot encode this prompt (ValueError: cannot encode this)" in message


def test_client_streams_labelled_tokens_equal_to_plain_generate(parts, capfd, caplog):
    from gradio_client import Client

    target, tok, drafters = parts
    demo = app.build_demo(target, tok, drafters)
    url = _serve(demo)
    try:
        client = Client(url, verbose=False)
        job = client.submit("wd we wf", 0, 24, "fixed chain", 3, "random", False, 16, api_name="/generate")
        outputs = list(job)
        assert len(outputs) >= 2  # streamed, not one final answer
        final = job.outputs()[-1]
        labels = [label for label, _ in marks(final[0])]
        assert "rejected" in labels and "target" in labels
        expected = plain_text(target, tok, "wd we wf", 24)
        assert shown_text(final[0]) == expected
        assert "tokens/s** decoding" in final[2] and "fixed chain of 3" in final[2]
        assert "generating" in outputs[0][2] or "prefill" in outputs[0][2]  # live statistics while streaming
        # an empty prompt gets a message, not a crash
        empty = client.predict("", 0, 8, "adaptive", 5, "random", False, 16, api_name="/generate")
        assert "Type a prompt" in empty[2]
        # tree mode streams labelled tokens too, with the same final text; by default copies from the prompt and
        # output join the drafter's tree: the random drafter's drafts are rejected, the copies of the repeating
        # output accepted, and the statistics count both sources
        tree = client.predict("wd we wf", 0, 24, "tree", 3, "random", False, 8, "auto", api_name="/generate")
        assert shown_text(tree[0]) == expected
        assert ("accepted", "copy") in marks(tree[0]) and ("rejected", "eagle") in marks(tree[0])
        assert re.search(r"accepted/drafted by source: drafter \*\*\d+/\d+\*\* \(\d+%\) · copy \*\*[1-9]\d*/\d+\*\*", tree[2])
        assert "sources: auto (drafter + copies)" in tree[2]
        # one source alone: only its marks
        for sources, only in (("eagle", "eagle"), ("copy", "copy")):
            one = client.predict("wd we wf", 0, 24, "tree", 3, "random", False, 8, sources, api_name="/generate")
            assert shown_text(one[0]) == expected
            assert {s for label, s in marks(one[0]) if label in ("accepted", "rejected")} == {only}, sources
        # the adaptive schedule falls back with a random drafter: those steps are marked as plain
        adaptive = client.predict("wd we wf", 0, 24, "adaptive", 3, "random", True, 16, api_name="/generate")
        assert "plain" in {label for label, _ in marks(adaptive[0])}
        assert shown_text(adaptive[0]) == expected == shown_text(adaptive[1])
        assert "speedup" in adaptive[2]

        # out-of-range values through the API: a clear message to the client, one log line, no traceback
        capfd.readouterr()
        bad = [((-1, 24, "adaptive", 3, "random", False, 16), "temperature must be from 0 to 1.5; got -1"),
               ((0, 100000, "adaptive", 3, "random", False, 16), "max_new_tokens must be from 8 to 512; got 100000"),
               ((0, 24, "bogus", 3, "random", False, 16), "draft_mode must be one of"),
               ((0, 24, "adaptive", 2.5, "random", False, 16), "chain_length must be a whole number; got 2.5"),
               ((0, 24, "adaptive", 3, "nope", False, 16), "drafter_name must be one of ['random']; got 'nope'"),
               ((0, 24, "tree", 3, "random", False, "x"), "tree_size must be a number from 4 to 64; got 'x'"),
               ((0, 24, "tree", 3, "random", False, 16, "ngram"),
                "draft_sources must be one of ['auto', 'eagle', 'copy', 'eagle+copy']; got 'ngram'")]
        with caplog.at_level(logging.WARNING, logger="eagle_hf.demo"):
            for values, message in bad:
                with pytest.raises(Exception, match=re.escape(message)):
                    client.predict("wd we wf", *values, api_name="/generate")
        rejected = [r for r in caplog.records if r.name == "eagle_hf.demo" and "Rejected a request" in r.getMessage()]
        assert len(rejected) == len(bad)
        captured = capfd.readouterr()
        assert "Traceback" not in captured.err + captured.out
    finally:
        demo.close()


JS_DONE = ("(want) => { const s = document.querySelector('#stats').innerText;"
           " return s.includes(want) && s.includes('tokens/s') && !s.includes('generating'); }")
# the output's text as drawn (innerText follows the layout), with the rejected drafts taken out of the layout
JS_VISIBLE = """() => {
  const out = document.querySelector('#eagle-output .tokens');
  const rejected = Array.from(out.querySelectorAll('.tok-rejected'));
  rejected.forEach(e => e.style.display = 'none');
  const text = out.innerText;
  rejected.forEach(e => e.style.display = '');
  return [text, rejected.map(e => e.textContent)];
}"""
JS_TRACKERS = """() => Array.from(document.querySelectorAll('[data-testid=status-tracker]'))
  .filter(e => !e.classList.contains('hide') && e.offsetParent !== null)
  .map(e => (e.closest('[id]') || {}).id + ': ' + e.innerText.replace(/\\n/g, ' '))"""


def _settings(page, max_new: int, mode: str, chain: int | None = None):
    for elem, value in (("max-new", max_new), ("chain", chain)):
        if value is not None:
            box = page.locator(f"#{elem} input[type=number]")
            box.fill(str(value))
            box.press("Enter")
    page.get_by_label(mode, exact=True).check()


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian chromium is not installed")
def test_real_browser(parts, tmp_path, monkeypatch):
    from playwright.sync_api import sync_playwright

    target, tok, drafters = parts
    demo = app.build_demo(target, tok, drafters)
    url = _serve(demo)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=shutil.which("chromium"), headless=True,
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                      "--disable-sync", "--no-first-run"],
            )
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url)
            page.wait_for_selector("#prompt textarea")

            # Enter in the prompt box sends; rejected newline drafts leave the visible text the plain output's
            _settings(page, 40, "fixed chain", 3)
            page.locator("#prompt textarea").fill("wd we wf")
            page.locator("#prompt textarea").press("Enter")
            page.wait_for_function(JS_DONE, arg="fixed chain of 3", timeout=60_000)
            visible, rejected = page.evaluate(JS_VISIBLE)
            assert visible == plain_text(target, tok, "wd we wf", 40)
            assert any("⏎" in r for r in rejected), rejected  # rejected newline drafts happened, drawn as symbols
            assert not any(c in r for r in rejected for c in "\n \t")
            assert page.locator("#prompt textarea").input_value() == "wd we wf"  # Enter sent, it added no line

            # a fixed tree, sent with the button: the same text as plain generate(); the chart has categorical
            # positions #1.. with real bars
            page.get_by_label("tree", exact=True).check()
            page.locator("#prompt textarea").fill("wa wb")
            page.locator("#send").click()
            page.wait_for_function(JS_DONE, arg="tree of 16", timeout=60_000)
            assert page.evaluate(JS_VISIBLE)[0] == plain_text(target, tok, "wa wb", 40)
            x_axis = page.locator("#chart [aria-roledescription=axis]").first
            assert "discrete scale" in x_axis.get_attribute("aria-label"), x_axis.get_attribute("aria-label")
            labels = x_axis.evaluate("a => Array.from(a.querySelectorAll('.role-axis-label text')).map(e => e.textContent)")
            assert labels == [f"#{i + 1}" for i in range(len(labels))] and labels, labels
            bars = page.evaluate("Array.from(document.querySelectorAll('#chart .role-mark path')).map(e => { const b = e.getBBox(); return {width: b.width, height: b.height}; })")
            assert len(bars) == len(labels)
            assert bars and all(b["width"] > 20 for b in bars), bars  # bars, not hairlines
            assert any(b["height"] > 20 for b in bars), bars  # the tree's first position is often accepted
            # accepted drafts by source: the repeating output is copied (amber), explained by the legend
            copied = page.locator("#eagle-output .tok-accepted.src-copy")
            assert copied.count() > 0
            assert copied.first.evaluate("e => getComputedStyle(e).backgroundColor") == "rgb(255, 224, 138)"
            legend = page.locator(".legend").first.inner_text()
            assert all(f"accepted · {k}" in legend for k in ("drafter", "copied", "both")), legend
            assert "accepted/drafted by source: drafter" in page.locator("#stats").inner_text()
            shot = Path(os.environ.get("EAGLE_HF_SCREENSHOT_DIR", tmp_path)) / "demo.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000

            # a second user waits in the queue: one spinner and queue line; Stop ends the first run with its
            # statistics so far and a note, then the second runs
            other = browser.new_page(viewport={"width": 1280, "height": 900})
            other.goto(url)
            other.wait_for_selector("#prompt textarea")
            _settings(other, 16, "adaptive")
            other.get_by_label("copy", exact=True).check()  # draft sources: copies alone
            other.locator("#prompt textarea").fill("wa wb")
            forward = type(target).forward  # a run Stop can still catch on a fast host: 20 ms a target forward
            monkeypatch.setattr(type(target), "forward", lambda self, *a, **k: (time.sleep(0.02), forward(self, *a, **k))[1])
            _settings(page, 480, "fixed chain")
            page.locator("#send").click()
            page.wait_for_function(JS_DONE.replace("!s.includes('generating')", "s.includes('generating')"),
                                   arg="fixed chain of 3", timeout=60_000)
            other.locator("#prompt textarea").press("Enter")
            other.wait_for_function(f"({JS_TRACKERS})().some(t => t.includes('queue'))", timeout=30_000)
            trackers = other.evaluate(JS_TRACKERS)
            assert len(trackers) == 1 and trackers[0].startswith("eagle-output: queue"), trackers
            page.locator("#stop").click()
            page.wait_for_function("document.querySelector('#stats').innerText.includes('stopped after')", timeout=30_000)
            stats = page.locator("#stats").inner_text()
            n = int(re.search(r"stopped after (\d+) tokens", stats).group(1))
            assert 0 < n < 480 and "mean acceptance length" in stats and f"({n} tokens in" in stats
            other.wait_for_function(JS_DONE, arg="adaptive (the default) · sources: copies alone", timeout=60_000)
            browser.close()
    finally:
        demo.close()
