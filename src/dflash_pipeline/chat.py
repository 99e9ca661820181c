"""Deprecated: `dflash_pipeline.chat` moved to `target.chat` (kept for one release)."""

from dflash_pipeline.core.faces import moved_module

__getattr__ = moved_module(__name__, "dflash_pipeline.target.chat")
