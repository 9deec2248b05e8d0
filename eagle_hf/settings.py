"""`eagle_hf.settings` (kept for existing imports): the module is `eagle_hf.speculation.settings`."""

from .speculation.settings import *
