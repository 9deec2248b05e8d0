"""The transformers versions whose generate() internals eagle_hf hooks into."""

from __future__ import annotations

import transformers
from packaging.version import Version

from ..errors import EagleCompatibilityError

# [min, max): 5.25 keeps a hybrid model's recurrent states for assisted decoding its own way (there hybrids fall
# back to plain decoding and a Falcon-H1 batch fails) and rewrote its server; the rest of the suite passes on it
SUPPORTED_TRANSFORMERS = (Version("5.20.0"), Version("5.25.0"))


def check_transformers_version(version: str | None = None) -> None:
    v = Version(version or transformers.__version__)
    low, high = SUPPORTED_TRANSFORMERS
    if not (low <= v < high):
        raise EagleCompatibilityError(
            f"eagle_hf hooks into transformers' assisted-generation loop and supports transformers >={low},<{high}; "
            f"found {v}. Install a supported version: pip install 'transformers>={low},<{high}'."
        )


# transformers 5.24 renamed `past_key_values` to `cache` in model forwards, generate()'s keyword arguments and the
# outputs (the old name warns until 5.40): eagle_hf speaks the installed version's name and reads either.
CACHE_KEY = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"


def cache_kwarg(cache) -> dict:
    """The keyword argument that passes `cache` to a model forward (or generate()) of the installed transformers."""
    return {CACHE_KEY: cache}


def cache_in(kwargs: dict):
    """The cache passed in `kwargs` (generate()'s or a forward's) under either name, or None."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache


def output_cache(out):
    """The cache that a model or generate() output carries, under either name, without a deprecation warning."""
    return getattr(out, CACHE_KEY, None)
