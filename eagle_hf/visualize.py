"""`eagle_hf.visualize` (kept for existing imports): the module is `eagle_hf.tools.visualize`."""

from .tools.visualize import *
