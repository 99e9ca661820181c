"""Train a DFlash drafter with HF Accelerate, target frozen and run online for its features.

Launched by the ``train_drafter`` rule as ``accelerate launch … -m dflash_pipeline.train …`` (1..N GPUs,
or N CPU ranks over gloo; see :func:`dflash_pipeline.workflow.accelerate_launch_args`). Method: reference/dflash.md §4 (anchors,
block mask, same-position labels, decayed CE), §4.7 (AdamW, warmup + cosine, clipping, fp32 master
weights under bf16 autocast), §5.3 (online target features).

Outputs under ``out_dir``: ``final/`` (servable checkpoint, written atomically), ``state/`` (Accelerate
state for resume; a killed run restarts at its last saved step), ``train_log.jsonl`` (one JSON per
logged step), ``train_summary.json`` and ``step_<N>/`` (an intermediate servable export at every state save,
``save_every_steps``; the eval stage charts τ across them).
"""

from __future__ import annotations

import argparse
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

from . import model as M
from . import target as T
from .shards import read_parquet, replace_dir, write_json


# ---------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------


def load_token_shards(paths: Sequence[str | Path], *, min_loss_tokens: int = 2) -> list[tuple[np.ndarray, np.ndarray]]:
    """Read token shards into ``(input_ids int32 [S], loss_mask uint8 [S])`` pairs, in path order.

    Records with fewer than ``min_loss_tokens`` supervised tokens cannot yield an anchor and are skipped.
    """
    out = []
    for p in paths:
        table = read_parquet(p)
        ids = table.column("input_ids").to_pylist()
        masks = table.column("loss_mask").to_pylist()
        for i, m in zip(ids, masks):
            if sum(m) >= min_loss_tokens:
                out.append((np.asarray(i, dtype=np.int32), np.asarray(m, dtype=np.uint8)))
    return out


class TokenDataset(torch.utils.data.Dataset):
    """Map-style dataset over ``(input_ids int32 [S], loss_mask uint8 [S])`` records (see :func:`collate`)."""

    def __init__(self, records):
        self.records = records

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        return self.records[i]


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
    normalisation (:func:`dflash_pipeline.model.loss_normalizer`).
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

    def __post_init__(self):
        self.embed = self.embed if self.embed is not None else T.input_embeddings(self.target)
        self.lm_head = self.lm_head if self.lm_head is not None else T.lm_head(self.target)


def training_step(ctx: StepContext, batch: dict) -> tuple[torch.Tensor, dict]:
    """One forward pass: target features → anchors → blocks → drafter → decayed CE (dflash.md §4).

    ``batch``: ``input_ids`` long [b, S], ``loss_mask`` uint8 [b, S], ``attention_mask`` long [b, S].
    Dtypes (dflash_pipeline.target): the target runs in its dtype, the drafter in its parameter dtype
    (inputs cast; Accelerate's autocast, when on, covers the drafter forward), the LM head in its dtype,
    the CE in float32. The loss is divided by the global weight sum over ranks / world size.

    Returns ``(loss scalar float32, stats)`` (see :func:`dflash_pipeline.model.decayed_cross_entropy`).
    """
    ids, lmask, am = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
    d = ctx.probe["drafter"]
    with torch.no_grad():
        if ctx.zero_target_features:  # the ablation never looks at the target: skip its forward pass
            k_h = len(d["target_layer_ids"]) * ctx.embed.weight.shape[1]
            feats = torch.zeros(*ids.shape, k_h, dtype=ctx.embed.weight.dtype, device=ids.device)  # [b, S, K·H]
        else:
            feats, _ = target_features(ctx.target, ids, am, d["target_layer_ids"])  # [b, S, K·H]
    anchors = M.sample_anchors(lmask.cpu(), ctx.num_anchors, generator=ctx.generator)
    anchors = M.AnchorBatch(anchors.anchors.to(ids.device), anchors.keep.to(ids.device))
    block_ids, block_pos, labels, weights = M.block_inputs_and_labels(
        ids, lmask, anchors, ctx.block_size, d["mask_token_id"], ctx.gamma)
    core = getattr(ctx.drafter, "module", ctx.drafter)
    mask = M.build_training_masks(core, anchors.anchors, ids.shape[1], ctx.backend)
    b, s = ids.shape
    ctx_pos = torch.arange(s, device=ids.device).expand(b, -1)
    with torch.no_grad():
        noise = ctx.embed(block_ids)
    noise, feats = T.to_drafter_dtype(ctx.drafter, noise, feats)
    hidden = ctx.drafter(noise, feats, ctx_pos, block_pos, attn_mask=mask)
    norm = M.loss_normalizer(weights.sum(), ctx.world_size, ctx.reduce_sum)
    return M.decayed_cross_entropy(hidden, ctx.lm_head.weight, labels, weights, normalizer=norm)


