"""Train a DFlash drafter with HF Accelerate, target frozen and run online for its features.

Launched by the ``train_drafter`` rule as ``accelerate launch … -m dflash_pipeline.train …`` (1..N GPUs,
or N CPU ranks over gloo; see :func:`dflash_pipeline.workflow.accelerate_launch_args`). Method: reference/dflash.md §4 (anchors,
block mask, same-position labels, decayed CE), §4.7 (AdamW, warmup + cosine, clipping, fp32 master
weights under bf16 autocast), §5.3 (online target features).

Objectives (``train.loss``): ``ce_decay``, ``dpace``, ``kl`` (:mod:`dflash_pipeline.losses`), normalised
globally over ranks and gradient-accumulation micro-steps. Optional sequence packing
(:mod:`dflash_pipeline.packing`), FSDP2 (:mod:`dflash_pipeline.fsdp`), multi-node launch
(:func:`dflash_pipeline.workflow.launch_topology`), held-out validation τ (:mod:`dflash_pipeline.validation`),
trackers (:mod:`dflash_pipeline.trackers`).

Outputs under ``out_dir``: ``final/`` (servable checkpoint, written atomically), ``state/`` (Accelerate
state for resume; a killed run restarts at its last saved step), ``train_log.jsonl`` (one JSON per
logged step), ``val_log.jsonl`` (one JSON per held-out validation: per-block τ, per-position acceptance),
``val_tau.png`` (validation τ vs step), ``trackers/`` (TensorBoard event files), ``train_summary.json`` and
``step_<N>/`` (an intermediate servable export at every state save, ``save_every_steps``; the eval stage
charts τ across them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import sys
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from . import fsdp as FS
from . import losses as L
from . import model as M
from . import packing as P
from . import target as T
from . import trackers as TR
from . import train_data
from . import validation as V
from .shards import read_parquet, replace_dir, write_json


# ---------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------


def load_token_shards(paths: Sequence[str | Path], *, min_loss_tokens: int = 2) -> list[tuple[np.ndarray, np.ndarray]]:
    """Read token shards eagerly into ``(input_ids int32 [S], loss_mask uint8 [S])`` pairs, in path order.

    Not the trainer's path (it memory-maps them: :mod:`dflash_pipeline.train_data`, resident memory flat as
    the dataset grows); kept as the baseline of ``bench/bench_features.py`` / ``bench/bench_train.py`` and for
    small in-memory uses. Records with fewer than ``min_loss_tokens`` supervised tokens are skipped.
    """
    out = []
    for p in paths:
        table = read_parquet(p)
        for i, m in zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()):
            if sum(m) >= min_loss_tokens:
                out.append((np.asarray(i, dtype=np.int32), np.asarray(m, dtype=np.uint8)))
    return out


def with_schema_defaults(cfg: dict) -> dict:
    """``cfg`` (the ``train`` section) with every key it lacks taken from the config schema's defaults
    (callers such as tests and benches pass partial dicts; the schema stays the one place for defaults)."""
    from .config import load_schema

    props = load_schema()["properties"]["train"]["properties"]
    return {**{k: v["default"] for k, v in props.items() if "default" in v}, **cfg}


def collate(batch, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad a list of (input_ids, loss_mask) to ``input_ids``/``loss_mask``/``attention_mask`` [b, S_max]."""
    s = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), s), pad_id, dtype=torch.long)
    lm = torch.zeros((len(batch), s), dtype=torch.uint8)
    am = torch.zeros((len(batch), s), dtype=torch.long)
    for r, (i, m) in enumerate(batch):
        ids[r, : len(i)] = torch.from_numpy(i.astype(np.int64))
        lm[r, : len(m)] = torch.from_numpy(m)
        am[r, : len(i)] = 1
    return {"input_ids": ids, "loss_mask": lm, "attention_mask": am}


# ---------------------------------------------------------------------------------------------------
# Target features
# ---------------------------------------------------------------------------------------------------

load_target = T.load_target  # one loader for every family (dflash_pipeline.target); re-exported here


