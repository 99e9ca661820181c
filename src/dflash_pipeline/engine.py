"""Deprecated: ``dflash_pipeline.engine`` moved to :mod:`dflash_pipeline.evaluate.vllm_server` (kept for one release)."""

import importlib
import warnings

warnings.warn(
    "dflash_pipeline.engine is deprecated; import dflash_pipeline.evaluate.vllm_server",
    DeprecationWarning,
    stacklevel=2,
)
_NEW = importlib.import_module("dflash_pipeline.evaluate.vllm_server")


def __getattr__(name):
    return getattr(_NEW, name)
