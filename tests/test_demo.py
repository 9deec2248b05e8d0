"""Gradio demo: builds without launching; streams labelled tokens over HTTP; a real headless browser uses it."""

import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_drafter, tiny_target

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "demo"))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

gr = pytest.importorskip("gradio")
import app  # noqa: E402  (demo/app.py)


def tiny_parts():
    from test_training import tiny_tokenizer

    target = tiny_target("llama")
    with torch.no_grad():
        target.lm_head.weight.mul_(40)
    return target, tiny_tokenizer(), {"random": tiny_drafter(target)}


def test_app_builds_without_launching():
    target, tok, drafters = tiny_parts()
    demo = app.build_demo(target, tok, drafters, examples=["w1 w2"])
    assert isinstance(demo, gr.Blocks)


def test_labelled_stream_rebuilds_the_exact_output():
    import threading

    target, tok, drafters = tiny_parts()
    enc = tok.apply_chat_template([{"role": "user", "content": "w1 w2 w3"}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    gen = dict(max_new_tokens=24, do_sample=False, num_assistant_tokens=3)
    last = None
    for run, stats, err in app.labelled_stream(target, tok, drafters["random"], dict(enc), gen, threading.Event()):
        last = (run, stats, err)
    run, stats, err = last
    assert err is None and stats is not None
    ref = target.generate(**enc, max_new_tokens=24, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
    assert run.new_ids == ref
    kept = [e for e in run.events if e.label != "rejected"]
    assert len(kept) == len(ref)
    assert sum(e.label == "rejected" for e in run.events) == stats.drafted - stats.accepted


def _serve(demo):
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=None, css=app.CSS, quiet=True)
    return url


def test_client_streams_labelled_tokens_equal_to_plain_generate():
    from gradio_client import Client

    target, tok, drafters = tiny_parts()
    demo = app.build_demo(target, tok, drafters)
    url = _serve(demo)
    try:
        client = Client(url, verbose=False)
        job = client.submit("w4 w5 w6", 0, 24, "fixed chain", 3, "random", False, 16, api_name="/generate")
        outputs = list(job)
        assert len(outputs) >= 2  # streamed, not one final answer
        final_html = job.outputs()[-1][0]
        labels = re.findall(r'class="tok tok-(\w+)"', final_html)
        assert "rejected" in labels and "target" in labels
        enc = tok.apply_chat_template([{"role": "user", "content": "w4 w5 w6"}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ref = target.generate(**enc, max_new_tokens=24, do_sample=False)[0, enc["input_ids"].shape[1]:]
        import html

        texts = re.findall(r'class="tok tok-(\w+)" title="\w+">(.*?)</span>', final_html)
        shown = "".join(html.unescape(t) for label, t in texts if label != "rejected")
        assert shown == "".join(tok.decode([i]) for i in ref)
        # an empty prompt gets a message, not a crash
        empty = client.predict("", 0, 8, "adaptive", 5, "random", False, 16, api_name="/generate")
        assert "Type a prompt" in empty[2]
        # tree mode streams labelled tokens too, with the same final text
        tree = client.predict("w4 w5 w6", 0, 24, "tree", 3, "random", False, 8, api_name="/generate")
        tree_texts = re.findall(r'class="tok tok-(\w+)" title="\w+">(.*?)</span>', tree[0])
        assert "".join(html.unescape(t) for label, t in tree_texts if label != "rejected") == shown
        # the adaptive schedule falls back with a random drafter: those steps are marked as plain
        adaptive = client.predict("w4 w5 w6", 0, 24, "adaptive", 3, "random", False, 16, api_name="/generate")
        adaptive_texts = re.findall(r'class="tok tok-(\w+)" title="\w+">(.*?)</span>', adaptive[0])
        assert "plain" in {label for label, _ in adaptive_texts}
        assert "".join(html.unescape(t) for label, t in adaptive_texts if label != "rejected") == shown
    finally:
        demo.close()


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian chromium is not installed")
def test_real_browser_sees_coloured_tokens(tmp_path):
    from playwright.sync_api import sync_playwright

    target, tok, drafters = tiny_parts()
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
            page.locator("#prompt textarea").fill("w7 w8 w9")
            page.locator("#send").click()
            page.wait_for_selector("#eagle-output .tok-rejected", timeout=60_000)
            page.wait_for_function("document.querySelector('#stats').innerText.includes('tokens/s')", timeout=60_000)
            shot = Path(os.environ.get("EAGLE_HF_SCREENSHOT_DIR", tmp_path)) / "demo.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            browser.close()
    finally:
        demo.close()
