"""Light helpers for the Snakemake side (no torch import, so `snakemake -n` stays fast)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Iterator, Optional


def accelerate_launch_args(num_processes: int, mixed_precision: str = "no") -> list[str]:
    """Arguments for ``accelerate launch`` (reference/feasibility.md §3).

    One process: a plain single-process launch (GPU if present, else CPU). Several: ``--multi_gpu``,
    which on a CPU-only machine gives real gloo ranks because the training script builds
    ``Accelerator(cpu=not torch.cuda.is_available())`` (plain ``--cpu`` would silently run ONE process).
    """
    args = ["--num_machines", "1", "--num_processes", str(num_processes), "--mixed_precision", mixed_precision, "--dynamo_backend", "no"]
    if num_processes > 1:
        args = ["--multi_gpu"] + args
    return args


@contextlib.contextmanager
def log_to(path: Optional[str | os.PathLike], threads: Optional[int] = None) -> Iterator[None]:
    """Send stdout/stderr and the ``logging`` root to ``path`` (a Snakemake ``log:`` file) for a block,
    and cap torch's intra-op threads at ``threads`` (the rule's ``threads``)."""
    if threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(threads))
    if not path:
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", buffering=1) as fh:
        handler = logging.StreamHandler(fh)
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)
        with contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
            try:
                yield
            finally:
                logging.getLogger().removeHandler(handler)
