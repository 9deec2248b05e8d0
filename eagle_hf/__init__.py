"""eagle_hf: EAGLE-3 / EAGLE-3.1 speculative decoding inside Hugging Face `model.generate()`.

    import eagle_hf
    drafter = eagle_hf.EagleDrafter.from_pretrained("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")
    out = target.generate(**inputs, assistant_model=drafter)   # same tokens as without the drafter
    print(eagle_hf.last_stats().summary())
"""

from __future__ import annotations

import logging

from .drafter.checkpoint import DrafterLoadError
from .drafter.config import EagleConfig, __version__
from .drafter.default import DEFAULT_DRAFTER, DEFAULT_TARGET_NAME, load_default_target, load_drafter, load_target
from .drafter.modeling import EagleDrafter
from .errors import EagleCompatibilityError
from .hf import install, write_custom_generate
from .speculation.settings import DraftSettings
from .speculation.stats import SpecDecodeStats, last_stats

logging.getLogger(__name__).addHandler(logging.NullHandler())
install()

__all__ = [
    "DEFAULT_DRAFTER",
    "DEFAULT_TARGET_NAME",
    "DraftSettings",
    "DrafterLoadError",
    "EagleCompatibilityError",
    "EagleConfig",
    "EagleDrafter",
    "SpecDecodeStats",
    "__version__",
    "last_stats",
    "load_default_target",
    "load_drafter",
    "load_target",
    "write_custom_generate",
]
