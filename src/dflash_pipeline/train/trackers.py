"""Experiment trackers and the progress bar of the trainer (Accelerate `log_with`).

TensorBoard is the default: offline event files under `<run_dir>/trackers/<project>/`. wandb and trackio are used only
when installed *and* configured (named in `train.trackers`; wandb also needs `WANDB_API_KEY` or `WANDB_MODE=offline`);
otherwise they are skipped with a note, never a crash. The JSONL log (`train_log.jsonl`) is always written.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Mapping, Optional, Sequence

#: Trackers `train.trackers` accepts.
TRACKERS = ("tensorboard", "wandb", "trackio")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def resolve_trackers(
    requested: Sequence[str], env: Optional[Mapping[str, str]] = None, installed=_installed
) -> tuple[list[str], list[str]]:
    """Which of `requested` trackers to hand to `Accelerator(log_with=…)`, and a note per skipped one.

    Args:
        requested: names from `train.trackers` (subset of `TRACKERS`).
        env: environment (default `os.environ`); installed: `module name -> bool`.
    Returns:
        `(use, notes)`.
    Raises:
        ValueError: an unknown tracker name.
    """
    env = os.environ if env is None else env
    use, notes = [], []
    for name in requested:
        if name not in TRACKERS:
            raise ValueError(f"train.trackers: unknown tracker {name!r}; expected some of {', '.join(TRACKERS)}")
        if name == "tensorboard":
            if installed("tensorboard") or installed("tensorboardX"):
                use.append(name)
            else:
                notes.append("tensorboard is not installed (pip install -e '.[trackers]'); TensorBoard logging skipped")
        elif name == "wandb":
            mode = env.get("WANDB_MODE", "")
            if not installed("wandb"):
                notes.append("wandb is not installed; wandb logging skipped")
            elif mode == "disabled":
                notes.append("WANDB_MODE=disabled; wandb logging skipped")
            elif env.get("WANDB_API_KEY") or mode in ("offline", "dryrun"):
                use.append(name)
            else:
                notes.append(
                    "wandb is not configured (set WANDB_API_KEY, or WANDB_MODE=offline); wandb logging skipped"
                )
        elif name == "trackio":
            if installed("trackio"):
                use.append(name)
            else:
                notes.append("trackio is not installed; trackio logging skipped")
    return use, notes


def flat_hparams(cfg: Mapping, prefix: str = "") -> dict:
    """A nested config as flat `{"a.b": scalar}` for tracker hyper-parameters (TensorBoard `add_hparams`
    takes bool/int/float/str only): lists become JSON strings, None becomes `"null"`."""
    out: dict = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flat_hparams(v, key + "."))
        elif v is None:
            out[key] = "null"
        elif isinstance(v, (bool, int, float, str)):
            out[key] = v
        else:
            out[key] = json.dumps(v, default=str)
    return out


def scalars(record: Mapping, prefix: str) -> dict[str, float]:
    """Numbers of a log record as tracker scalars `prefix/name`; lists become `prefix/name/<i>`
    (e.g. per-position acceptance `val/per_position_acceptance/1` for slot 1)."""
    out: dict[str, float] = {}
    for k, v in record.items():
        if isinstance(v, bool) or k == "step":
            continue
        if isinstance(v, (int, float)):
            out[f"{prefix}/{k}"] = float(v)
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v):
            base = 1 if k in ("per_position_acceptance",) else 0
            for i, x in enumerate(v):
                out[f"{prefix}/{k}/{i + base}"] = float(x)
    return out


def progress_bar(total: int, initial: int, disable: bool):
    """tqdm bar over optimizer steps (rate and ETA; starts at `initial` on resume), on stderr so the
    `[train]` lines on stdout stay parseable. `disable` on non-main ranks."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the bar is optional (the [train] lines carry the ETA)
        return _NoBar()
    return tqdm(
        total=total,
        initial=initial,
        disable=disable,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
        mininterval=1.0,
    )


class _NoBar:
    """Stand-in for a disabled tqdm bar."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass
