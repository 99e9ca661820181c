"""The step loop of a training run (`train.run.train` builds the run and calls `run_steps`):
optimizer steps over accumulated micro-steps, each followed by its `train_log.jsonl` window, held-out validation and
periodic saves. The state they share is a `TrainRun`.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from dflash_pipeline.drafter import families as FR
from dflash_pipeline.drafter import model as M
from dflash_pipeline.target import loading as T
from dflash_pipeline.train import heldout as V
from dflash_pipeline.train import trackers as TR
from dflash_pipeline.train.checkpoint import export_module, export_step, save_state
from dflash_pipeline.train.data import TrainingData
from dflash_pipeline.train.step import StepContext, step_objective

# --- The run's state


@dataclass
class RunData:
    """What a run trains and validates on (opened by `train.run.train`): `records` (the training split of
    `source.dataset`, a `Subset`), `heldout` (the held-out records, a list), `source` and the frozen `target` (None with
    feature shards)."""

    records: Any
    heldout: list
    source: TrainingData
    target: Any = None

    @property
    def target_dtype(self) -> torch.dtype:
        """The dtype the target (or, with feature shards, its LM head) runs in."""
        return T.module_dtype(self.target if self.target is not None else self.source.lm_head)


@dataclass
class Schedule:
    """The run's length, per rank (Accelerate shards the loader evenly): micro-batches per epoch,
    micro-batches per optimizer step (`accum`), optimizer steps per epoch and in all, warmup steps."""

    micro_per_epoch: int
    accum: int
    steps_per_epoch: int
    total_steps: int
    warmup: int

    @classmethod
    def of(cls, num_rows: int, cfg: dict, num_processes: int) -> "Schedule":
        """From `num_rows` training rows and `train.{batch_size, gradient_accumulation_steps, epochs, warmup_ratio}`."""
        accum = cfg["gradient_accumulation_steps"]
        micro_per_epoch = math.ceil(num_rows / (cfg["batch_size"] * num_processes))
        steps_per_epoch = math.ceil(micro_per_epoch / accum)
        total_steps = max(1, math.ceil(cfg["epochs"] * steps_per_epoch))
        return cls(micro_per_epoch, accum, steps_per_epoch, total_steps, int(cfg["warmup_ratio"] * total_steps))


@dataclass
class TrainRun:
    """One run's state, built once by `train.run.train` and read by the loop's steps
    (instead of long argument lists). `drafter`, `optimizer` and `loader` are Accelerate-prepared
    (`ctx.drafter` is the same `drafter`); `num_rows`: training rows (packed or not); `val_batches`
    / `val_counted`: this rank's held-out batches and whether each one counts."""

    accelerator: Any
    cfg: dict
    out_dir: Path
    data: RunData
    schedule: Schedule
    num_rows: int
    n_trainable: int
    drafter: Any
    optimizer: Any
    scheduler: Any
    loader: Any
    ctx: StepContext
    val_batches: list
    val_counted: list
    zero_target_features: bool
    rng_streams: Any = None  # train.rng.RankStreams: the per-rank random streams state/ keeps
    identity: Optional[dict] = None  # train.checkpoint.run_identity: what makes this run this run (in state/)


# --- The step loop


def run_steps(run: TrainRun, step: int) -> int:
    """Optimizer steps from `step` to the schedule's total; returns the last step. Each epoch reshuffles
    the loader (`set_epoch`) and, in the epoch a resumed run restarts in, skips the micro-batches the
    saved steps consumed; an epoch's last optimizer step takes the micro-batches left over."""
    acc, sch = run.accelerator, run.schedule
    window = _Window(run.ctx.block_size)
    run_t0, start_step = time.time(), step
    bar = TR.progress_bar(sch.total_steps, step, disable=not (acc.is_main_process and sys.stderr.isatty()))
    run.drafter.train()
    while step < sch.total_steps:
        epoch = step // sch.steps_per_epoch
        run.loader.set_epoch(epoch)
        skip = (step - epoch * sch.steps_per_epoch) * sch.accum
        batches = iter(acc.skip_first_batches(run.loader, skip) if skip else run.loader)
        if run.data.source.stream is not None:  # train.target_features: stream fills each batch's features
            batches = run.data.source.stream.batches(batches)
        left = sch.micro_per_epoch - skip
        while left > 0 and step < sch.total_steps:
            n_micro = min(sch.accum, left)
            loss = _stream_guarded_step(run, batches, n_micro, step, window)
            left -= n_micro
            step += 1
            bar.update(1)
            window.loss += loss
            window.n += 1
            window = _after_step(run, step, epoch, window, run_t0=run_t0, start_step=start_step)
    bar.close()
    return step


