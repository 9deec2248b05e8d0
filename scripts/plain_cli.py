"""What `eagle-hf generate` does, with plain generate(): the yardstick for its wall time (model loading included).

    farm-bench -n 5 --vs "python scripts/plain_cli.py float32" -- eagle-hf generate --dtype float32 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import sys

from transformers import TextStreamer

import eagle_hf  # noqa: F401  (installs the generate() hooks, as the CLI's import does)
from eagle_hf.cli import _target
from eagle_hf.drafter.default import load_drafter

args = argparse.Namespace(target="default", dtype=sys.argv[1] if len(sys.argv) > 1 else "auto", device=None,
                          device_map=None, attn_implementation=None)
target, tok = _target(args)
drafter, _ = load_drafter("default", target)  # loaded too, as the CLI does
enc = tok.apply_chat_template([{"role": "user", "content": "Write a short poem about speculative decoding."}],
                              add_generation_prompt=True, return_tensors="pt", return_dict=True)
target.generate(**enc, max_new_tokens=128, do_sample=False, streamer=TextStreamer(tok, skip_prompt=True))
