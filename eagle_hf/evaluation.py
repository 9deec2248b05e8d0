"""`eagle_hf.evaluation` (kept for existing imports): the module is `eagle_hf.tools.evaluation`."""

from .tools.evaluation import *
