"""Everything that faces transformers' `generate()` internals lives in this package.

- `hooks`: the `generate` hook, its installation, and the candidate-generator hook;
- `call`: checks of a call before any compute, and the per-call context;
- `candidate`: chain mode, the `Speculator` behind transformers' `CandidateGenerator` seam;
- `tree_loop`: tree mode, prefill / draft / verify / commit, as a `custom_generate`;
- `cache`: the target's KV-cache compaction and tree attention masks; `attention`: the tree attention function
  (split keys at long context); `windows`: sliding-window layers' masks under a tree; `indexed`: indexed
  (sparse) attention's indexer keys under a tree;
- `stopping`: EOS ids and plain generate()'s stopping point replayed;
- `costs`: verify and drafter costs measured on the device, and the adaptive controller of a call;
- `models`: what is read from transformers' model classes and utilities (compiled graphs and their warm-up, the
  logits head on real nodes, Llama 4's query-scale step);
- `version`: the supported transformers versions and their name for the KV cache; `hub`: the Hub-hostable `custom_generate/` folder.
- `serving`: `eagle-hf serve` on transformers' own server (imported on its own use: it needs the `serve` extra).

Tested against transformers 5.23 and 5.24 (``SUPPORTED_TRANSFORMERS``: 5.20 to 5.24; `version` speaks either's
name for the KV cache); other versions raise a clear error on use.
"""

from __future__ import annotations

from .call import check_compatible
from .candidate import EagleCandidateGenerator
from .hooks import generate, install, uninstall
from .hub import write_custom_generate
from .version import SUPPORTED_TRANSFORMERS, check_transformers_version

__all__ = [
    "SUPPORTED_TRANSFORMERS",
    "EagleCandidateGenerator",
    "check_compatible",
    "check_transformers_version",
    "generate",
    "install",
    "uninstall",
    "write_custom_generate",
]
