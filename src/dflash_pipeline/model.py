"""Deprecated: `dflash_pipeline.model` moved to `drafter.model` (kept for one release)."""

from dflash_pipeline.core.faces import moved_module

__getattr__ = moved_module(__name__, "dflash_pipeline.drafter.model")
