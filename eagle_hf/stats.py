"""`eagle_hf.stats` (kept for existing imports): the module is `eagle_hf.speculation.stats`."""

from .speculation.stats import *
