"""Everything that faces transformers' `generate()` internals lives in this package.

- `hooks`: the `generate` hook, its installation, and the candidate-generator hook;
- `call`: checks of a call before any compute, and the per-call context;
- `candidate`: chain mode, the `Speculator` behind transformers' `CandidateGenerator` seam;
- `tree_loop`: tree mode, prefill / draft / verify / commit, as a `custom_generate`;
- `cache`: the target's KV-cache compaction and tree attention masks;
- `stopping`: EOS ids and plain generate()'s stopping point replayed;
- `version`: the supported transformers versions; `hub`: the Hub-hostable `custom_generate/` folder.

Tested against transformers 5.23 (``SUPPORTED_TRANSFORMERS``); other versions raise a clear error on use.
"""

from .call import check_compatible
from .candidate import EagleCandidateGenerator
from .hooks import generate, install, uninstall
from .hub import write_custom_generate
from .version import SUPPORTED_TRANSFORMERS, check_transformers_version

__all__ = [
    "EagleCandidateGenerator",
    "SUPPORTED_TRANSFORMERS",
    "check_compatible",
    "check_transformers_version",
    "generate",
    "install",
    "uninstall",
    "write_custom_generate",
]