def target_features(target, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], layer_ids: Sequence[int], **kw):
    """Run the frozen target and concatenate the outputs of decoder layers ``layer_ids``.

    Uses :func:`dflash_pipeline.probe.hf_hidden_state_index` (the one canonical→HF conversion: id+1).
    Returns ``(features [b, S, K·H] in the target dtype, model output)``.
    """
    out = T.hidden_states_of(target, input_ids, attention_mask, **kw)
    return T.select_layers(out.hidden_states, layer_ids), out


def build_drafter(target, probe: dict, *, seed: int = 0, layer_types=None, sliding_window=None) -> M.DFlashDrafter:
    """Random-init float32 drafter sized from the target config and the probe's drafter decisions
    (``layer_types``/``sliding_window``: optional sliding-window draft layers, config ``drafter.*``)."""
    d = probe["drafter"]
    cfg = M.drafter_config_from_target(
        T.text_config(target.config),
        block_size=d["block_size"],
        num_draft_layers=d["num_draft_layers"],
        target_layer_ids=d["target_layer_ids"],
        mask_token_id=d["mask_token_id"],
        layer_types=layer_types,
        sliding_window=sliding_window,
    )
    torch.manual_seed(seed)
    return M.DFlashDrafter(cfg)


# ---------------------------------------------------------------------------------------------------
# One training step
# ---------------------------------------------------------------------------------------------------


@dataclass
class StepContext:
    """What :func:`training_step` needs besides the batch (built once per run by :func:`train`).

    ``reduce_sum`` sums a scalar over data-parallel ranks (None = one process) for the global loss
    normalisation (:func:`dflash_pipeline.model.loss_normalizer`). ``loss``/``kl_*``/``dpace_alpha``:
    the objective (``train.loss``, :func:`dflash_pipeline.losses.compute_loss`).
    """

    drafter: Any
    target: Any
    probe: dict
    num_anchors: int
    block_size: int
    gamma: Optional[float]
    generator: torch.Generator
    zero_target_features: bool = False
    backend: str = "sdpa"
    world_size: int = 1
    reduce_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    embed: Any = field(default=None)
    lm_head: Any = field(default=None)
    loss: str = "ce_decay"  # train.loss (dflash_pipeline.losses)
    kl_temperature: float = 1.0
    kl_ce_weight: float = 0.0
    dpace_alpha: float = 0.5

    def __post_init__(self):
        self.embed = self.embed if self.embed is not None else T.input_embeddings(self.target)
        self.lm_head = self.lm_head if self.lm_head is not None else T.lm_head(self.target)