# ---------------------------------------------------------------------------------------------------
# Training loop
# ---------------------------------------------------------------------------------------------------


@dataclass
class _Window:
    """Running totals between two log lines."""

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

    def add(self, loss: float, stats: dict, tokens: int) -> None:
        c, t = M.slot_accuracy(stats, self.block_size)
        self.loss += loss
        self.n += 1
        self.correct += c
        self.total += t
        self.tokens += tokens


def _log_window(accelerator, w: _Window, *, step: int, total_steps: int, epoch: int, lr: float, log_path: Path) -> None:
    """Reduce the window's slot counts over ranks and append one ``train_log.jsonl`` record (main rank)."""
    totals = accelerator.reduce(torch.stack([w.correct, w.total]).to(accelerator.device), "sum").cpu()
    acc = (totals[0] / totals[1].clamp(min=1)).tolist()
    elapsed = time.time() - w.t0
    rec = {
        "step": step, "epoch": epoch, "loss": w.loss / w.n, "lr": lr, "slot_acc": acc,
        "eal": M.expected_acceptance_length(acc),
        "tokens_per_s": w.tokens * accelerator.num_processes / max(1e-9, elapsed), "elapsed_s": elapsed,
    }
    if accelerator.is_main_process:
        with open(log_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec) + "\n")
        print(f"[train] step {step}/{total_steps} loss {rec['loss']:.4f} eal {rec['eal']:.2f} acc1 {acc[1]:.3f}", flush=True)


def _resume(accelerator, out_dir: Path, total_steps: int) -> int:
    """Load ``state/`` when present and return its step; on a fresh start clear the old log and exports."""
    state_dir = out_dir / "state"
    step = 0
    if (state_dir / "step.json").is_file():
        accelerator.load_state(str(state_dir))
        step = json.loads((state_dir / "step.json").read_text())["step"]
        accelerator.print(f"[train] resumed from {state_dir} at step {step}/{total_steps}")
    if accelerator.is_main_process and step == 0:
        (out_dir / "train_log.jsonl").unlink(missing_ok=True)
        for old in out_dir.glob(f"{STEP_EXPORT_PREFIX}*"):  # intermediate exports of an earlier run
            shutil.rmtree(old, ignore_errors=True)
    return step


