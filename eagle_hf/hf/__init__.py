"""Everything that faces transformers' `generate()` internals lives in this package.

- `hooks`: the `generate` hook, its installation, and the candidate-generator hook;
- `call`: checks of a call before any compute, and the per-call context;
- `candidate`: chain mode, the `Speculator` behind transformers' `CandidateGenerator` seam;
- `tree_loop`: tree mode, prefill / draft / verify / commit, as a `custom_generate`;
- `cache`: the target's KV-cache compaction and tree attention masks; `attention`: the tree attention function
  (split keys at long context); `windows`: sliding-window layers' masks under a tree;
- `stopping`: EOS ids and plain generate()'s stopping point replayed;
- `costs`: verify and drafter costs measured on the device, and the adaptive controller of a call;
- `models`: what is read from transformers' model classes (final-norm scale, RoPE menu);
- `version`: the supported transformers versions and their name for the KV cache; `hub`: the Hub-hostable `custom_generate/` folder.

Tested against transformers 5.23 and 5.24 (``SUPPORTED_TRANSFORMERS``; `version` speaks either's name for the
KV cache); other versions raise a clear error on use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "EagleCandidateGenerator": "candidate",
    "SUPPORTED_TRANSFORMERS": "version",
    "check_compatible": "call",
    "check_transformers_version": "version",
    "generate": "hooks",
    "install": "hooks",
    "uninstall": "hooks",
    "write_custom_generate": "hub",
}
__all__ = sorted(_EXPORTS)  # noqa: PLE0605 - a list built from the exports' table


def __getattr__(name: str):
    """Exports load on first use, so that `eagle_hf.drafter.modeling` can use `eagle_hf.hf.models` without a cycle."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
