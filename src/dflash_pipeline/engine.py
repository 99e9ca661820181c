"""Deprecated: `dflash_pipeline.engine` moved to `evaluate.vllm_server` (kept for one release)."""

from dflash_pipeline.core.faces import moved_module

__getattr__ = moved_module(__name__, "dflash_pipeline.evaluate.vllm_server")
