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
from typing import Any, Optional, Sequence

import numpy as np
import torch

from . import model as M
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


def target_features(target, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], layer_ids: Sequence[int], **kw):
    """Run the frozen target and concatenate the outputs of decoder layers ``layer_ids``.

    Uses :func:`dflash_pipeline.probe.hf_hidden_state_index` (the one canonical→HF conversion: id+1).
    Returns ``(features [b, S, K·H] in the target dtype, model output)``.
    """
    from .probe import hf_hidden_state_index

    out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, **kw)
    feats = torch.cat([out.hidden_states[hf_hidden_state_index(l)] for l in layer_ids], dim=-1)
    return feats, out


def load_target(target_dir: str | Path, *, dtype: str = "auto", device: str | torch.device = "cpu"):
    """Load the frozen target (eval mode, ``requires_grad=False``). ``auto`` = fp32 on CPU, bf16 on GPU."""
    from transformers import AutoModelForCausalLM

    dev = torch.device(device)
    if dtype == "auto":
        torch_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    else:
        torch_dtype = getattr(torch, dtype)
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch_dtype)
    target.to(dev).eval()
    target.requires_grad_(False)
    return target


def build_drafter(target, probe: dict, *, seed: int = 0, layer_types=None, sliding_window=None) -> M.DFlashDrafter:
    """Random-init drafter sized from the target config and the probe's drafter decisions
    (``layer_types``/``sliding_window``: optional sliding-window draft layers, config ``drafter.*``)."""
    d = probe["drafter"]
    cfg = M.drafter_config_from_target(
        target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config,
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
# Training loop
# ---------------------------------------------------------------------------------------------------


def train(
    *,
    token_shards: Sequence[str | Path],
    probe: dict,
    target_dir: str | Path,
    out_dir: str | Path,
    cfg: dict,
    target_dtype: str = "auto",
    zero_target_features: bool = False,
    drafter_arch: Optional[dict] = None,
) -> dict:
    """Train the drafter; see the module docstring for outputs. ``cfg`` is the validated ``train`` config.

    ``drafter_arch`` holds the optional ``layer_types``/``sliding_window`` (config ``drafter.*``).
    ``zero_target_features`` trains the ablation baseline whose fused features are all zero (what the
    target features buy). Returns the summary dict (also written to ``train_summary.json``).

    Raises:
        ValueError: no token record has an anchor candidate.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    out_dir = Path(out_dir)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=cfg.get("mixed_precision", "no"))
    set_seed(cfg["seed"])
    is_main = accelerator.is_main_process
    out_dir.mkdir(parents=True, exist_ok=True)

    records = load_token_shards(token_shards)
    if not records:
        raise ValueError(f"no token record with ≥2 supervised tokens in {len(token_shards)} shard(s)")
    target = load_target(target_dir, dtype=target_dtype, device=accelerator.device)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    arch = drafter_arch or {}
    drafter = build_drafter(target, probe, seed=cfg["seed"], layer_types=arch.get("layer_types"), sliding_window=arch.get("sliding_window"))
    backend = cfg.get("attention_backend", "auto")
    if backend == "auto":
        backend = "flex" if accelerator.device.type == "cuda" else "sdpa"
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

    state_dir = out_dir / "state"
    step = 0
    if (state_dir / "step.json").is_file():
        accelerator.load_state(str(state_dir))
        step = json.loads((state_dir / "step.json").read_text())["step"]
        accelerator.print(f"[train] resumed from {state_dir} at step {step}/{total_steps}")
    log_path = out_dir / "train_log.jsonl"
    if is_main and step == 0 and log_path.exists():
        log_path.unlink()
    if is_main and step == 0:
        for old in out_dir.glob(f"{STEP_EXPORT_PREFIX}*"):  # intermediate exports of an earlier run
            shutil.rmtree(old, ignore_errors=True)
    accelerator.print(
        f"[train] records={len(records)} processes={nproc} device={accelerator.device} steps={total_steps} "
        f"trainable_params={n_trainable} block_size={block_size} gamma={gamma} target_layer_ids={probe['drafter']['target_layer_ids']}"
    )

    gen = torch.Generator(device="cpu").manual_seed(cfg["seed"] * 1000 + accelerator.process_index)
    t0 = time.time()
    window = {"loss": 0.0, "n": 0, "correct": torch.zeros(block_size), "total": torch.zeros(block_size), "tokens": 0}
    drafter.train()
    done = step >= total_steps
    while not done:
        epoch = step // steps_per_epoch
        loader.set_epoch(epoch)
        skip = step - epoch * steps_per_epoch
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        for batch in batches:
            if cfg.get("trace_batches"):
                trace_batch(out_dir, accelerator.process_index, step, batch)
            loss, stats = training_step(
                drafter, target, embed, lm_head, batch, probe, cfg, block_size, gamma, gen, zero_target_features, backend
            )
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(drafter.parameters(), cfg["max_grad_norm"])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            c, t = M.slot_accuracy(stats, block_size)
            window["loss"] += float(loss.detach())
            window["n"] += 1
            window["correct"] += c
            window["total"] += t
            window["tokens"] += int(batch["attention_mask"].sum())
            if step % cfg["log_every_steps"] == 0 or step == total_steps:
                totals = accelerator.reduce(torch.stack([window["correct"], window["total"]]).to(accelerator.device), "sum").cpu()
                acc = (totals[0] / totals[1].clamp(min=1)).tolist()
                rec = {
                    "step": step, "epoch": epoch, "loss": window["loss"] / window["n"], "lr": scheduler.get_last_lr()[0],
                    "slot_acc": acc, "eal": M.expected_acceptance_length(acc),
                    "tokens_per_s": window["tokens"] * nproc / max(1e-9, time.time() - t0), "elapsed_s": time.time() - t0,
                }
                if is_main:
                    with open(log_path, "a", encoding="utf-8") as fh:
                        fh.write(json.dumps(rec) + "\n")
                    print(f"[train] step {step}/{total_steps} loss {rec['loss']:.4f} eal {rec['eal']:.2f} acc1 {acc[1]:.3f}", flush=True)
                window = {"loss": 0.0, "n": 0, "correct": torch.zeros(block_size), "total": torch.zeros(block_size), "tokens": 0}
                t0 = time.time()
            if step % cfg["save_every_steps"] == 0 and step < total_steps:
                save_state(accelerator, state_dir, step)
                if is_main:
                    export_step(accelerator.unwrap_model(drafter), out_dir, step, zero_target_features)
            if step >= total_steps:
                done = True
                break

    accelerator.wait_for_everyone()
    summary = {
        "steps": total_steps, "records": len(records), "num_processes": nproc, "trainable_params": n_trainable,
        "block_size": block_size, "loss_gamma": gamma, "zero_target_features": zero_target_features,
        "attention_backend": backend, "layer_types": accelerator.unwrap_model(drafter).layer_types,
        "train_config": cfg,
    }
    if is_main:
        final = out_dir / "final"
        tmp = out_dir / "final.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        M.save_drafter(accelerator.unwrap_model(drafter), tmp, extra={"train_steps": total_steps, "zero_target_features": zero_target_features})
        replace_dir(tmp, final)
        _write_serve_md(final, target=Path(target_dir).resolve())
        write_json(out_dir / "train_summary.json", summary)
    save_state(accelerator, state_dir, step)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary


def training_step(drafter, target, embed, lm_head, batch, probe, cfg, block_size, gamma, gen, zero_target_features=False, backend="sdpa"):
    """One forward pass: target features → anchors → blocks → drafter → decayed CE (dflash.md §4).

    Returns ``(loss scalar, stats)``.
    """
    ids, lmask, am = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
    d = probe["drafter"]
    with torch.no_grad():
        if zero_target_features:  # the ablation never looks at the target: skip its forward pass
            k_h = len(d["target_layer_ids"]) * embed.weight.shape[1]
            feats = torch.zeros(*ids.shape, k_h, dtype=embed.weight.dtype, device=ids.device)  # [b, S, K·H]
        else:
            feats, _ = target_features(target, ids, am, d["target_layer_ids"])  # [b, S, K·H]
    anchors = M.sample_anchors(lmask.cpu(), cfg["num_anchors"], generator=gen)
    anchors = M.AnchorBatch(anchors.anchors.to(ids.device), anchors.keep.to(ids.device))
    block_ids, block_pos, labels, weights = M.block_inputs_and_labels(ids, lmask, anchors, block_size, d["mask_token_id"], gamma)
    core = drafter.module if hasattr(drafter, "module") else drafter
    mask = M.build_training_masks(core, anchors.anchors, ids.shape[1], backend)
    b, s = ids.shape
    ctx_pos = torch.arange(s, device=ids.device).expand(b, -1)
    with torch.no_grad():
        noise = embed(block_ids)
    hidden = drafter(noise.to(feats.dtype), feats, ctx_pos, block_pos, attn_mask=mask)
    return M.decayed_cross_entropy(hidden, lm_head.weight, labels, weights)


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
    _write_serve_md(final)
    return final


def _write_serve_md(export_dir: Path, target=None) -> None:
    """``<export>/serve.md``: the vLLM and SGLang launch lines of this export (``engine.write_serve_md``)."""
    from .engine import write_serve_md

    write_serve_md(export_dir, target=target)


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
    p.add_argument("--target-dtype", default="auto")
    p.add_argument("--zero-target-features", action="store_true")
    p.add_argument("--drafter-arch", default="{}", help="JSON with optional layer_types / sliding_window")
    p.add_argument("token_shards", nargs="+")
    a = p.parse_args(argv)
    probe = json.loads(Path(a.probe).read_text(encoding="utf-8"))
    train(
        token_shards=a.token_shards, probe=probe, target_dir=a.target, out_dir=a.out_dir,
        cfg=json.loads(a.train_config), target_dtype=a.target_dtype, zero_target_features=a.zero_target_features,
        drafter_arch=json.loads(a.drafter_arch),
    )


if __name__ == "__main__":
    main(sys.argv[1:])
