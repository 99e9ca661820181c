"""Deprecated: `dflash_pipeline.evaluate_engine` moved to `evaluate.engine_acceptance`
and `evaluate.engine_vs_loop` (kept for one release)."""

from dflash_pipeline.core.faces import moved_module

__getattr__ = moved_module(
    __name__, "dflash_pipeline.evaluate.engine_acceptance", "dflash_pipeline.evaluate.engine_vs_loop"
)
