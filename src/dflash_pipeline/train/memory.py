"""The memory plan: peak device memory of one training step per trainer rank, known at planning.

`plan_step_memory` runs two training steps of the configured drafter (the second holds the optimizer
state) under torch's memory tracker (`torch.distributed._tools.mem_tracker.MemTracker`) with every
floating-point tensor a fake tensor (`FakeTensorMode`): shapes, dtypes and storages are real, nothing is
computed or allocated. The step calls the trainer's own functions, so the plan follows the code. The
integer bookkeeping of a batch is real (anchor sampling reads values). The plan is the worst case: every
row `seq_len` tokens, `num_anchors` anchors, every draft slot supervised.

A `flex` run is planned with SDPA's fused kernel without a mask (the tracker cannot follow FlexAttention's
higher-order operator; both keep the same tensors for backward). With `train.fsdp` weights, gradients and
optimizer state are divided over the ranks plus one gathered layer; with `train.target_features: online`
the target's weights are added, its no-grad activations are not. Checked against a real CPU step (within
10 %, tests/unit/train/test_memory_plan.py) and `torch.cuda.max_memory_allocated` (`bench/gpu_check.sh`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

from dflash_pipeline.core.plan_cache import (
    cache_root,
    cached_json,
    installed_version,
    source_digest,
    target_config_key,
)

if TYPE_CHECKING:  # pragma: no cover - torch is imported by the functions that step: a cached plan needs none of it
    import torch

#: Bytes per GB in plans and in `train.device_memory_gb` (decimal, as GPU data sheets count).
GB = 1e9
#: Revision of what the plan measures; a new value invalidates cached plans.
PLAN_REVISION = 2


@dataclass(frozen=True)
class StepSettings:
    """What sizes one training step of one rank (the `train` keys and the probe's drafter decisions).

    `seq_len`: tokens per row (`tokens.max_length`, or `train.pack_max_tokens` with packing);
    `head_dtype`: dtype of the target features, embedding and LM head (the target's); `shards`: the FSDP
    degree (1 without `train.fsdp`); `backend`: `sdpa` or `flex`; `target_params_bytes`: the frozen
    target's weights on the rank (`target_features: online`), else 0.
    """

    batch_size: int
    seq_len: int
    num_anchors: int
    block_size: int
    num_draft_layers: int
    num_target_features: int
    layer_types: Optional[tuple] = None
    sliding_window: Optional[int] = None
    mixed_precision: str = "no"
    head_dtype: str = "float32"
    optimizer: str = "adamw"
    gradient_checkpointing: bool = False
    shards: int = 1
    loss: str = "ce_decay"
    loss_chunk_tokens: int = 4096
    backend: str = "sdpa"
    target_params_bytes: int = 0


@dataclass
class MemoryPlan:
    """One rank's planned peak (bytes) and what it is made of at the peak."""

    peak_bytes: int
    by_kind: dict
    settings: StepSettings

    @property
    def peak_gb(self) -> float:
        return self.peak_bytes / GB

    def to_json(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "by_kind": self.by_kind, "settings": dataclasses.asdict(self.settings)}

    @classmethod
    def from_json(cls, rec: dict) -> "MemoryPlan":
        st = dict(rec["settings"])
        st["layer_types"] = tuple(st["layer_types"]) if st.get("layer_types") else None
        return cls(int(rec["peak_bytes"]), dict(rec["by_kind"]), StepSettings(**st))


class _FrozenInputs(NamedTuple):
    """The frozen tensors a step reads: embedding, LM head (the embedding when tied), target features
    [b, S, K·H] and (`kl` only) the teacher's input, the target's last hidden state."""

    embed: torch.Tensor
    head: torch.Tensor
    feats: torch.Tensor
    last: Optional[torch.Tensor]


def _build_step_model(target_config, st: StepSettings, mode) -> tuple[torch.nn.Module, _FrozenInputs]:
    """The drafter of `st` and the frozen tensors of one step, built under `mode` (a fake tensor mode; None:
    real tensors)."""
    import torch

    from dflash_pipeline.drafter.build import build_drafter
    from dflash_pipeline.train.data import ConfigOnly

    b, s, k = st.batch_size, st.seq_len, st.num_target_features
    h, v = target_config.hidden_size, target_config.vocab_size
    head_dtype = getattr(torch, st.head_dtype)
    probe = {
        "drafter": {
            "block_size": st.block_size,
            "num_draft_layers": st.num_draft_layers,
            "target_layer_ids": list(range(k)),
            "mask_token_id": 0,
        }
    }
    with mode if mode is not None else contextlib.nullcontext():
        drafter = build_drafter(
            ConfigOnly(target_config),
            probe,
            layer_types=list(st.layer_types) if st.layer_types else None,
            sliding_window=st.sliding_window,
        )
        drafter.gradient_checkpointing = st.gradient_checkpointing
        embed = torch.zeros(v, h, dtype=head_dtype)
        head = embed if getattr(target_config, "tie_word_embeddings", False) else torch.zeros(v, h, dtype=head_dtype)
        feats = torch.zeros(b, s, k * h, dtype=head_dtype)  # [b, S, K·H]
        last = torch.zeros(b, s, h, dtype=head_dtype) if st.loss in ("kl",) else None  # the teacher's input
    return drafter, _FrozenInputs(embed, head, feats, last)


def _worst_case_batch(st: StepSettings, vocab_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The real token ids and loss mask of a worst-case batch: every row `seq_len` tokens, a short prompt
    unsupervised, then an answer in which every anchor candidate is supervised."""
    import torch

    b, s = st.batch_size, st.seq_len
    ids = torch.randint(1, vocab_size, (b, s), generator=gen)
    lmask = torch.ones(b, s, dtype=torch.uint8)
    lmask[:, : max(1, s // 8)] = 0  # a prompt, then the answer: every anchor candidate is supervised
    return ids, lmask


def _autocast_context(st: StepSettings):
    """The CPU autocast of `st.mixed_precision` (bf16 / fp16), or a null context for `no`."""
    if st.mixed_precision == "no":
        return contextlib.nullcontext()
    import torch

    return torch.autocast("cpu", dtype=getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[st.mixed_precision]))


def _run_tracked_steps(
    tracker,
    st: StepSettings,
    mode,
    drafter: torch.nn.Module,
    optimizer,
    frozen: _FrozenInputs,
    batch: tuple[torch.Tensor, torch.Tensor],
    gen: torch.Generator,
) -> None:
    """Two training steps (anchors, block inputs, masks, drafter, loss, backward, optimizer step) under
    `tracker`; the second holds the optimizer state the first one created. `mode`: the fake tensor mode
    (None: real tensors)."""
    import torch
    import torch.nn.functional as F

    from dflash_pipeline.drafter import model as M
    from dflash_pipeline.target import loading as T
    from dflash_pipeline.train import losses as L

    ids, lmask = batch
    b, s = ids.shape
    gamma = M.loss_decay_gamma(st.block_size)
    autocast = _autocast_context(st)
    with tracker:
        for _ in range(2):  # the second step holds the optimizer state the first one created
            anchors = M.sample_anchors(lmask, st.num_anchors, generator=gen)
            block_ids, block_pos, labels, weights = M.block_inputs_and_labels(
                ids, lmask, anchors, st.block_size, 0, gamma
            )
            # masks: fake, never dense-real
            anchor_pos = mode.from_tensor(anchors.anchors) if mode is not None else anchors.anchors
            # flex: SDPA's fused kernel without a mask stands in (module docstring); sdpa: the dense masks it builds
            mask = None if st.backend == "flex" else M.build_training_masks(drafter, anchor_pos, s, "sdpa")
            with torch.no_grad():
                # the frozen embedding (a tensor: the tracker hooks modules)
                noise = F.embedding(block_ids, frozen.embed)
            noise, x = T.to_drafter_dtype(drafter, noise, frozen.feats)
            ctx_pos = torch.arange(s).expand(b, -1)
            with autocast:
                hidden = drafter(noise, x, ctx_pos, block_pos, attn_mask=mask)
            teacher = L.teacher_slot_hidden(frozen.last, block_pos) if frozen.last is not None else None
            out = L.compute_loss(
                st.loss,
                hidden,
                frozen.head,
                labels,
                weights,
                st.block_size,
                teacher_hidden=teacher,
                chunk_tokens=st.loss_chunk_tokens,
            )
            out.total.backward()
            del out, hidden, noise, x, mask, teacher
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tracker.reset_mod_stats()


def _plan_from_snapshot(snap: dict, drafter: torch.nn.Module, st: StepSettings) -> MemoryPlan:
    """The `MemoryPlan` of the tracker's peak snapshot, with FSDP2 sharding (a 1/D shard of weights,
    gradients and optimizer state plus one gathered draft layer) and an online target's weights applied."""
    dev = next(iter(snap))
    kinds = {str(getattr(key, "value", key)): int(val) for key, val in snap[dev].items() if key != "Total"}
    peak = int(snap[dev]["Total"])
    if st.shards > 1:  # FSDP2: a 1/D shard of each, and one gathered draft layer at a time
        sharded = sum(kinds.get(x, 0) for x in ("Parameter", "Gradient", "Optstate"))
        layer = sum(p.numel() * p.element_size() for p in drafter.layers[0].parameters())
        for x in ("Parameter", "Gradient", "Optstate"):
            kinds[x] = kinds.get(x, 0) // st.shards
        kinds["gathered layer"] = layer
        peak = peak - sharded + sharded // st.shards + layer
    if st.target_params_bytes:
        kinds["target"] = int(st.target_params_bytes)
        peak += int(st.target_params_bytes)
    return MemoryPlan(peak, kinds, st)


def plan_step_memory(target_config, st: StepSettings, *, fake: bool = True) -> MemoryPlan:
    """The peak memory of one training step of one rank (module docstring). `target_config`: the target's
    text config (a `transformers` config). `fake=False` runs the same two steps on real tensors (CPU),
    the reference the plan is checked against at small sizes.

    Raises:
        ValueError: settings the trainer would refuse too (sliding layers without a window, an unknown
            optimizer or loss).
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from dflash_pipeline.train import optim as OPT

    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    drafter, frozen = _build_step_model(target_config, st, mode)
    drafter.train()
    optimizer = OPT.make_optimizer(drafter, st.optimizer, lr=1e-4, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    batch = _worst_case_batch(st, target_config.vocab_size, gen)
    tracker = MemTracker()
    extra = [frozen.last] if frozen.last is not None else []
    tracker.track_external(drafter, optimizer, frozen.embed, frozen.head, frozen.feats, *extra)
    _run_tracked_steps(tracker, st, mode, drafter, optimizer, frozen, batch, gen)
    return _plan_from_snapshot(tracker.get_tracker_snapshot("peak"), drafter, st)


def target_params_bytes(target_config, dtype: str) -> int:
    """Bytes of the target's weights in `dtype` (counted on the meta device: nothing is allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(target_config)
    return sum(p.numel() for p in model.parameters()) * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def plan_cache_dir() -> Path:
    """Where `cached_plan` keeps plans: `memory-plans` under `core.plan_cache.cache_root` (`$DFLASH_CACHE_DIR`, else
    `$XDG_CACHE_HOME/dflash-pipeline`)."""
    return cache_root() / "memory-plans"


#: The sources a plan steps through (drafter, masks, blocks, objectives, optimizer) and this module, relative to
#: the package; read as files, so a cache lookup imports none of them.
_PLANNED_SOURCES = (
    "drafter/attention_masks.py",
    "drafter/blocks.py",
    "drafter/config.py",
    "drafter/model.py",
    "drafter/rope.py",
    "train/losses.py",
    "train/optim.py",
    "train/memory.py",
)


def _cached(
    cache_dir: Optional[str | Path],
    key: dict,
    compute: Callable[[], Any],
    decode: Optional[Callable[[Any], Any]] = None,
):
    """`core.plan_cache.cached_json` with the plan revision, torch's installed version and the digest of
    `_PLANNED_SOURCES` in the key: a cached plan is one of this code and this torch."""
    full = {
        "revision": PLAN_REVISION,
        "torch": installed_version("torch"),
        "code": source_digest(*_PLANNED_SOURCES),
        **key,
    }
    return cached_json(cache_dir, full, compute, decode)


def cached_plan(target_config, st: StepSettings, cache_dir: Optional[str | Path]) -> MemoryPlan:
    """`plan_step_memory`, cached in `cache_dir` (one JSON per target config and settings; None =
    no cache), so a repeated `snakemake -n` pays nothing."""
    key = {"target": target_config.to_dict(), "settings": dataclasses.asdict(st)}
    return _cached(cache_dir, key, lambda: plan_step_memory(target_config, st).to_json(), MemoryPlan.from_json)


def head_dtype_of(cfg: dict) -> str:
    """The dtype of the target features, embedding and LM head of a validated config's run: `target.dtype`, or
    with `auto` bf16 when the run trains on GPUs (`train.device` auto with mixed precision), else float32."""
    gpu = cfg["train"]["device"] == "auto" and cfg["train"]["mixed_precision"] != "no"
    dtype = cfg["target"]["dtype"]
    return dtype if dtype != "auto" else ("bfloat16" if gpu else "float32")


def settings_from_config(
    cfg: dict, *, num_target_features: int, block_size: int, target_params: int = 0
) -> StepSettings:
    """`StepSettings` of a validated config (`cfg`: the whole config): `train.*`, `tokens.max_length`, `drafter.*`,
    and where the run trains. `target_params`: the bytes of the target's weights, counted with `train.target_features:
    online` only."""
    tr, dr = cfg["train"], cfg["drafter"]
    gpu = tr["device"] == "auto" and tr["mixed_precision"] != "no"
    from dflash_pipeline.drafter.attention_masks import training_attention_backend

    backend = training_attention_backend(tr["attention_backend"], "cuda" if gpu else "cpu")
    head_dtype = head_dtype_of(cfg)
    ranks = tr["num_processes"] * (tr.get("num_machines") or 1)
    seq = (tr.get("pack_max_tokens") or cfg["tokens"]["max_length"]) if tr["packing"] else cfg["tokens"]["max_length"]
    return StepSettings(
        batch_size=tr["batch_size"],
        seq_len=int(seq),
        num_anchors=tr["num_anchors"],
        block_size=int(block_size),
        num_draft_layers=dr["num_draft_layers"],
        num_target_features=int(num_target_features),
        layer_types=tuple(dr["layer_types"]) if dr.get("layer_types") else None,
        sliding_window=dr.get("sliding_window"),
        mixed_precision=tr["mixed_precision"],
        head_dtype=head_dtype,
        optimizer=tr.get("optimizer", "adamw"),
        gradient_checkpointing=bool(tr.get("gradient_checkpointing", False)),
        shards=ranks if tr["fsdp"] else 1,
        loss=tr["loss"] if tr["loss"] in ("ce_decay", "dpace", "kl") else "ce_decay",
        loss_chunk_tokens=tr.get("loss_chunk_tokens", 4096),
        backend=backend,
        target_params_bytes=int(target_params) if tr["target_features"] == "online" else 0,
    )


def describe(plan: MemoryPlan, other: Optional[MemoryPlan] = None) -> str:
    """The `[plan] device memory` line: the peak per rank, what it is made of, the settings that size it, and
    (`other`: the same step with gradient checkpointing toggled) what checkpointing saves."""
    st = plan.settings
    parts = ", ".join(f"{k.lower()} {v / GB:.2f}" for k, v in sorted(plan.by_kind.items(), key=lambda kv: -kv[1]) if v)
    line = (
        f"device memory: {plan.peak_gb:.2f} GB peak per trainer rank ({parts} GB) for batch {st.batch_size} x "
        f"{st.seq_len} tokens, {st.num_anchors} anchors x block {st.block_size}, {st.num_draft_layers} draft layers, "
        f"{st.mixed_precision if st.mixed_precision != 'no' else 'fp32'} autocast, {st.head_dtype} target features/head, "
        f"{st.optimizer}, {st.backend} attention{' (planned with the SDPA kernel)' if st.backend == 'flex' else ''}, "
        + (f"FSDP over {st.shards} ranks" if st.shards > 1 else "no FSDP")
    )
    if other is not None:
        on, off = (plan, other) if st.gradient_checkpointing else (other, plan)
        saved = (off.peak_bytes - on.peak_bytes) / GB
        line += (
            f"; gradient checkpointing {'on' if st.gradient_checkpointing else 'off'} "
            f"({'saves' if st.gradient_checkpointing else 'on would save'} {saved:.2f} GB)"
        )
    return line


def over_budget(plan: MemoryPlan, budget_gb: Optional[float], other: Optional[MemoryPlan] = None) -> Optional[str]:
    """Why `plan` does not fit `budget_gb` (`train.device_memory_gb`) and which knobs help, or None when it
    fits (or no budget is set). `other`: the same step with gradient checkpointing toggled."""
    if budget_gb is None or plan.peak_bytes <= budget_gb * GB:
        return None
    st, kinds = plan.settings, plan.by_kind
    state = sum(kinds.get(x, 0) for x in ("Parameter", "Gradient", "Optstate"))
    knobs = []
    if not st.gradient_checkpointing and other is not None:
        fits = "fits" if other.peak_bytes <= budget_gb * GB else "not enough alone"
        knobs.append(f"train.gradient_checkpointing: true ({other.peak_gb:.2f} GB: {fits})")
    knobs.append(f"a lower train.num_anchors (now {st.num_anchors}; the N·B block slots size the activations)")
    knobs.append(
        f"a lower train.loss_chunk_tokens (now {st.loss_chunk_tokens}; each chunk holds [slots, vocabulary] logits)"
    )
    knobs.append(
        f"train.fsdp with more ranks (train.num_processes; {state / GB:.2f} GB of weights, gradients and optimizer "
        f"state {'over ' + str(st.shards) + ' ranks' if st.shards > 1 else 'on every rank'})"
    )
    if st.optimizer == "adamw":
        knobs.append("train.optimizer: muon (one state tensor per matrix instead of two)")
    if kinds.get("target"):
        knobs.append(
            f"train.target_features: shards or stream (the online target's {kinds['target'] / GB:.2f} GB leave the rank)"
        )
    return (
        f"train.device_memory_gb: one training step needs {plan.peak_gb:.2f} GB per trainer rank, above the "
        f"{budget_gb:g} GB set; what helps: " + "; ".join(knobs)
    )


class _NotPlanned(Exception):
    """The target's config does not load (the message says why); never cached."""


def _workflow_key(cfg: dict, target_dir: Path, num_target_features: int, block_size: int) -> dict:
    """What decides `plan_for_workflow`'s result, read without transformers: the target's `config.json` bytes (and
    its remote code under `target.trust_remote_code`), transformers' installed version (it fills the config's
    defaults), the config sections the settings come from (the target's path aside: the bytes stand for it), the
    feature count and the block size."""
    trust = bool(cfg["target"].get("trust_remote_code", False))
    return {
        "workflow": {
            **target_config_key(target_dir, trust),
            "train": {k: v for k, v in cfg["train"].items() if k != "device_memory_gb"},  # checked after, not planned
            "drafter": cfg["drafter"],
            "tokens": cfg["tokens"],
            "target": {k: v for k, v in cfg["target"].items() if k != "path"},
            "num_target_features": int(num_target_features),
            "block_size": int(block_size),
        }
    }


def _plan_pair(cfg: dict, target_dir: Path, num_target_features: int, block_size: int, cache_dir) -> dict:
    """The plan and its gradient-checkpointing twin as JSON (`{"plan", "other"}`), from the target's text config;
    each cached per target config and settings.

    Raises:
        _NotPlanned: the target's config does not load.
    """
    from dflash_pipeline.target.loading import TargetLoadError, load_target_config, text_config

    try:
        tcfg = text_config(
            load_target_config(target_dir, trust_remote_code=cfg["target"].get("trust_remote_code", False))
        )
    except TargetLoadError as exc:  # the probe stage fails on it with the fix; the plan says why it is missing
        raise _NotPlanned(str(exc)) from exc
    tbytes = 0
    if cfg["train"]["target_features"] == "online":
        tbytes = _cached(
            cache_dir,
            {"target_bytes": tcfg.to_dict(), "dtype": head_dtype_of(cfg)},
            lambda: target_params_bytes(tcfg, head_dtype_of(cfg)),
        )
    st = settings_from_config(cfg, num_target_features=num_target_features, block_size=block_size, target_params=tbytes)
    plan = cached_plan(tcfg, st, cache_dir)
    other = cached_plan(tcfg, dataclasses.replace(st, gradient_checkpointing=not st.gradient_checkpointing), cache_dir)
    return {"plan": plan.to_json(), "other": other.to_json()}


def plan_for_workflow(
    cfg: dict,
    *,
    target_dir: Optional[str | Path],
    num_target_features: int,
    block_size: int,
    cache_dir: Optional[str | Path],
) -> tuple[Optional[MemoryPlan], Optional[MemoryPlan], str]:
    """The plan of a validated config's training step and its gradient-checkpointing twin, with the `[plan]` line;
    `(None, None, why)` when the target's config is not there yet, does not load, or the family is not planned.

    Cached twice in `cache_dir` (None: no cache): by what decides the result without reading the target's config
    through transformers (`config.json`'s bytes, the config's `train`, `drafter`, `tokens` and `target` sections,
    the feature count, block size, torch's and transformers' installed versions, the planned code), so a repeated
    `snakemake -n` imports neither torch nor transformers; and per target config and settings (`cached_plan`).
    """
    from dflash_pipeline.drafter import families as FR

    family = FR.of_settings(cfg["drafter"])
    if type(family) is not type(FR.default()):  # DFlash2/DSpark add heads and objectives the plan does not step
        return (
            None,
            None,
            f"device memory: not planned for drafter.family {family.name} (the plan steps DFlash's objective)",
        )
    if target_dir is None or not (Path(target_dir) / "config.json").is_file():
        return (
            None,
            None,
            "device memory: planned once the target's config.json exists (the demo target is built first)",
        )
    target_dir = Path(target_dir)
    try:
        plan, other = _cached(
            cache_dir,
            _workflow_key(cfg, target_dir, num_target_features, block_size),
            lambda: _plan_pair(cfg, target_dir, num_target_features, block_size, cache_dir),
            lambda rec: (MemoryPlan.from_json(rec["plan"]), MemoryPlan.from_json(rec["other"])),
        )
    except _NotPlanned as exc:
        return None, None, f"device memory: not planned ({exc})"
    return plan, other, describe(plan, other)


def summary_row(plan: MemoryPlan) -> dict[str, Any]:
    """A flat record of a plan (peak GB and the kinds in GB), for tables."""
    return {"peak_gb": round(plan.peak_gb, 3), **{k: round(v / GB, 3) for k, v in plan.by_kind.items()}}
