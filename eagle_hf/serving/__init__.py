"""`eagle-hf serve`: an OpenAI-compatible server (transformers' own, `eagle_hf.hf.serving`) whose every request
speculates with an EAGLE drafter.

One target and one drafter are loaded once; requests run one at a time, each one `generate()` call with the
drafter, greedy or sampled as it asks, and each response says what its call drafted and got accepted (a
`speculation` field beside `usage`); ``GET /metrics`` has the totals. See docs/serving.md.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def serve(target, tokenizer, drafter=None, *, name: str = "default", host: str = "127.0.0.1", port: int = 8000,
          draft_options: dict | None = None, log_level: str = "warning") -> None:
    """Serve `target` under `name` on ``http://host:port/v1`` until interrupted (Ctrl-C), every request speculating
    with `drafter` (None: plain decoding) and `draft_options` (generate()'s draft keywords)."""
    import uvicorn

    from ..hf.serving import build_app

    app = build_app(target, tokenizer, drafter, name=name, draft_options=draft_options)
    if log_level != "info":  # (transformers' server logs every request as a warning)
        logging.getLogger("transformers.cli.serving").setLevel(logging.ERROR)
    logger.info("Serving %s on http://%s:%d/v1", name, host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
