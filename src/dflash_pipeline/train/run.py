"""Train a DFlash drafter with HF Accelerate from a frozen target's features: the target run online
(`train.target_features: online`), or its feature shards read from disk (`shards`).

Launched by the `train_drafter` rule as `accelerate launch … -m dflash_pipeline.train …`. Method:
reference/dflash.md §4 (anchors, block mask, labels, decayed CE), §4.7 (optimizer, schedule, fp32 master
weights under bf16 autocast), §5.3 (online target features).

`train` reads top to bottom as the run's steps: Accelerate → data → drafter, optimizer, scheduler, loader
(`accelerator.prepare` into a `.loop.TrainRun`) → resume from `state/` → the step loop
(`.loop.run_steps`) → export. One step's objective is `.step`; state and exports `.checkpoint`.

Outputs under `out_dir`: `final/` (servable checkpoint, atomic), `state/` (for resume), `train_log.jsonl`,
`val_log.jsonl` (held-out τ per validation), `val_tau.png`, `trackers/`, `train_summary.json` and
`step_<N>/` (a servable export at every state save).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from dflash_pipeline.core.config import schema_defaults
from dflash_pipeline.core.procs import die_with_parent
from dflash_pipeline.core.provenance import provenance
from dflash_pipeline.core.shards import read_parquet, write_json
from dflash_pipeline.drafter import attention_masks as AM
from dflash_pipeline.drafter import families as FR
from dflash_pipeline.drafter import model as M
from dflash_pipeline.drafter.build import build_drafter  # train.run.build_drafter: the name tests and benches use
from dflash_pipeline.target import loading as T
from dflash_pipeline.train import data as train_data
from dflash_pipeline.train import fsdp as FS
from dflash_pipeline.train import heldout as V
from dflash_pipeline.train import optim as OPT
from dflash_pipeline.train import packing as P
from dflash_pipeline.train import rng as RS
from dflash_pipeline.train import trackers as TR
from dflash_pipeline.train.checkpoint import (  # noqa: F401 - STEP_EXPORT_PREFIX, export_step re-exported
    STEP_EXPORT_PREFIX,
    export_drafter,
    export_module,
    export_step,
    resume_state,
    run_identity,
    save_state,
)
from dflash_pipeline.train.loop import RunData, Schedule, TrainRun, run_steps, trace_batch  # noqa: F401 - trace_batch re-exported
from dflash_pipeline.train.step import StepContext, step_objective, target_features, training_step  # noqa: F401 - re-exported

# --- Data


def load_token_shards(
    paths: Sequence[str | Path], *, min_loss_tokens: int = train_data.MIN_LOSS_TOKENS
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Read token shards eagerly into `(input_ids int32 [S], loss_mask uint8 [S])` pairs, in path order.

    Not the trainer's path; kept as the baseline of `bench/bench_features.py` / `bench/bench_train.py` and for small
    in-memory uses. Records with fewer than `min_loss_tokens` supervised tokens are skipped.
    """
    out = []
    for p in paths:
        table = read_parquet(p)
        for i, m in zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()):
            if sum(m) >= min_loss_tokens:
                out.append((np.asarray(i, dtype=np.int32), np.asarray(m, dtype=np.uint8)))
    return out


def with_schema_defaults(cfg: dict) -> dict:
    """`cfg` (the `train` section) with every key it lacks taken from the config schema's defaults."""
    return {**schema_defaults("train"), **cfg}


