"""What a training run leaves on disk besides its logs: Accelerate state for resume (`state/`) and servable
drafter exports (`final/`, `step_<N>/`), each written atomically (temp dir + rename). Only the same run
resumes a state (`resume_state`, `run_identity`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Optional

from dflash_pipeline.core.config import schema_defaults
from dflash_pipeline.core.shards import replace_dir
from dflash_pipeline.drafter import model as M
from dflash_pipeline.train import fsdp as FS
from dflash_pipeline.train.rng import STATE_VERSION

#: Intermediate drafter exports live in `<out_dir>/step_<N>/` (N zero-padded to 6 digits).
STEP_EXPORT_PREFIX = "step_"


#: `train` keys that do not change what is trained (how often it logs, saves and measures held-out τ, where
#: its trackers and rendezvous live): a resume under other values of these is the same run.
NOT_RUN_IDENTITY = frozenset(
    {
        "log_every_steps",
        "save_every_steps",
        "trackers",
        "tracker_project",
        "trace_batches",
        "validation_every_steps",
        "validation_num_anchors",
        "validation_max_records",
        "main_process_ip",
        "main_process_port",
        "gradient_checkpointing",  # the same values recomputed, bit for bit
        "loss_chunk_tokens",  # how many logits are formed at once, not which
        "device_memory_gb",  # a planning bound
    }
)


def file_digest(path: str | Path) -> str:
    """sha256 (hex) of a file's bytes, read in 1 MiB chunks.

    Raises:
        OSError: the file cannot be read (FileNotFoundError names the path).
    """
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def run_identity(cfg: dict, *, token_shards, **facts) -> dict:
    """What makes a training run this run, saved with its state (`step.json["run"]`) and compared on resume: the
    `train` settings except `NOT_RUN_IDENTITY`, the content digest of every token shard in order, and `facts`.
    Every rank computes it, reading each token shard once (~1 GB/s).

    Raises:
        OSError: a token shard cannot be read.
    """
    return {
        "train": {k: v for k, v in json.loads(json.dumps(cfg)).items() if k not in NOT_RUN_IDENTITY},
        "token_shards": [file_digest(p) for p in token_shards],
        **json.loads(json.dumps(facts)),
    }


def save_state(accelerator, state_dir: Path, step: int, identity: Optional[dict] = None) -> None:
    """Save Accelerate state (model, optimizer, scheduler, RNG streams) and `step.json`, atomically."""
    tmp = state_dir.with_name(state_dir.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        meta = {"step": step, "version": STATE_VERSION, "world_size": accelerator.num_processes}
        (tmp / "step.json").write_text(json.dumps({**meta, "run": identity} if identity else meta))
        replace_dir(tmp, state_dir)
    accelerator.wait_for_everyone()


def resume_state(accelerator, out_dir: Path, total_steps: int, streams, identity: Optional[dict] = None) -> int:
    """Load `state/` when it is this run's and return its step; on a fresh start clear the old logs and exports.

    Registers `streams` (`RankStreams`) for checkpointing. A state of another run (`run_identity` differs:
    settings, data, dtype, drafter) moves to `state.previous/` and the run starts from step 0, saying which
    parts differ. A version-1 state resumes without streams and identity, with a warning.

    Raises:
        ValueError: `state/` was written by a newer trainer (version above `STATE_VERSION`), or by
            another number of ranks."""
    state_dir = out_dir / "state"
    step = 0
    meta = json.loads((state_dir / "step.json").read_text()) if (state_dir / "step.json").is_file() else None
    changed = _changed_parts(meta.get("run") if meta else None, identity)
    if meta is not None and changed:
        accelerator.print(
            f"[train] {state_dir} was saved by another run ({', '.join(changed)} differ): starting from step 0; "
            f"that state moves to {state_dir.name}.previous/"
        )
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            replace_dir(state_dir, state_dir.with_name(state_dir.name + ".previous"))
        accelerator.wait_for_everyone()
        meta = None
    if meta is None:
        accelerator.register_for_checkpointing(streams)
    else:
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
    if accelerator.is_main_process and step == 0:
        (out_dir / "train_log.jsonl").unlink(missing_ok=True)
        (out_dir / "val_log.jsonl").unlink(missing_ok=True)
        shutil.rmtree(out_dir / "trackers", ignore_errors=True)
        for old in out_dir.glob(f"{STEP_EXPORT_PREFIX}*"):  # intermediate exports of an earlier run
            shutil.rmtree(old, ignore_errors=True)
    return step


def _changed_parts(saved: Optional[dict], current: Optional[dict]) -> list[str]:
    """The parts of two `run_identity` records that differ (`train.<key>` per setting, else the part's
    name); none when either is unknown (a version 1 state, a direct call without one). A `train` key one side
    lacks counts as its schema default."""
    if not saved or not current:
        return []
    out = []
    defaults = schema_defaults("train")
    for part in sorted(set(saved) | set(current)):
        a, b = saved.get(part), current.get(part)
        if part == "train" and isinstance(a, dict) and isinstance(b, dict):
            out += [
                f"train.{k}" for k in sorted(set(a) | set(b)) if a.get(k, defaults.get(k)) != b.get(k, defaults.get(k))
            ]
        elif a != b:
            out.append(part)
    return out


def export_module(accelerator, drafter):
    """The drafter to export, on the main process (None elsewhere): the unwrapped module, or under FSDP
    the gathered full copy (collective: every rank calls this)."""
    if accelerator.is_fsdp2:
        return FS.full_drafter(accelerator, drafter)
    return accelerator.unwrap_model(drafter) if accelerator.is_main_process else None


def export_step(drafter, out_dir: Path, step: int, zero_target_features: bool = False) -> Path:
    """Export the drafter at `step` as a servable checkpoint `<out_dir>/step_<N>/` (atomic), so the
    eval stage can chart τ across training (`evaluate.step_checkpoints` finds them)."""
    final = out_dir / f"{STEP_EXPORT_PREFIX}{step:06d}"
    return export_drafter(drafter, final, extra={"train_steps": step, "zero_target_features": zero_target_features})


def export_drafter(drafter, final: Path, *, extra: dict, target: Optional[Path] = None) -> Path:
    """Write `drafter` (bf16, `drafter.model.save_drafter` with `extra` in its config)
    and its `serve.md` (naming `target` when given) to `<final>.tmp`, then rename it to `final`."""
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    M.save_drafter(drafter, tmp, extra=extra)
    _write_serve_md(tmp, target=target, served_dir=final)
    replace_dir(tmp, final)
    return final


def _write_serve_md(export_dir: Path, target=None, served_dir=None) -> None:
    """`<export>/serve.md`: the vLLM and SGLang launch lines of this export (`engine.write_serve_md`);
    `served_dir`: where `export_dir` (a temp dir) is renamed to."""
    from dflash_pipeline.evaluate import write_serve_md

    write_serve_md(export_dir, target=target, served_dir=served_dir)