def _stream_guarded_step(run: TrainRun, batches, n_micro: int, step: int, window: "_Window") -> float:
    """`_optimizer_step`; when the feature servers fail for good, the state of the `step` steps done is saved first
    (a rerun resumes there exactly), then the error is raised."""
    if run.data.source.stream is None:
        return _optimizer_step(run, batches, n_micro, step, window)
    from dflash_pipeline.features import StreamError

    try:
        return _optimizer_step(run, batches, n_micro, step, window)
    except StreamError as exc:
        run.optimizer.zero_grad(set_to_none=True)  # the partial accumulation of this step is dropped
        save_state(run.accelerator, run.out_dir / "state", step, run.identity)
        run.data.source.stream.close()
        run.accelerator.print(
            f"[stream] feature servers failed at step {step}; state saved at step {step} (rerun to resume): {exc}"
        )
        raise


def _optimizer_step(run: TrainRun, batches, n_micro: int, step: int, window: "_Window") -> float:
    """One optimizer step over the next `n_micro` micro-batches of `batches`; returns its global loss
    (Σ terms / Σ normaliser over ranks and micro-steps, a float).

    Each micro-step backpropagates its unnormalised objective (`step_objective`; gradients sync on
    the last one only) and adds its stats to `window`; the gradients are then multiplied by
    world_size / Σ normaliser (DDP/FSDP average over ranks), clipped to `train.max_grad_norm` and applied.
    """
    acc, drafter = run.accelerator, run.drafter
    norm = torch.zeros((), dtype=torch.float32, device=acc.device)
    total = torch.zeros((), dtype=torch.float32, device=acc.device)
    for j in range(n_micro):
        batch = next(batches)
        if run.cfg["trace_batches"]:
            trace_batch(run.out_dir, acc.process_index, step, batch)
        out = step_objective(run.ctx, batch)
        sync = contextlib.nullcontext() if j == n_micro - 1 else acc.no_sync(drafter)
        with sync:
            acc.backward(out.total)
        norm += out.normalizer.to(norm.device)
        total += out.total.detach().to(total.device)
        window.add(None, out.stats, int(batch["attention_mask"].sum()))
    sums = acc.reduce(torch.stack([norm, total]), "sum")  # global Σ normaliser, Σ terms
    scale = acc.num_processes / float(sums[0].clamp(min=1e-12))
    for prm in drafter.parameters():
        if prm.grad is not None:
            prm.grad.mul_(scale)
    acc.clip_grad_norm_(drafter.parameters(), run.cfg["max_grad_norm"])
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return float(sums[1] / sums[0].clamp(min=1e-12))


def _after_step(
    run: TrainRun, step: int, epoch: int, window: "_Window", *, run_t0: float, start_step: int
) -> "_Window":
    """What follows optimizer step `step`: a `train_log.jsonl` line every `log_every_steps` and at the
    end (then a fresh window, returned), held-out validation every `validation_every_steps` and at the
    end, state + a `step_<N>/` export every `save_every_steps` (the last step is saved by `_finish`)."""
    acc, cfg, sch = run.accelerator, run.cfg, run.schedule
    if step % cfg["log_every_steps"] == 0 or step == sch.total_steps:
        stream = run.data.source.stream
        _log_window(
            acc,
            window,
            step=step,
            total_steps=sch.total_steps,
            epoch=epoch,
            lr=run.scheduler.get_last_lr()[0],
            log_path=run.out_dir / "train_log.jsonl",
            run_t0=run_t0,
            start_step=start_step,
            extra=stream.window_stats() if stream is not None else None,
        )
        window = _Window(run.ctx.block_size)
    if run.val_batches and (step % cfg["validation_every_steps"] == 0 or step == sch.total_steps):
        _validate(acc, run.ctx, run.val_batches, run.val_counted, cfg, step, run.out_dir)
    if step % cfg["save_every_steps"] == 0 and step < sch.total_steps:
        save_state(acc, run.out_dir / "state", step, run.identity)
        module = export_module(acc, run.drafter)
        if acc.is_main_process:
            export_step(module, run.out_dir, step, run.zero_target_features)
    return window


@dataclass
class _Window:
    """Running totals between two log lines (loss per optimizer step; slot counts and tokens per micro-step)."""

    block_size: int
    loss: float = 0.0
    n: int = 0
    tokens: int = 0
    correct: torch.Tensor = None
    total: torch.Tensor = None
    t0: float = field(default_factory=time.time)

    def __post_init__(self):
        self.correct = torch.zeros(self.block_size)
        self.total = torch.zeros(self.block_size)

    def add(self, loss: Optional[float], stats: dict, tokens: int) -> None:
        """One micro-step's stats and tokens; `loss` (the optimizer step's global loss) when not None."""
        c, t = M.slot_accuracy(stats, self.block_size)
        if loss is not None:
            self.loss += loss
            self.n += 1
        self.correct += c
        self.total += t
        self.tokens += tokens


