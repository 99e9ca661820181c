"""Deprecated: ``dflash_pipeline.chat`` moved to :mod:`dflash_pipeline.target.chat` (kept for one release)."""

import importlib
import warnings

warnings.warn(
    "dflash_pipeline.chat is deprecated; import dflash_pipeline.target.chat", DeprecationWarning, stacklevel=2
)
_NEW = importlib.import_module("dflash_pipeline.target.chat")


def __getattr__(name):
    return getattr(_NEW, name)
