"""What a training run leaves on disk besides its logs: Accelerate state for resume (``state/``) and servable
drafter exports (``final/``, ``step_<N>/``), each written atomically (temp dir + rename).

A killed run restarts at its last saved state (:func:`resume_state`); an export is the layout SGLang/vLLM
load (:func:`dflash_pipeline.drafter.model.save_drafter`) plus its ``serve.md``. Driven by
:mod:`dflash_pipeline.train.run`, which re-exports these names.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

from dflash_pipeline.core.shards import replace_dir
from dflash_pipeline.drafter import model as M
from dflash_pipeline.train import fsdp as FS
from dflash_pipeline.train.rng import STATE_VERSION

#: Intermediate drafter exports live in ``<out_dir>/step_<N>/`` (N zero-padded to 6 digits).
STEP_EXPORT_PREFIX = "step_"


def save_state(accelerator, state_dir: Path, step: int, train_config: Optional[dict] = None) -> None:
    """Save Accelerate state (model, optimizer, scheduler, RNG streams) and ``step.json`` (the step, the
    state :data:`~dflash_pipeline.train.rng.STATE_VERSION`, the world size and ``train_config``, the
    run's ``train`` settings, which :func:`resume_state` compares), atomically."""
    tmp = state_dir.with_name(state_dir.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        meta = {"step": step, "version": STATE_VERSION, "world_size": accelerator.num_processes}
        (tmp / "step.json").write_text(json.dumps({**meta, "train_config": train_config} if train_config else meta))
        replace_dir(tmp, state_dir)
    accelerator.wait_for_everyone()


def resume_state(accelerator, out_dir: Path, total_steps: int, streams, train_config: Optional[dict] = None) -> int:
    """Load ``state/`` when present and return its step; on a fresh start clear the old logs and exports.

    ``streams`` (:class:`dflash_pipeline.train.rng.RankStreams`, the anchor generators) is registered
    for checkpointing here, so every later :func:`save_state` holds it. A state of version 1 (saved before
    the streams were, no ``version`` in ``step.json``) is loaded without them: it resumes, but the data order
    and anchors after it are not the uninterrupted run's (a warning says so). A state saved under other
    ``train`` settings than ``train_config`` resumes too (more epochs continue a run), with a warning that
    names the keys that differ.

    Raises:
        ValueError: ``state/`` was written by a newer trainer (version above :data:`STATE_VERSION`), or by
            another number of ranks (:meth:`RankStreams.load_state_dict`).
    """
    state_dir = out_dir / "state"
    step = 0
    if not (state_dir / "step.json").is_file():
        accelerator.register_for_checkpointing(streams)
    else:
        meta = json.loads((state_dir / "step.json").read_text())
        version = int(meta.get("version", 1))
        if version > STATE_VERSION:
            raise ValueError(
                f"{state_dir}: state version {version} is newer than this trainer's ({STATE_VERSION}); "
                "upgrade dflash-pipeline, or delete state/ to restart from step 0"
            )
        if version == STATE_VERSION:
            accelerator.register_for_checkpointing(streams)
        accelerator.load_state(str(state_dir))
        if version < STATE_VERSION:
            accelerator.register_for_checkpointing(streams)
            accelerator.print(
                f"[train] warning: {state_dir} is a version {version} state (saved before the data order "
                "and anchor streams were): resuming, but this run will not match an uninterrupted one"
            )
        step = meta["step"]
        accelerator.print(f"[train] resumed from {state_dir} at step {step}/{total_steps}")
        changed = _changed_keys(meta.get("train_config"), train_config)
        if changed:
            accelerator.print(
                f"[train] warning: {state_dir} was saved under other train settings ({', '.join(changed)}): "
                "the resumed run is not the run these settings give from step 0 (delete state/ for that)"
            )
    if accelerator.is_main_process and step == 0:
        (out_dir / "train_log.jsonl").unlink(missing_ok=True)
        (out_dir / "val_log.jsonl").unlink(missing_ok=True)
        shutil.rmtree(out_dir / "trackers", ignore_errors=True)
        for old in out_dir.glob(f"{STEP_EXPORT_PREFIX}*"):  # intermediate exports of an earlier run
            shutil.rmtree(old, ignore_errors=True)
    return step


def _changed_keys(saved: Optional[dict], current: Optional[dict]) -> list[str]:
    """The ``train`` keys whose values differ between a state's settings and this run's (none when either is
    unknown), compared as JSON."""
    if not saved or not current:
        return []
    now = json.loads(json.dumps(current))
    return sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))


def export_module(accelerator, drafter):
    """The drafter to export, on the main process (None elsewhere): the unwrapped module, or under FSDP
    the gathered full copy (collective: every rank calls this)."""
    if accelerator.is_fsdp2:
        return FS.full_drafter(accelerator, drafter)
    return accelerator.unwrap_model(drafter) if accelerator.is_main_process else None


def export_step(drafter, out_dir: Path, step: int, zero_target_features: bool = False) -> Path:
    """Export the drafter at ``step`` as a servable checkpoint ``<out_dir>/step_<N>/`` (atomic), so the
    eval stage can chart τ across training (``evaluate.step_checkpoints`` finds them)."""
    final = out_dir / f"{STEP_EXPORT_PREFIX}{step:06d}"
    return export_drafter(drafter, final, extra={"train_steps": step, "zero_target_features": zero_target_features})


def export_drafter(drafter, final: Path, *, extra: dict, target: Optional[Path] = None) -> Path:
    """Write ``drafter`` (bf16, :func:`dflash_pipeline.drafter.model.save_drafter` with ``extra`` in its config)
    and its ``serve.md`` (naming ``target`` when given) to ``<final>.tmp``, then rename it to ``final``."""
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    M.save_drafter(drafter, tmp, extra=extra)
    _write_serve_md(tmp, target=target, served_dir=final)
    replace_dir(tmp, final)
    return final


def _write_serve_md(export_dir: Path, target=None, served_dir=None) -> None:
    """``<export>/serve.md``: the vLLM and SGLang launch lines of this export (``engine.write_serve_md``);
    ``served_dir``: where ``export_dir`` (a temp dir) is renamed to."""
    from dflash_pipeline.evaluate import write_serve_md

    write_serve_md(export_dir, target=target, served_dir=served_dir)
