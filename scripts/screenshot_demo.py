"""Make docs/demo.png: the Gradio demo with a real target and drafter, screenshotted by a headless Chromium.

Not run by the tests (the browser test in tests/test_demo.py uses tiny random models and writes its screenshot to a
temporary folder). By default: the embedded SmolLM2-135M-Instruct target (bf16, as `python demo/app.py`) and the
shipped EAGLE-3.1 drafter, on a code-editing prompt of the `code_edit` set, where the answer copies the prompt's
function: the page shows accepted tokens from the drafter, copied ones and ones both proposed, the legend and the
per-source statistics.

    python scripts/screenshot_demo.py                       # writes docs/demo.png
    python scripts/screenshot_demo.py --prompt-id 3 --max-new-tokens 256 --out /tmp/demo.png
    # the EAGLE-3 / EAGLE-3.1 switch with the matched pair (scripts/train_matched_pair.sh), EAGLE-3 selected
    python scripts/screenshot_demo.py --drafter runs/pair_eagle31/best --drafter-eagle3 runs/pair_eagle3/best \
        --pick 1 --prompt-set mt_bench --out /tmp/demo_pair.png

Needs gradio, playwright and a Chromium (Debian's `chromium`, or `--chromium PATH`).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "demo"))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import app  # demo/app.py, imported after its folder joined sys.path
import torch

from eagle_hf.tools.evaluation import load_prompt_set

logger = logging.getLogger("screenshot_demo")

#: the run is over: the statistics show the decode speed and no longer say "generating"
JS_DONE = ("() => { const s = document.querySelector('#stats').innerText;"
           " return s.includes('tokens/s') && s.includes('drafting:') && !s.includes('generating'); }")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="default", help="'default' (the embedded SmolLM2) or a Hub id / folder")
    p.add_argument("--drafter", default="default", help="'default' (the shipped drafter), a folder or a Hub id")
    p.add_argument("--drafter-eagle3", default=None,
                   help="an EAGLE-3 drafter for the demo's drafter switch (e.g. runs/pair_eagle3/best)")
    p.add_argument("--pick", type=int, default=0, help="which drafter the switch selects (0: --drafter, 1: --drafter-eagle3)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--prompt-set", default="code_edit", help="a shipped prompt set or a JSONL file")
    p.add_argument("--prompt-id", type=int, default=0, help="index of the prompt in the set")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--mode", default="adaptive", choices=["adaptive", "fixed chain", "tree"])
    p.add_argument("--sources", default="auto", choices=app.SOURCE_CHOICES)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--chromium", default=shutil.which("chromium"), help="the Chromium executable")
    p.add_argument("--out", default=str(ROOT / "docs" / "demo.png"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not args.chromium:
        p.error("no Chromium found: install Debian's chromium or pass --chromium")
    if args.threads:
        torch.set_num_threads(args.threads)

    from playwright.sync_api import sync_playwright

    target, tok, drafters = app.load_everything(args.target, args.drafter, args.drafter_eagle3, args.dtype)
    picked = list(drafters)[args.pick]
    prompts = load_prompt_set(args.prompt_set)
    text = prompts[args.prompt_id][1]
    if not isinstance(text, str):
        p.error(f"prompt {args.prompt_id} of {args.prompt_set} is a chat, not one user turn: pick another")
    # a first call measures this machine's costs for the adaptive schedule: not part of the run on the page
    enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    start = time.perf_counter()
    target.generate(**enc, assistant_model=drafters[picked], max_new_tokens=16, do_sample=False)
    logger.info("warm-up call: %.1f s", time.perf_counter() - start)

    demo = app.build_demo(target, tok, drafters)
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=None, css=app.CSS,
                            quiet=True)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium, headless=True,
                                         args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url)
            page.wait_for_selector("#prompt textarea")
            box = page.locator("#max-new input[type=number]")
            box.fill(str(args.max_new_tokens))
            box.press("Enter")
            page.get_by_label(args.mode, exact=True).check()
            page.get_by_label(args.sources, exact=True).check()
            if len(drafters) > 1:
                page.get_by_label(picked, exact=True).check()
            page.locator("#prompt textarea").fill(text)
            page.locator("#send").click()
            page.wait_for_function(JS_DONE, timeout=30 * 60_000, polling=500)
            stats = page.locator("#stats").inner_text()
            page.screenshot(path=args.out, full_page=True)
            browser.close()
    finally:
        demo.close()
    print(stats)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