def step_objective(ctx: StepContext, batch: dict) -> L.LossOutput:
    """One forward pass: target features → anchors → blocks → drafter → ``ctx.loss`` (dflash.md §4).

    ``batch``: ``input_ids`` long [b, S], ``loss_mask`` uint8 [b, S], ``attention_mask`` long [b, S];
    packed rows (:func:`dflash_pipeline.packing.collate_packed`) add ``position_ids``/``segment_ids`` and
    anchors, labels and attention then stay inside each record. Precomputed ``features``
    [b, S, K·H] (and ``target_last_hidden`` [b, S, H] for ``kl``) replace the target forward (feature shards).
    Dtypes (dflash_pipeline.target): the target runs in its dtype, the drafter in its parameter dtype
    (inputs cast; Accelerate's autocast, when on, covers the drafter forward), the LM head in its dtype,
    the loss in float32.

    Returns the unnormalised :class:`dflash_pipeline.losses.LossOutput` (the caller normalises globally).
    """
    ids, lmask, am = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
    packed = "segment_ids" in batch
    d = ctx.probe["drafter"]
    teacher_needed = ctx.loss == "kl"
    last = batch.get("target_last_hidden")
    with torch.no_grad():
        if "features" in batch:  # feature shards (train.target_features: shards): the target never runs here
            feats = batch["features"]
        elif ctx.zero_target_features and not teacher_needed:  # the ablation never looks at the target
            k_h = len(d["target_layer_ids"]) * ctx.embed.weight.shape[1]
            feats = torch.zeros(*ids.shape, k_h, dtype=ctx.embed.weight.dtype, device=ids.device)  # [b, S, K·H]
        else:
            if packed:
                feats, out = P.packed_target_features(ctx.target, ids, batch["position_ids"], d["target_layer_ids"])
            else:
                feats, out = target_features(ctx.target, ids, am, d["target_layer_ids"])  # [b, S, K·H]
            last = out.hidden_states[-1] if teacher_needed else None  # final-normed: lm_head's input
            if ctx.zero_target_features:
                feats = torch.zeros_like(feats)
    if teacher_needed and last is None:
        raise ValueError("train.loss: kl needs the target's last hidden state (target_last_hidden in feature shards)")
    core = getattr(ctx.drafter, "module", ctx.drafter)
    b, s = ids.shape
    if packed:
        pos, seg = batch["position_ids"], batch["segment_ids"]
        anchors = P.sample_packed_anchors(lmask.cpu(), seg.cpu(), ctx.num_anchors, generator=ctx.generator)
        anchors = M.AnchorBatch(anchors.anchors.to(ids.device), anchors.keep.to(ids.device))
        blk = P.packed_block_inputs_and_labels(ids, lmask, pos, seg, anchors, ctx.block_size, d["mask_token_id"], ctx.gamma)
        block_ids, block_pos, rows, labels, weights = blk.ids, blk.pos, blk.rows, blk.labels, blk.weights
        mask = P.build_packed_training_masks(core, anchors.anchors, seg, ctx.backend)
        ctx_pos = pos
        num_sequences = int(batch["num_records"].sum())
    else:
        anchors = M.sample_anchors(lmask.cpu(), ctx.num_anchors, generator=ctx.generator)
        anchors = M.AnchorBatch(anchors.anchors.to(ids.device), anchors.keep.to(ids.device))
        block_ids, block_pos, labels, weights = M.block_inputs_and_labels(
            ids, lmask, anchors, ctx.block_size, d["mask_token_id"], ctx.gamma)
        rows = block_pos
        mask = M.build_training_masks(core, anchors.anchors, s, ctx.backend)
        ctx_pos = torch.arange(s, device=ids.device).expand(b, -1)
        num_sequences = b
    with torch.no_grad():
        noise = ctx.embed(block_ids)
    noise, feats = T.to_drafter_dtype(ctx.drafter, noise, feats)
    hidden = ctx.drafter(noise, feats, ctx_pos, block_pos, attn_mask=mask)
    teacher = L.teacher_slot_hidden(last, rows) if teacher_needed else None
    return L.compute_loss(ctx.loss, hidden, ctx.lm_head.weight, labels, weights, ctx.block_size, teacher_hidden=teacher,
                          temperature=ctx.kl_temperature, ce_weight=ctx.kl_ce_weight, dpace_alpha=ctx.dpace_alpha,
                          num_sequences=num_sequences)


def training_step(ctx: StepContext, batch: dict) -> tuple[torch.Tensor, dict]:
    """:func:`step_objective` normalised for one micro-step: its total divided by the global normaliser
    over ranks / world size (:func:`dflash_pipeline.model.loss_normalizer`), so DDP's gradient average is
    the global Σ terms / Σ normaliser. Returns ``(loss scalar float32, stats)``."""
    out = step_objective(ctx, batch)
    norm = M.loss_normalizer(out.normalizer, ctx.world_size, ctx.reduce_sum)
    return out.total / norm.to(out.total.device).clamp(min=1e-12), out.stats


# ---------------------------------------------------------------------------------------------------
# Training loop
# ---------------------------------------------------------------------------------------------------


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
        """One micro-step's stats and tokens; ``loss`` (the optimizer step's global loss) when not None."""
        c, t = M.slot_accuracy(stats, self.block_size)
        if loss is not None:
            self.loss += loss
            self.n += 1
        self.correct += c
        self.total += t
        self.tokens += tokens


