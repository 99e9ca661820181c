"""Deprecated: ``dflash_pipeline.model`` moved to :mod:`dflash_pipeline.drafter.model` (kept for one release)."""

import importlib
import warnings

warnings.warn(
    "dflash_pipeline.model is deprecated; import dflash_pipeline.drafter.model", DeprecationWarning, stacklevel=2
)
_NEW = importlib.import_module("dflash_pipeline.drafter.model")


def __getattr__(name):
    return getattr(_NEW, name)