def collate(batch, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad a list of (input_ids, loss_mask) to `input_ids`/`loss_mask`/`attention_mask` [b, S_max]."""
    s = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), s), pad_id, dtype=torch.long)
    lm = torch.zeros((len(batch), s), dtype=torch.uint8)
    am = torch.zeros((len(batch), s), dtype=torch.long)
    for r, (i, m) in enumerate(batch):
        ids[r, : len(i)] = torch.from_numpy(i.astype(np.int64))
        lm[r, : len(m)] = torch.from_numpy(m)
        am[r, : len(i)] = 1
    return {"input_ids": ids, "loss_mask": lm, "attention_mask": am}


# --- Target (the drafter is built by dflash_pipeline.drafter.build.build_drafter)

load_target = T.load_target  # one loader for every family (dflash_pipeline.target.loading); re-exported here


# --- The run: train() and the steps it reads as


def train(
    *,
    token_shards: Sequence[str | Path],
    probe: dict,
    target_dir: str | Path,
    out_dir: str | Path,
    cfg: dict,
    target_dtype: str = "auto",
    trust_remote_code: bool = False,
    zero_target_features: bool = False,
    drafter_arch: Optional[dict] = None,
    device: str = "auto",
    feature_shards: Sequence[str | Path] = (),
    stream: Optional[dict] = None,
) -> dict:
    """Train the drafter; outputs in the module docstring. Returns the summary dict (also written to
    `train_summary.json`).

    `cfg` is the validated `train` config (`with_schema_defaults`). `target_dtype` / `trust_remote_code`:
    `target.dtype` / `target.trust_remote_code`. `device`: `train.device` (kept out of `cfg`, the rule's
    rerun fingerprint). `feature_shards` (one per token shard, same order) are read when
    `cfg["target_features"]` is `shards`; `stream` holds the settings for `stream`; in both the target is
    never instantiated. `drafter_arch`: the optional `layer_types`/`sliding_window`. `zero_target_features`
    trains the ablation baseline with all-zero fused features.

    Gradients: each micro-step backpropagates its unnormalised objective; after
    `gradient_accumulation_steps` micro-steps they are multiplied by world_size / Σ normaliser (over ranks
    and micro-steps), so the update is that of the global Σ terms / Σ normaliser.

    Raises:
        ValueError: no token record has an anchor candidate; `train.packing` with a target that does
            not keep packed records apart."""
    cfg = with_schema_defaults(cfg)
    out_dir = Path(out_dir)
    accelerator, log_with = _start_run(cfg, out_dir, device)
    data = _open_data(
        accelerator,
        cfg,
        probe,
        token_shards,
        feature_shards,
        target_dir=target_dir,
        out_dir=out_dir,
        target_dtype=target_dtype,
        trust_remote_code=trust_remote_code,
        stream=stream,
    )
    run = _prepare_run(accelerator, cfg, out_dir, data, probe, drafter_arch or {}, zero_target_features)
    run.identity = run_identity(
        cfg,
        token_shards=token_shards,
        target_dtype=target_dtype,
        drafter=probe.get("drafter"),
        drafter_arch=drafter_arch or {},
        zero_target_features=bool(zero_target_features),
    )
    step = resume_state(accelerator, out_dir, run.schedule.total_steps, run.rng_streams, run.identity)
    if log_with:
        accelerator.init_trackers(
            cfg["tracker_project"], config=TR.flat_hparams({**cfg, "zero_target_features": zero_target_features})
        )
    accelerator.print(_describe(run))
    step = run_steps(run, step)
    if accelerator.is_main_process:
        from dflash_pipeline.evaluate import plot_validation

        plot_validation(out_dir / "val_log.jsonl", out_dir / "val_tau.png")
    return _finish(run, step, target_dir, _summary(run, log_with, target_dir))


def make_accelerator(
    mixed_precision: str,
    device: str = "auto",
    *,
    fsdp: bool = False,
    fsdp_reshard_after_forward: bool = True,
    out_dir: Optional[Path] = None,
    log_with: Optional[list] = None,
    data_seed: int = 0,
):
    """The run's `Accelerator`: CPU when `device` (`train.device`) is `cpu` or no CUDA device is visible, with
    `mixed_precision`; FSDP2 when `fsdp` (`train.fsdp`, `train.fsdp.make_accelerator`); trackers `log_with` writing
    under `<out_dir>/trackers`."""
    from accelerate.state import AcceleratorState

    cpu = device == "cpu" or not torch.cuda.is_available()
    state = AcceleratorState._shared_state
    if state and state.get("_mixed_precision") != mixed_precision and state.get("num_processes", 1) == 1:
        AcceleratorState._reset_state()  # an earlier in-process run (tests, the zoo table) used another precision
    plugin = (
        FS.fsdp_plugin(reshard_after_forward=fsdp_reshard_after_forward, mixed_precision=mixed_precision)
        if fsdp
        else None
    )
    kw = {"log_with": log_with, "project_dir": str(Path(out_dir) / "trackers")} if log_with else {}
    kw["dataloader_config"] = RS.dataloader_config(data_seed)  # data order a function of (seed, epoch): exact resume
    return FS.make_accelerator(cpu=cpu, mixed_precision=mixed_precision, plugin=plugin, **kw)


def _start_run(cfg: dict, out_dir: Path, device: str):
    """The run's `Accelerator` (`make_accelerator`) with the global seed set and `out_dir`
    created; returns it and the trackers it logs to (`train.trackers` that are installed)."""
    from accelerate.utils import set_seed

    log_with, tracker_notes = TR.resolve_trackers(cfg["trackers"])
    accelerator = make_accelerator(
        cfg["mixed_precision"],
        device,
        fsdp=cfg["fsdp"],
        fsdp_reshard_after_forward=cfg["fsdp_reshard_after_forward"],
        out_dir=out_dir,
        log_with=log_with,
        data_seed=cfg["seed"],
    )
    set_seed(cfg["seed"])
    out_dir.mkdir(parents=True, exist_ok=True)
    for note in tracker_notes:
        accelerator.print(f"[train] {note}")
    return accelerator, log_with


def _open_data(
    accelerator,
    cfg: dict,
    probe: dict,
    token_shards,
    feature_shards,
    *,
    target_dir,
    out_dir: Path,
    target_dtype: str,
    trust_remote_code: bool,
    stream: Optional[dict] = None,
) -> RunData:
    """Token records memory-mapped (`train.data`), split into training and held-out
    records by prompt (`train.heldout.heldout_mask`; all held out = train on all, no
    validation), and the target loaded; with `train.target_features: shards` the features come from the
    feature shards and the target is never instantiated (embedding + LM head only).

    Raises:
        ValueError: `train.packing` with a target that does not keep packed records apart
            (`train.packing.check_target_isolates_records`).
    """
    where = dict(
        target_dir=target_dir,
        out_dir=out_dir,
        probe=probe,
        device=accelerator.device,
        target_dtype=target_dtype,
        is_main=accelerator.is_main_process,
        barrier=accelerator.wait_for_everyone,
    )
    if cfg["target_features"] == "stream":  # features from running servers (dflash_pipeline.train.stream)
        from dflash_pipeline.train.stream import open_stream_data

        data = open_stream_data(cfg, token_shards, stream or {}, min_loss_tokens=train_data.MIN_LOSS_TOKENS, **where)
    else:
        data = train_data.open_training_data(cfg, token_shards, feature_shards, **where)
    # a record from a feature shard or a server was computed alone: packed rows get each record's own features
    held = V.heldout_mask(
        train_data.record_prompt_ids(token_shards, data.dataset),
        cfg["validation_fraction"],
        seed=cfg["seed"],
        max_records=cfg["validation_max_records"],
    )
    held_idx = [i for i, h in enumerate(held) if h]
    train_idx = [i for i, h in enumerate(held) if not h]
    if not train_idx:  # everything held out: train on all of it, no validation
        train_idx, held_idx = list(range(len(held))), []
    records = torch.utils.data.Subset(data.dataset, train_idx)
    heldout = [data.dataset[i] for i in held_idx]
    target = None
    if not data.from_shards:  # StepContext takes the embedding and LM head from the target
        target = T.load_target(
            target_dir, dtype=target_dtype, device=accelerator.device, trust_remote_code=trust_remote_code
        )
    run_data = RunData(records, heldout, data, target)
    if cfg["packing"] and target is not None:  # online: the target runs on packed rows
        P.check_target_isolates_records(run_data.target, probe["drafter"]["target_layer_ids"])
    return run_data


def _prepare_run(
    accelerator, cfg: dict, out_dir: Path, data: RunData, probe: dict, arch: dict, zero_target_features: bool
) -> TrainRun:
    """The drafter, its rows (packed or not) and schedule, the optimizer with gradient checkpointing of the draft
    layers when `train.gradient_checkpointing`, warmup + cosine and the shuffled loader, prepared by Accelerate, the
    `StepContext` and this rank's held-out batches.

    Raises:
        RuntimeError: the prepared per-rank loader has another length than the schedule assumes.
    """
    drafter = build_drafter(
        data.target if data.target is not None else train_data.ConfigOnly(data.source.target_config),
        probe,
        seed=cfg["seed"],
        layer_types=arch.get("layer_types"),
        sliding_window=arch.get("sliding_window"),
        family=arch.get("family"),
        family_settings=arch.get(arch.get("family", "")),
    )
    block_size = drafter.block_size  # before Accelerate wraps it
    n_trainable = M.count_parameters(drafter)
    dataset = _rows(data.records, cfg)
    sch = Schedule.of(len(dataset), cfg, accelerator.num_processes)
    drafter.gradient_checkpointing = cfg["gradient_checkpointing"]  # recompute each draft layer in backward
    optimizer = OPT.make_optimizer(drafter, cfg["optimizer"], lr=cfg["learning_rate"], weight_decay=cfg["weight_decay"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: M.cosine_with_warmup(s, sch.total_steps, sch.warmup)
    )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=cfg["batch_size"],
        shuffle=True,
        collate_fn=P.collate_packed if cfg["packing"] else data.source.collate,
        drop_last=False,
        generator=torch.Generator().manual_seed(cfg["seed"]),
    )
    drafter, optimizer, loader = accelerator.prepare(drafter, optimizer, loader)
    if len(loader) != sch.micro_per_epoch:  # the micro-step loop syncs gradients on the last one of each step
        raise RuntimeError(f"per-rank loader has {len(loader)} batches, expected {sch.micro_per_epoch}")
    accelerator.register_for_checkpointing(scheduler)
    anchors = torch.Generator(device="cpu").manual_seed(cfg["seed"] * 1000 + accelerator.process_index)
    streams = RS.RankStreams({"anchors": anchors}, rank=accelerator.process_index, world_size=accelerator.num_processes)
    ctx = _step_context(accelerator, cfg, data, probe, arch, drafter, block_size, anchors, zero_target_features)
    val_batches, val_counted = _heldout_batches(data.heldout, cfg, accelerator.process_index, accelerator.num_processes)
    if data.source.stream is not None:  # the held-out batches' features, fetched once
        val_batches = data.source.stream.fill(val_batches)
    return TrainRun(
        accelerator=accelerator,
        cfg=cfg,
        out_dir=out_dir,
        data=data,
        schedule=sch,
        num_rows=len(dataset),
        n_trainable=n_trainable,
        drafter=drafter,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
        ctx=ctx,
        val_batches=val_batches,
        val_counted=val_counted,
        zero_target_features=zero_target_features,
        rng_streams=streams,
    )


def _step_context(
    accelerator,
    cfg: dict,
    data: RunData,
    probe: dict,
    arch: dict,
    drafter,
    block_size: int,
    anchors,
    zero_target_features: bool,
) -> StepContext:
    """The `StepContext` of `_prepare_run`: the prepared `drafter` (its `block_size`), the target
    or the feature source's frozen embedding / LM head, the `anchors` generator, the attention backend
    (`drafter.attention_masks.training_attention_backend`), γ (`train.loss_gamma` or the block size's default), the loss
    settings, the target's logit softcap, and the family's keys when the family is not DFlash."""
    core = getattr(drafter, "module", drafter)
    backend = AM.training_attention_backend(
        cfg["attention_backend"], accelerator.device.type, getattr(core.config, "head_dim", None)
    )
    gamma = cfg["loss_gamma"] or M.loss_decay_gamma(block_size)
    return StepContext(
        drafter=drafter,
        target=data.target,
        probe=probe,
        num_anchors=cfg["num_anchors"],
        block_size=block_size,
        gamma=gamma,
        generator=anchors,
        zero_target_features=zero_target_features,
        backend=backend,
        world_size=accelerator.num_processes,
        reduce_sum=lambda t: accelerator.reduce(t.to(accelerator.device), "sum"),
        embed=data.source.embed,
        lm_head=data.source.lm_head,
        final_norm=data.source.final_norm,
        loss=cfg["loss"],
        kl_temperature=cfg["kl_temperature"],
        kl_ce_weight=cfg["kl_ce_weight"],
        dpace_alpha=cfg["dpace_alpha"],
        loss_chunk_tokens=cfg["loss_chunk_tokens"],
        logit_softcap=T.final_logit_softcap(
            data.target.config if data.target is not None else data.source.target_config
        ),
        **{k: cfg[k] for k in FR.get(arch.get("family")).train_keys},  # the family's own train.* keys
    )


def _rows(records, cfg: dict):
    """The rows a loader batches: `records` themselves, or with `train.packing` the records packed into rows of up to
    `train.pack_max_tokens` tokens."""
    if not cfg["packing"]:
        return records
    ds = getattr(records, "dataset", None)
    lengths = (
        ds.lengths()[np.asarray(records.indices, dtype=np.int64)].tolist()
        if isinstance(ds, train_data.MappedRecords)
        else [len(r[0]) for r in records]
    )
    return P.PackedDataset(records, cfg["pack_max_tokens"] or max(lengths), lengths)


def _describe(run: TrainRun) -> str:
    """The `[train]` line that opens a run's log: data, processes, schedule, objective, drafter size, dtypes."""
    cfg, acc, ctx = run.cfg, run.accelerator, run.ctx
    return (
        f"[train] records={len(run.data.records)} rows={run.num_rows} heldout={len(run.data.heldout)} processes={acc.num_processes} "
        f"device={acc.device} steps={run.schedule.total_steps} accumulation={run.schedule.accum} loss={cfg['loss']} "
        f"packing={cfg['packing']} fsdp={acc.is_fsdp2} trainable_params={run.n_trainable} block_size={ctx.block_size} "
        f"gamma={ctx.gamma} target_layer_ids={ctx.probe['drafter']['target_layer_ids']} "
        f"target_dtype={run.data.target_dtype} mixed_precision={cfg['mixed_precision']}"
    )


def _heldout_batches(records, cfg: dict, rank: int, world: int) -> tuple[list[dict], list[bool]]:
    """This rank's held-out batches and whether each one counts: every rank runs the same number of
    forwards (FSDP gathers weights collectively), the surplus ones repeat a batch and are not counted."""
    if not records:
        return [], []
    bs = cfg["batch_size"]
    if cfg["packing"]:
        rows = _rows(records, cfg)
        items = [rows[i] for i in range(len(rows))]
        batches = [P.collate_packed(items[i : i + bs]) for i in range(0, len(items), bs)]
    else:  # train_data.collate: records from feature shards carry their features
        batches = [train_data.collate(records[i : i + bs]) for i in range(0, len(records), bs)]
    mine = batches[rank::world]
    n = math.ceil(len(batches) / world)
    return mine + [batches[0]] * (n - len(mine)), [True] * len(mine) + [False] * (n - len(mine))


# --- End of the run


def _summary(run: TrainRun, log_with, target_dir) -> dict:
    """`train_summary.json`: the run's size, schedule, objective, drafter and dtypes, its `train` config, and its
    provenance."""
    cfg, ctx, acc = run.cfg, run.ctx, run.accelerator
    return {
        "steps": run.schedule.total_steps,
        "records": len(run.data.records),
        "heldout_records": len(run.data.heldout),
        "rows": run.num_rows,
        "num_processes": acc.num_processes,
        "trainable_params": run.n_trainable,
        "block_size": ctx.block_size,
        "loss_gamma": ctx.gamma,
        "zero_target_features": run.zero_target_features,
        "attention_backend": ctx.backend,
        "layer_types": list(getattr(run.drafter, "module", run.drafter).layer_types),
        "loss": cfg["loss"],
        "packing": cfg["packing"],
        "fsdp": acc.is_fsdp2,
        "trackers": log_with,
        "target_dtype": str(run.data.target_dtype).replace("torch.", ""),
        "train_config": cfg,
        **_stream_summary(run),
        "provenance": provenance(
            target_dir=target_dir,
            device=str(acc.device),
            dtype=str(acc.mixed_precision if acc.mixed_precision != "no" else run.data.target_dtype).replace(
                "torch.", ""
            ),
        ),
    }


def _stream_summary(run: TrainRun) -> dict:
    """`{"stream": supply and demand, peak scratch}` of a `target_features: stream` run, else `{}`."""
    stream = run.data.source.stream
    if stream is None:
        return {}
    run.accelerator.print(stream.describe())
    out = stream.summary()
    stream.close(finished=True)
    return {"stream": out}


def _finish(run: TrainRun, step: int, target_dir, summary: dict) -> dict:
    """Export `final/` (atomic, with its `serve.md` naming `target_dir`), write `train_summary.json`, save the last
    state; returns `summary`."""
    accelerator, out_dir = run.accelerator, run.out_dir
    accelerator.wait_for_everyone()
    module = export_module(accelerator, run.drafter)
    if accelerator.is_main_process:
        export_drafter(
            module,
            out_dir / "final",
            target=Path(target_dir).resolve(),
            extra={"train_steps": summary["steps"], "zero_target_features": summary["zero_target_features"]},
        )
        write_json(out_dir / "train_summary.json", summary)
    save_state(accelerator, out_dir / "state", step, run.identity)
    accelerator.wait_for_everyone()
    # Free the DDP Reducer while the process group is registered: ending the group in the Reducer's dealloc
    # joins Gloo's workers while holding the GIL, and the rank hangs at exit (pytorch#56297).
    run.drafter = run.ctx.drafter = None
    accelerator.free_memory()
    accelerator.end_training()
    return summary


def main(argv: Optional[Sequence[str]] = None) -> None:
    """CLI used under `accelerate launch -m dflash_pipeline.train`."""
    p = argparse.ArgumentParser(description="Train a DFlash drafter (run under accelerate launch).")
    p.add_argument("--probe", required=True, help="config probe JSON")
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--out-dir", required=True, help="run directory (final/, state/, logs)")
    p.add_argument("--train-config", required=True, help="JSON of the validated `train` config")
    p.add_argument("--target-dtype", default="auto", choices=T.DTYPE_CHOICES, help="target.dtype")
    p.add_argument("--trust-remote-code", action="store_true", help="target.trust_remote_code")
    p.add_argument("--device", default="auto", choices=("auto", "cpu"), help="train.device")
    p.add_argument("--zero-target-features", action="store_true")
    p.add_argument("--drafter-arch", default="{}", help="JSON with optional layer_types / sliding_window")
    p.add_argument(
        "--feature-shard",
        dest="feature_shards",
        action="append",
        default=[],
        help="a feature shard (repeat, one per token shard, same order; train.target_features: shards)",
    )
    p.add_argument("--stream-config", help="JSON of the stream settings (train.target_features: stream)")
    p.add_argument("token_shards", nargs="+")
    a = p.parse_args(argv)
    if (
        "LOCAL_RANK" in os.environ
    ):  # a rank of torchrun (accelerate launch): its own session, so end it with the launcher
        die_with_parent(os.getppid())
    probe = json.loads(Path(a.probe).read_text(encoding="utf-8"))
    train(
        token_shards=a.token_shards,
        probe=probe,
        target_dir=a.target,
        out_dir=a.out_dir,
        cfg=json.loads(a.train_config),
        target_dtype=a.target_dtype,
        trust_remote_code=a.trust_remote_code,
        zero_target_features=a.zero_target_features,
        drafter_arch=json.loads(a.drafter_arch),
        device=a.device,
        feature_shards=a.feature_shards,
        stream=json.loads(a.stream_config) if a.stream_config else None,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