def _log_window(accelerator, w: _Window, *, step: int, total_steps: int, epoch: int, lr: float, log_path: Path,
                run_t0: float, start_step: int) -> dict:
    """Reduce the window's slot counts over ranks, append one ``train_log.jsonl`` record and log it to the
    trackers (main rank); the ``[train]`` line carries the ETA. Returns the record."""
    totals = accelerator.reduce(torch.stack([w.correct, w.total]).to(accelerator.device), "sum").cpu()
    tokens = int(accelerator.reduce(torch.tensor(float(w.tokens), device=accelerator.device), "sum"))
    acc = (totals[0] / totals[1].clamp(min=1)).tolist()
    elapsed = time.time() - w.t0
    per_step = (time.time() - run_t0) / max(1, step - start_step)
    rec = {
        "step": step, "epoch": epoch, "loss": w.loss / max(1, w.n), "lr": lr, "slot_acc": acc,
        "eal": M.expected_acceptance_length(acc),
        "tokens_per_s": tokens / max(1e-9, elapsed), "elapsed_s": elapsed, "eta_s": per_step * (total_steps - step),
    }
    if accelerator.is_main_process:
        with open(log_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec) + "\n")
        eta = time.strftime("%H:%M:%S", time.gmtime(rec["eta_s"]))
        print(f"[train] step {step}/{total_steps} loss {rec['loss']:.4f} eal {rec['eal']:.2f} acc1 {acc[1]:.3f} "
              f"tok/s {rec['tokens_per_s']:.0f} eta {eta}", flush=True)
    accelerator.log(TR.scalars(rec, "train"), step=step)
    return rec


def _resume(accelerator, out_dir: Path, total_steps: int) -> int:
    """Load ``state/`` when present and return its step; on a fresh start clear the old logs and exports."""
    state_dir = out_dir / "state"
    step = 0
    if (state_dir / "step.json").is_file():
        accelerator.load_state(str(state_dir))
        step = json.loads((state_dir / "step.json").read_text())["step"]
        accelerator.print(f"[train] resumed from {state_dir} at step {step}/{total_steps}")
    if accelerator.is_main_process and step == 0:
        (out_dir / "train_log.jsonl").unlink(missing_ok=True)
        (out_dir / "val_log.jsonl").unlink(missing_ok=True)
        shutil.rmtree(out_dir / "trackers", ignore_errors=True)
        for old in out_dir.glob(f"{STEP_EXPORT_PREFIX}*"):  # intermediate exports of an earlier run
            shutil.rmtree(old, ignore_errors=True)
    return step


def make_accelerator(mixed_precision: str, device: str = "auto", *, fsdp: bool = False, fsdp_reshard_after_forward: bool = True,
                     out_dir: Optional[Path] = None, log_with: Optional[list] = None):
    """The run's ``Accelerator``: CPU when ``device`` (``train.device``) is ``cpu`` or no CUDA device is
    visible, with ``mixed_precision`` (``train.mixed_precision``; bf16 autocast works on CPU too, which is
    how the tests exercise it); FSDP2 when ``fsdp`` (``train.fsdp``, :func:`dflash_pipeline.fsdp.make_accelerator`);
    trackers ``log_with`` writing under ``<out_dir>/trackers``."""
    from accelerate.state import AcceleratorState

    cpu = device == "cpu" or not torch.cuda.is_available()
    state = AcceleratorState._shared_state
    if state and state.get("_mixed_precision") != mixed_precision and state.get("num_processes", 1) == 1:
        AcceleratorState._reset_state()  # an earlier in-process run (tests, the zoo table) used another precision
    plugin = FS.fsdp_plugin(reshard_after_forward=fsdp_reshard_after_forward, mixed_precision=mixed_precision) if fsdp else None
    kw = {"log_with": log_with, "project_dir": str(Path(out_dir) / "trackers")} if log_with else {}
    return FS.make_accelerator(cpu=cpu, mixed_precision=mixed_precision, plugin=plugin, **kw)


def _export_module(accelerator, drafter):
    """The drafter to export, on the main process (None elsewhere): the unwrapped module, or under FSDP
    the gathered full copy (collective: every rank calls this)."""
    if accelerator.is_fsdp2:
        return FS.full_drafter(accelerator, drafter)
    return accelerator.unwrap_model(drafter) if accelerator.is_main_process else None


