"""The transformers versions whose generate() internals eagle_hf hooks into."""

from __future__ import annotations

import transformers
from packaging.version import Version

from ..errors import EagleCompatibilityError

SUPPORTED_TRANSFORMERS = (Version("5.20.0"), Version("6.0.0"))  # [min, max)


def check_transformers_version(version: str | None = None) -> None:
    v = Version(version or transformers.__version__)
    low, high = SUPPORTED_TRANSFORMERS
    if not (low <= v < high):
        raise EagleCompatibilityError(
            f"eagle_hf hooks into transformers' assisted-generation loop and supports transformers >={low},<{high}; "
            f"found {v}. Install a supported version: pip install 'transformers>={low},<{high}'."
        )