def make_accelerator(cfg: dict):
    """The run's ``Accelerator``: CPU when ``train.device`` is ``cpu`` or no CUDA device is visible, with
    ``train.mixed_precision`` (bf16 autocast works on CPU too, which is how the tests exercise it)."""
    from accelerate import Accelerator

    cpu = cfg["device"] == "cpu" or not torch.cuda.is_available()
    return Accelerator(cpu=cpu, mixed_precision=cfg["mixed_precision"])


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
) -> dict:
    """Train the drafter; see the module docstring for outputs. ``cfg`` is the validated ``train`` config.

    ``target_dtype`` / ``trust_remote_code``: ``target.dtype`` / ``target.trust_remote_code``
    (:func:`dflash_pipeline.target.load_target`; ``auto`` = bf16 on CUDA, fp32 on CPU). The drafter keeps
    float32 master weights; ``train.mixed_precision`` sets Accelerate's autocast.
    ``drafter_arch`` holds the optional ``layer_types``/``sliding_window`` (config ``drafter.*``).
    ``zero_target_features`` trains the ablation baseline whose fused features are all zero (what the
    target features buy). Returns the summary dict (also written to ``train_summary.json``).

    Raises:
        ValueError: no token record has an anchor candidate.
    """
    from accelerate.utils import set_seed

    out_dir = Path(out_dir)
    accelerator = make_accelerator(cfg)
    set_seed(cfg["seed"])
    out_dir.mkdir(parents=True, exist_ok=True)

    records = load_token_shards(token_shards)
    if not records:
        raise ValueError(f"no token record with ≥2 supervised tokens in {len(token_shards)} shard(s)")
    target = T.load_target(target_dir, dtype=target_dtype, device=accelerator.device, trust_remote_code=trust_remote_code)
    arch = drafter_arch or {}
    drafter = build_drafter(target, probe, seed=cfg["seed"], layer_types=arch.get("layer_types"), sliding_window=arch.get("sliding_window"))
    backend = cfg["attention_backend"] if cfg.get("attention_backend", "auto") != "auto" else (
        "flex" if accelerator.device.type == "cuda" else "sdpa")
    block_size = drafter.block_size
    gamma = cfg.get("loss_gamma") or M.loss_decay_gamma(block_size)
    n_trainable = M.count_parameters(drafter)

    bs, nproc = cfg["batch_size"], accelerator.num_processes
    steps_per_epoch = math.ceil(len(records) / (bs * nproc))
    total_steps = max(1, math.ceil(cfg["epochs"] * steps_per_epoch))
    warmup = int(cfg["warmup_ratio"] * total_steps)

    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg["learning_rate"], weight_decay=cfg["weight_decay"], betas=(0.9, 0.999), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: M.cosine_with_warmup(s, total_steps, warmup))
    loader = torch.utils.data.DataLoader(
        TokenDataset(records), batch_size=bs, shuffle=True, collate_fn=collate, drop_last=False,
        generator=torch.Generator().manual_seed(cfg["seed"]),
    )
    drafter, optimizer, loader = accelerator.prepare(drafter, optimizer, loader)
    accelerator.register_for_checkpointing(scheduler)
    step = _resume(accelerator, out_dir, total_steps)
    accelerator.print(
        f"[train] records={len(records)} processes={nproc} device={accelerator.device} steps={total_steps} "
        f"trainable_params={n_trainable} block_size={block_size} gamma={gamma} target_layer_ids={probe['drafter']['target_layer_ids']} "
        f"target_dtype={T.module_dtype(target)} mixed_precision={cfg['mixed_precision']}"
    )
    ctx = StepContext(
        drafter=drafter, target=target, probe=probe, num_anchors=cfg["num_anchors"], block_size=block_size, gamma=gamma,
        generator=torch.Generator(device="cpu").manual_seed(cfg["seed"] * 1000 + accelerator.process_index),
        zero_target_features=zero_target_features, backend=backend, world_size=nproc,
        reduce_sum=lambda t: accelerator.reduce(t.to(accelerator.device), "sum"),
    )
    window = _Window(block_size)
    drafter.train()
    while step < total_steps:
        epoch = step // steps_per_epoch
        loader.set_epoch(epoch)
        skip = step - epoch * steps_per_epoch
        for batch in (accelerator.skip_first_batches(loader, skip) if skip else loader):
            if cfg.get("trace_batches"):
                trace_batch(out_dir, accelerator.process_index, step, batch)
            loss, stats = training_step(ctx, batch)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(drafter.parameters(), cfg["max_grad_norm"])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            # the rank losses average to the global loss (loss_normalizer), so log their mean
            window.add(float(accelerator.reduce(loss.detach(), "mean")), stats, int(batch["attention_mask"].sum()))
            if step % cfg["log_every_steps"] == 0 or step == total_steps:
                _log_window(accelerator, window, step=step, total_steps=total_steps, epoch=epoch,
                            lr=scheduler.get_last_lr()[0], log_path=out_dir / "train_log.jsonl")
                window = _Window(block_size)
            if step % cfg["save_every_steps"] == 0 and step < total_steps:
                save_state(accelerator, out_dir / "state", step)
                if accelerator.is_main_process:
                    export_step(accelerator.unwrap_model(drafter), out_dir, step, zero_target_features)
            if step >= total_steps:
                break
    return _finish(accelerator, drafter, out_dir, step, {
        "steps": total_steps, "records": len(records), "num_processes": nproc, "trainable_params": n_trainable,
        "block_size": block_size, "loss_gamma": gamma, "zero_target_features": zero_target_features,
        "attention_backend": backend, "layer_types": accelerator.unwrap_model(drafter).layer_types,
        "target_dtype": str(T.module_dtype(target)).replace("torch.", ""), "train_config": cfg,
    })


def _finish(accelerator, drafter, out_dir: Path, step: int, summary: dict) -> dict:
    """Export ``final/`` (atomic), write ``train_summary.json``, save the last state; returns ``summary``."""
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        final = out_dir / "final"
        tmp = out_dir / "final.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        M.save_drafter(accelerator.unwrap_model(drafter), tmp,
                       extra={"train_steps": summary["steps"], "zero_target_features": summary["zero_target_features"]})
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
    replace_dir(tmp, final)
    return final


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
    p.add_argument("--zero-target-features", action="store_true")
    p.add_argument("--drafter-arch", default="{}", help="JSON with optional layer_types / sliding_window")
    p.add_argument("token_shards", nargs="+")
    a = p.parse_args(argv)
    probe = json.loads(Path(a.probe).read_text(encoding="utf-8"))
    train(
        token_shards=a.token_shards, probe=probe, target_dir=a.target, out_dir=a.out_dir,
        cfg=json.loads(a.train_config), target_dtype=a.target_dtype, trust_remote_code=a.trust_remote_code,
        zero_target_features=a.zero_target_features,
        drafter_arch=json.loads(a.drafter_arch),
    )


if __name__ == "__main__":
    main(sys.argv[1:])