def _heldout_batches(records, cfg: dict, rank: int, world: int) -> tuple[list[dict], list[bool]]:
    """This rank's held-out batches and whether each one counts: every rank runs the same number of
    forwards (FSDP gathers weights collectively), the surplus ones repeat a batch and are not counted."""
    if not records:
        return [], []
    bs = cfg["batch_size"]
    if cfg["packing"]:
        rows = P.PackedDataset(records, cfg["pack_max_tokens"] or max(len(r[0]) for r in records))
        items = [rows[i] for i in range(len(rows))]
        batches = [P.collate_packed(items[i : i + bs]) for i in range(0, len(items), bs)]
    else:  # train_data.collate: records from feature shards carry their features
        batches = [train_data.collate(records[i : i + bs]) for i in range(0, len(records), bs)]
    mine = batches[rank::world]
    n = math.ceil(len(batches) / world)
    return mine + [batches[0]] * (n - len(mine)), [True] * len(mine) + [False] * (n - len(mine))


def _validate(accelerator, ctx: StepContext, batches, counted, cfg: dict, step: int, out_dir: Path) -> Optional[dict]:
    """Held-out per-block acceptance (dflash_pipeline.validation) at ``step``: appended to ``val_log.jsonl``,
    logged to the trackers and printed (main rank)."""
    if not batches:
        return None
    d = ctx.probe["drafter"]
    total = V.AcceptanceCounts.zeros(ctx.block_size)
    core = getattr(ctx.drafter, "module", ctx.drafter)
    core.eval()
    try:
        for batch, count in zip(batches, counted):
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            c = V.batch_acceptance(ctx.drafter, ctx.target, ctx.embed, ctx.lm_head, batch, target_layer_ids=d["target_layer_ids"],
                                   features=batch.get("features"),
                                   mask_token_id=d["mask_token_id"], num_anchors=cfg["validation_num_anchors"], backend=ctx.backend)
            if count:
                total = total + c
    finally:
        core.train()
    summary = V.AcceptanceCounts.from_tensor(accelerator.reduce(total.as_tensor().to(accelerator.device), "sum")).summary()
    rec = {"step": step, **summary}
    if accelerator.is_main_process:
        with open(out_dir / "val_log.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec) + "\n")
        pp = " ".join(f"{x:.2f}" for x in summary["per_position_acceptance"])
        print(f"[val] step {step} tau {summary['tau']:.3f} (marginal proxy {summary['tau_marginal']:.3f}) "
              f"blocks {summary['num_blocks']} per-position {pp}", flush=True)
    accelerator.log(TR.scalars(summary, "val"), step=step)
    return rec


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
) -> dict:
    """Train the drafter; see the module docstring for outputs. ``cfg`` is the validated ``train`` config
    (missing keys take the schema defaults, :func:`with_schema_defaults`).

    ``target_dtype`` / ``trust_remote_code``: ``target.dtype`` / ``target.trust_remote_code``
    (:func:`dflash_pipeline.target.load_target`; ``auto`` = bf16 on CUDA, fp32 on CPU). The drafter keeps
    float32 master weights; ``train.mixed_precision`` sets Accelerate's autocast. ``device``:
    ``train.device`` (``cpu``: CPU ranks whatever GPUs are visible; not part of ``cfg``, which is the
    rule's rerun fingerprint). ``feature_shards`` (one per token shard, same order) are read when
    ``cfg["target_features"]`` is ``shards``: the target is then never instantiated (embedding and LM head
    only, :mod:`dflash_pipeline.train_data`).
    ``drafter_arch`` holds the optional ``layer_types``/``sliding_window`` (config ``drafter.*``).
    ``zero_target_features`` trains the ablation baseline whose fused features are all zero (what the
    target features buy). Returns the summary dict (also written to ``train_summary.json``).

    Gradients: each micro-step backpropagates its unnormalised objective; after
    ``gradient_accumulation_steps`` micro-steps the gradients are multiplied by world_size / Σ normaliser
    (summed over ranks and micro-steps; DDP/FSDP average over ranks), so the update is that of the global
    Σ terms / Σ normaliser whatever the split across ranks and micro-steps.

    Raises:
        ValueError: no token record has an anchor candidate; ``train.packing`` with a target that does
            not keep packed records apart.
    """
    from accelerate.utils import set_seed

    cfg = with_schema_defaults(cfg)
    out_dir = Path(out_dir)
    log_with, tracker_notes = TR.resolve_trackers(cfg["trackers"])
    accelerator = make_accelerator(cfg["mixed_precision"], device, fsdp=cfg["fsdp"],
                                   fsdp_reshard_after_forward=cfg["fsdp_reshard_after_forward"], out_dir=out_dir, log_with=log_with)
    set_seed(cfg["seed"])
    out_dir.mkdir(parents=True, exist_ok=True)
    for note in tracker_notes:
        accelerator.print(f"[train] {note}")

    # Token records memory-mapped (dflash_pipeline.train_data); with train.target_features: shards the features
    # come from the feature shards and the target is never instantiated (embedding + LM head only).
    data = train_data.open_training_data(
        cfg, token_shards, feature_shards, target_dir=target_dir, out_dir=out_dir, probe=probe, device=accelerator.device,
        target_dtype=target_dtype, is_main=accelerator.is_main_process, barrier=accelerator.wait_for_everyone,
    )
    if data.from_shards and cfg["packing"]:
        raise ValueError("train.packing is not supported with train.target_features: shards yet (packed rows would "
                         "need their records' features concatenated); set train.packing: false")
    held = V.heldout_mask(train_data.record_prompt_ids(token_shards, data.dataset), cfg["validation_fraction"],
                          seed=cfg["seed"], max_records=cfg["validation_max_records"])
    held_idx = [i for i, h in enumerate(held) if h]
    train_idx = [i for i, h in enumerate(held) if not h]
    if not train_idx:  # everything held out: train on all of it, no validation
        train_idx, held_idx = list(range(len(held))), []
    records = torch.utils.data.Subset(data.dataset, train_idx)
    heldout = [data.dataset[i] for i in held_idx]
    if data.from_shards:
        target, embed, lm_head = None, data.embed, data.lm_head
    else:
        target = T.load_target(target_dir, dtype=target_dtype, device=accelerator.device, trust_remote_code=trust_remote_code)
        embed = lm_head = None  # StepContext takes them from the target
    if cfg["packing"]:
        P.check_target_isolates_records(target, probe["drafter"]["target_layer_ids"])
    arch = drafter_arch or {}
    drafter = build_drafter(target if target is not None else train_data.ConfigOnly(data.target_config), probe,
                            seed=cfg["seed"], layer_types=arch.get("layer_types"), sliding_window=arch.get("sliding_window"))
    backend = cfg["attention_backend"] if cfg.get("attention_backend", "auto") != "auto" else (
        "flex" if accelerator.device.type == "cuda" else "sdpa")
    block_size = drafter.block_size
    gamma = cfg.get("loss_gamma") or M.loss_decay_gamma(block_size)
    n_trainable = M.count_parameters(drafter)

    bs, nproc, accum = cfg["batch_size"], accelerator.num_processes, cfg["gradient_accumulation_steps"]
    if cfg["packing"]:
        dataset = P.PackedDataset(records, cfg["pack_max_tokens"] or max(len(r[0]) for r in records))
        collate_fn = P.collate_packed
    else:
        dataset, collate_fn = records, data.collate
    micro_per_epoch = math.ceil(len(dataset) / (bs * nproc))  # per rank (Accelerate shards evenly)
    steps_per_epoch = math.ceil(micro_per_epoch / accum)
    total_steps = max(1, math.ceil(cfg["epochs"] * steps_per_epoch))
    warmup = int(cfg["warmup_ratio"] * total_steps)

    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg["learning_rate"], weight_decay=cfg["weight_decay"], betas=(0.9, 0.999), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: M.cosine_with_warmup(s, total_steps, warmup))
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=bs, shuffle=True, collate_fn=collate_fn, drop_last=False,
        generator=torch.Generator().manual_seed(cfg["seed"]),
    )
    drafter, optimizer, loader = accelerator.prepare(drafter, optimizer, loader)
    if len(loader) != micro_per_epoch:  # the micro-step loop syncs gradients on the last one of each step
        raise RuntimeError(f"per-rank loader has {len(loader)} batches, expected {micro_per_epoch}")
    accelerator.register_for_checkpointing(scheduler)
    step = _resume(accelerator, out_dir, total_steps)
    if log_with:
        accelerator.init_trackers(cfg["tracker_project"], config=TR.flat_hparams({**cfg, "zero_target_features": zero_target_features}))
    accelerator.print(
        f"[train] records={len(records)} rows={len(dataset)} heldout={len(heldout)} processes={nproc} device={accelerator.device} "
        f"steps={total_steps} accumulation={accum} loss={cfg['loss']} packing={cfg['packing']} fsdp={accelerator.is_fsdp2} "
        f"trainable_params={n_trainable} block_size={block_size} gamma={gamma} target_layer_ids={probe['drafter']['target_layer_ids']} "
        f"target_dtype={T.module_dtype(target if target is not None else lm_head)} mixed_precision={cfg['mixed_precision']}"
    )
    ctx = StepContext(
        drafter=drafter, target=target, probe=probe, num_anchors=cfg["num_anchors"], block_size=block_size, gamma=gamma,
        generator=torch.Generator(device="cpu").manual_seed(cfg["seed"] * 1000 + accelerator.process_index),
        zero_target_features=zero_target_features, backend=backend, world_size=nproc,
        reduce_sum=lambda t: accelerator.reduce(t.to(accelerator.device), "sum"), embed=embed, lm_head=lm_head,
        loss=cfg["loss"], kl_temperature=cfg["kl_temperature"], kl_ce_weight=cfg["kl_ce_weight"], dpace_alpha=cfg["dpace_alpha"],
    )
    val_batches, val_counted = _heldout_batches(heldout, cfg, accelerator.process_index, nproc)
    window = _Window(block_size)
    run_t0, start_step = time.time(), step
    bar = TR.progress_bar(total_steps, step, disable=not (accelerator.is_main_process and sys.stderr.isatty()))
    drafter.train()
    while step < total_steps:
        epoch = step // steps_per_epoch
        loader.set_epoch(epoch)
        skip = (step - epoch * steps_per_epoch) * accum
        batches = iter(accelerator.skip_first_batches(loader, skip) if skip else loader)
        left = micro_per_epoch - skip
        while left > 0 and step < total_steps:
            n_micro = min(accum, left)
            norm = torch.zeros((), dtype=torch.float32, device=accelerator.device)
            total = torch.zeros((), dtype=torch.float32, device=accelerator.device)
            for j in range(n_micro):
                batch = next(batches)
                if cfg.get("trace_batches"):
                    trace_batch(out_dir, accelerator.process_index, step, batch)
                out = step_objective(ctx, batch)
                sync = contextlib.nullcontext() if j == n_micro - 1 else accelerator.no_sync(drafter)
                with sync:
                    accelerator.backward(out.total)
                norm += out.normalizer.to(norm.device)
                total += out.total.detach().to(total.device)
                window.add(None, out.stats, int(batch["attention_mask"].sum()))
            left -= n_micro
            sums = accelerator.reduce(torch.stack([norm, total]), "sum")  # global Σ normaliser, Σ terms
            scale = nproc / float(sums[0].clamp(min=1e-12))
            for prm in drafter.parameters():
                if prm.grad is not None:
                    prm.grad.mul_(scale)
            accelerator.clip_grad_norm_(drafter.parameters(), cfg["max_grad_norm"])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            bar.update(1)
            window.loss += float(sums[1] / sums[0].clamp(min=1e-12))
            window.n += 1
            if step % cfg["log_every_steps"] == 0 or step == total_steps:
                _log_window(accelerator, window, step=step, total_steps=total_steps, epoch=epoch,
                            lr=scheduler.get_last_lr()[0], log_path=out_dir / "train_log.jsonl", run_t0=run_t0, start_step=start_step)
                window = _Window(block_size)
            if val_batches and (step % cfg["validation_every_steps"] == 0 or step == total_steps):
                _validate(accelerator, ctx, val_batches, val_counted, cfg, step, out_dir)
            if step % cfg["save_every_steps"] == 0 and step < total_steps:
                save_state(accelerator, out_dir / "state", step)
                module = _export_module(accelerator, drafter)
                if accelerator.is_main_process:
                    export_step(module, out_dir, step, zero_target_features)
    bar.close()
    if accelerator.is_main_process:
        from .evaluate import plot_validation

        plot_validation(out_dir / "val_log.jsonl", out_dir / "val_tau.png")
    return _finish(accelerator, drafter, out_dir, step, target_dir, {
        "steps": total_steps, "records": len(records), "heldout_records": len(heldout), "rows": len(dataset),
        "num_processes": nproc, "trainable_params": n_trainable,
        "block_size": block_size, "loss_gamma": gamma, "zero_target_features": zero_target_features,
        "attention_backend": backend, "layer_types": list(getattr(drafter, "module", drafter).layer_types),
        "loss": cfg["loss"], "packing": cfg["packing"], "fsdp": accelerator.is_fsdp2, "trackers": log_with,
        "target_dtype": str(T.module_dtype(target if target is not None else lm_head)).replace("torch.", ""), "train_config": cfg,
    })


