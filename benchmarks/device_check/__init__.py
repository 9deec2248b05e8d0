"""The device check of scripts/device_check.py (docs/gpu.md), one module per stage:

- ``bootstrap``: the carried wheels, before transformers is imported (standard library only)
- ``common``: shapes, the report, budgets, the run's context, models and calls the stages share
- ``env``, ``suite``, ``equality``, ``replay``, ``compiled``, ``sync``, ``profile``, ``memory``, ``kernels``,
  ``quant``, ``sampling``: the stages, in the order they run
- ``cli``: the arguments, the stage registry and the run loop

Standard library only here (and in ``benchmarks/__init__.py``): the script imports ``bootstrap`` before the
bootstrap has run.
"""