def _log_window(
    accelerator,
    w: _Window,
    *,
    step: int,
    total_steps: int,
    epoch: int,
    lr: float,
    log_path: Path,
    run_t0: float,
    start_step: int,
    extra: Optional[dict] = None,
) -> dict:
    """Reduce the window's slot counts over ranks, append one `train_log.jsonl` record and log it to the trackers
    (main rank); the `[train]` line carries the ETA. `extra`: more fields of the record. Returns the record."""
    totals = accelerator.reduce(torch.stack([w.correct, w.total]).to(accelerator.device), "sum").cpu()
    tokens = int(accelerator.reduce(torch.tensor(float(w.tokens), device=accelerator.device), "sum"))
    acc = (totals[0] / totals[1].clamp(min=1)).tolist()
    elapsed = time.time() - w.t0
    per_step = (time.time() - run_t0) / max(1, step - start_step)
    rec = {
        "step": step,
        "epoch": epoch,
        "loss": w.loss / max(1, w.n),
        "lr": lr,
        "slot_acc": acc,
        "eal": M.expected_acceptance_length(acc),
        "tokens_per_s": tokens / max(1e-9, elapsed),
        "elapsed_s": elapsed,
        "eta_s": per_step * (total_steps - step),
        **(extra or {}),
    }
    if accelerator.is_main_process:
        with open(log_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec) + "\n")
        eta = time.strftime("%H:%M:%S", time.gmtime(rec["eta_s"]))
        print(
            f"[train] step {step}/{total_steps} loss {rec['loss']:.4f} eal {rec['eal']:.2f} acc1 {acc[1]:.3f} "
            f"tok/s {rec['tokens_per_s']:.0f} eta {eta}",
            flush=True,
        )
    accelerator.log(TR.scalars(rec, "train"), step=step)
    return rec


def trace_batch(out_dir: Path, rank: int, step: int, batch: dict) -> None:
    """Append `{step, batch: sha1 of the input ids}` to `trace/rank{rank}.jsonl` (data-parallel checks)."""
    import hashlib

    path = out_dir / "trace" / f"rank{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha1(batch["input_ids"].cpu().numpy().tobytes()).hexdigest()
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"step": step, "batch": digest}) + "\n")


# --- Held-out validation


def _validate(accelerator, ctx: StepContext, batches, counted, cfg: dict, step: int, out_dir: Path) -> Optional[dict]:
    """Held-out per-block acceptance (dflash_pipeline.train.heldout) at `step`: appended to `val_log.jsonl`,
    logged to the trackers and printed (main rank)."""
    if not batches:
        return None
    d = ctx.probe["drafter"]
    edges = cfg.get("validation_length_buckets") or ()
    core = getattr(ctx.drafter, "module", ctx.drafter)
    total = V.AcceptanceCounts.zeros(FR.of_drafter(core).acceptance_slots(ctx.block_size), edges)
    core.eval()
    try:
        for batch, count in zip(batches, counted):
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            c = V.batch_acceptance(
                ctx.drafter,
                ctx.target,
                ctx.embed,
                ctx.lm_head,
                batch,
                target_layer_ids=d["target_layer_ids"],
                features=batch.get("features"),
                mask_token_id=d["mask_token_id"],
                num_anchors=cfg["validation_num_anchors"],
                backend=ctx.backend,
                length_buckets=edges,
            )
            if count:
                total = total + c
    finally:
        core.train()
    reduced = accelerator.reduce(total.as_tensor().to(accelerator.device), "sum")
    summary = V.AcceptanceCounts.from_tensor(reduced, edges).summary()
    rec = {"step": step, **summary}
    if accelerator.is_main_process:
        with open(out_dir / "val_log.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec) + "\n")
        pp = " ".join(f"{x:.2f}" for x in summary["per_position_acceptance"])
        print(
            f"[val] step {step} tau {summary['tau']:.3f} (marginal proxy {summary['tau_marginal']:.3f}) "
            f"blocks {summary['num_blocks']} per-position {pp}"
            + "".join(
                f" | {b}: tau {v['tau']:.3f} ({v['num_blocks']} blocks)"
                for b, v in (summary.get("by_context_length") or {}).items()
            ),
            flush=True,
        )
    accelerator.log(TR.scalars(summary, "val"), step=step)
    return rec