def _finish(accelerator, drafter, out_dir: Path, step: int, target_dir, summary: dict) -> dict:
    """Export ``final/`` (atomic, with its ``serve.md`` naming ``target_dir``), write ``train_summary.json``, save the last state; returns ``summary``."""
    accelerator.wait_for_everyone()
    module = _export_module(accelerator, drafter)
    if accelerator.is_main_process:
        final = out_dir / "final"
        tmp = out_dir / "final.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        M.save_drafter(module, tmp, extra={"train_steps": summary["steps"], "zero_target_features": summary["zero_target_features"]})
        _write_serve_md(tmp, target=Path(target_dir).resolve(), served_dir=final)
        replace_dir(tmp, final)
        write_json(out_dir / "train_summary.json", summary)
    save_state(accelerator, out_dir / "state", step)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary


#: Intermediate drafter exports live in ``<out_dir>/step_<N>/`` (N zero-padded to 6 digits).
STEP_EXPORT_PREFIX = "step_"


def export_step(drafter, out_dir: Path, step: int, zero_target_features: bool = False) -> Path:
    """Export the drafter at ``step`` as a servable checkpoint ``<out_dir>/step_<N>/`` (atomic), so the
    eval stage can chart τ across training (``evaluate.step_checkpoints`` finds them)."""
    final = out_dir / f"{STEP_EXPORT_PREFIX}{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    M.save_drafter(drafter, tmp, extra={"train_steps": step, "zero_target_features": zero_target_features})
    _write_serve_md(tmp, served_dir=final)
    replace_dir(tmp, final)
    return final


