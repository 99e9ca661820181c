"""Deprecated: ``dflash_pipeline.evaluate_engine`` moved to :mod:`dflash_pipeline.evaluate.engine_acceptance` (kept for one release)."""

import importlib
import warnings

warnings.warn(
    "dflash_pipeline.evaluate_engine is deprecated; import dflash_pipeline.evaluate.engine_acceptance",
    DeprecationWarning,
    stacklevel=2,
)
_NEW = importlib.import_module("dflash_pipeline.evaluate.engine_acceptance")


def __getattr__(name):
    return getattr(_NEW, name)