def _write_serve_md(export_dir: Path, target=None, served_dir=None) -> None:
    """``<export>/serve.md``: the vLLM and SGLang launch lines of this export (``engine.write_serve_md``);
    ``served_dir``: where ``export_dir`` (a temp dir) is renamed to."""
    from .engine import write_serve_md

    write_serve_md(export_dir, target=target, served_dir=served_dir)


def trace_batch(out_dir: Path, rank: int, step: int, batch: dict) -> None:
    """Append ``{step, batch: sha1 of the input ids}`` to ``trace/rank{rank}.jsonl`` (data-parallel checks)."""
    import hashlib

    path = out_dir / "trace" / f"rank{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha1(batch["input_ids"].cpu().numpy().tobytes()).hexdigest()
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"step": step, "batch": digest}) + "\n")


def save_state(accelerator, state_dir: Path, step: int) -> None:
    """Save Accelerate state (model, optimizer, scheduler, RNG) and the step counter, atomically."""
    tmp = state_dir.with_name(state_dir.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "step.json").write_text(json.dumps({"step": step}))
        replace_dir(tmp, state_dir)
    accelerator.wait_for_everyone()


def main(argv: Optional[Sequence[str]] = None) -> None:
    """CLI used under ``accelerate launch -m dflash_pipeline.train``."""
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
    p.add_argument("--feature-shard", dest="feature_shards", action="append", default=[],
                   help="a feature shard (repeat, one per token shard, same order; train.target_features: shards)")
    p.add_argument("token_shards", nargs="+")
    a = p.parse_args(argv)
    probe = json.loads(Path(a.probe).read_text(encoding="utf-8"))
    train(
        token_shards=a.token_shards, probe=probe, target_dir=a.target, out_dir=a.out_dir,
        cfg=json.loads(a.train_config), target_dtype=a.target_dtype, trust_remote_code=a.trust_remote_code,
        zero_target_features=a.zero_target_features,
        drafter_arch=json.loads(a.drafter_arch), device=a.device, feature_shards=a.feature_shards,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
