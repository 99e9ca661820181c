"""The memory plan (dflash_pipeline.train.memory): the fake-tensor plan of one training step against torch's
memory tracker on the trainer's own real step (``step_objective``, backward, the run's optimizer, Accelerate-style
autocast) at small sizes, for three settings; the budget check naming the knobs; the plan cache. The Kimi
recipe's plan line and its refusal at planning: tests/unit/features/test_stream_plan.py."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config

from dflash_pipeline.core.config import load_config
from dflash_pipeline.drafter import model as M
from dflash_pipeline.drafter.build import build_drafter
from dflash_pipeline.train import memory as MP
from dflash_pipeline.train import optim as OPT
from dflash_pipeline.train.data import ConfigOnly
from dflash_pipeline.train.step import StepContext, step_objective

TARGET = Qwen3Config(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)

SETTINGS = {
    "fp32_adamw": MP.StepSettings(
        batch_size=2, seq_len=128, num_anchors=8, block_size=8, num_draft_layers=2, num_target_features=3
    ),
    "muon_checkpointing_dpace": MP.StepSettings(
        batch_size=2,
        seq_len=96,
        num_anchors=6,
        block_size=4,
        num_draft_layers=3,
        num_target_features=2,
        optimizer="muon",
        gradient_checkpointing=True,
        loss="dpace",
        loss_chunk_tokens=16,
    ),
    "bf16_sliding": MP.StepSettings(
        batch_size=1,
        seq_len=160,
        num_anchors=10,
        block_size=8,
        num_draft_layers=2,
        num_target_features=3,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=32,
        mixed_precision="bf16",
        head_dtype="bfloat16",
    ),
}


class _Frozen:
    """The frozen embedding / LM head as the step reads them (``.weight``, called on ids), not an ``nn.Module``:
    the tracker hooks every module's parameters for gradients, which frozen ones refuse."""

    def __init__(self, weight):
        self.weight = weight

    def __call__(self, ids):
        return F.embedding(ids, self.weight)


def _tracked_real_step(st: MP.StepSettings) -> int:
    """Peak bytes of two real training steps of the trainer (``step_objective`` on a batch carrying features,
    backward, the run's optimizer), under the same tracker."""
    from torch.distributed._tools.mem_tracker import MemTracker

    dt = getattr(torch, st.head_dtype)
    probe = {
        "drafter": {
            "block_size": st.block_size,
            "num_draft_layers": st.num_draft_layers,
            "target_layer_ids": list(range(st.num_target_features)),
            "mask_token_id": 0,
        }
    }
    drafter = build_drafter(
        ConfigOnly(TARGET),
        probe,
        layer_types=list(st.layer_types) if st.layer_types else None,
        sliding_window=st.sliding_window,
    )
    drafter.gradient_checkpointing = st.gradient_checkpointing
    drafter.train()
    h, v, b, s = TARGET.hidden_size, TARGET.vocab_size, st.batch_size, st.seq_len
    embed, head = torch.randn(v, h, dtype=dt), torch.randn(v, h, dtype=dt)
    ids = torch.randint(1, v, (b, s))
    lmask = torch.ones(b, s, dtype=torch.uint8)
    lmask[:, : s // 8] = 0
    batch = {
        "input_ids": ids,
        "loss_mask": lmask,
        "attention_mask": torch.ones(b, s, dtype=torch.long),
        "features": torch.randn(b, s, st.num_target_features * h, dtype=dt),
    }
    ctx = StepContext(
        drafter=drafter,
        target=None,
        probe=probe,
        num_anchors=st.num_anchors,
        block_size=st.block_size,
        gamma=M.loss_decay_gamma(st.block_size),
        generator=torch.Generator().manual_seed(0),
        embed=_Frozen(embed),
        lm_head=_Frozen(head),
        loss=st.loss,
        loss_chunk_tokens=st.loss_chunk_tokens,
    )
    optimizer = OPT.make_optimizer(drafter, st.optimizer, lr=1e-4, weight_decay=0.0)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if st.mixed_precision == "bf16" else contextlib.nullcontext()
    forward = drafter.forward
    drafter.forward = lambda *a, **k: _autocast_call(forward, autocast, *a, **k)  # as Accelerate wraps it
    tracker = MemTracker()
    tracker.track_external(drafter, optimizer, embed, head, batch["features"])
    with tracker:
        for _ in range(2):
            step_objective(ctx, batch).total.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tracker.reset_mod_stats()
    snap = tracker.get_tracker_snapshot("peak")
    return int(next(iter(snap.values()))["Total"])


def _autocast_call(fn, autocast, *a, **k):
    with autocast:
        return fn(*a, **k)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_plan_is_within_10_percent_of_the_trainers_tracked_real_step(name):
    st = SETTINGS[name]
    plan = MP.plan_step_memory(TARGET, st)
    real = _tracked_real_step(st)
    assert abs(plan.peak_bytes - real) <= 0.10 * real, (name, plan.peak_bytes, real, plan.by_kind)
    assert plan.by_kind["Optstate"] > 0 and plan.by_kind["Parameter"] > 0


def test_checkpointing_and_muon_lower_the_plan_and_fsdp_shards_the_state():
    base = SETTINGS["fp32_adamw"]
    plain = MP.plan_step_memory(TARGET, base)
    ckpt = MP.plan_step_memory(TARGET, dataclasses.replace(base, gradient_checkpointing=True))
    muon = MP.plan_step_memory(TARGET, dataclasses.replace(base, optimizer="muon"))
    fsdp = MP.plan_step_memory(TARGET, dataclasses.replace(base, shards=4))
    assert ckpt.by_kind["Activation"] < plain.by_kind["Activation"] and ckpt.peak_bytes < plain.peak_bytes
    assert muon.by_kind["Optstate"] < 0.75 * plain.by_kind["Optstate"]  # one momentum buffer per matrix
    assert fsdp.by_kind["Optstate"] == plain.by_kind["Optstate"] // 4 and fsdp.peak_bytes < plain.peak_bytes
    assert "gradient checkpointing off (on would save" in MP.describe(plain, ckpt)
    assert "gradient checkpointing on (saves" in MP.describe(ckpt, plain)


def test_over_budget_names_the_knobs_that_help():
    base = SETTINGS["fp32_adamw"]
    plain = MP.plan_step_memory(TARGET, base)
    ckpt = MP.plan_step_memory(TARGET, dataclasses.replace(base, gradient_checkpointing=True))
    assert MP.over_budget(plain, None, ckpt) is None and MP.over_budget(plain, plain.peak_gb * 1.01, ckpt) is None
    why = MP.over_budget(plain, (ckpt.peak_bytes + 1) / MP.GB, ckpt)
    assert why.startswith("train.device_memory_gb: one training step needs")
    assert "train.gradient_checkpointing: true" in why and "fits" in why
    for knob in ("train.num_anchors", "train.loss_chunk_tokens", "train.fsdp", "train.optimizer: muon"):
        assert knob in why, why
    why = MP.over_budget(plain, 1e-6, ckpt)
    assert "not enough alone" in why


def test_plans_are_cached_per_settings(tmp_path, monkeypatch):
    st = SETTINGS["fp32_adamw"]
    first = MP.cached_plan(TARGET, st, tmp_path)
    assert len(list(tmp_path.iterdir())) == 1
    monkeypatch.setattr(MP, "plan_step_memory", lambda *a, **k: pytest.fail("planned again"))
    again = MP.cached_plan(TARGET, st, tmp_path)
    assert again.peak_bytes == first.peak_bytes and again.settings == st
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "c"))
    assert MP.plan_cache_dir() == tmp_path / "c" / "memory-plans"


#: A small workflow config: the plan of `TARGET` in a few seconds.
WORKFLOW = {
    "train": {"batch_size": 2, "num_anchors": 8},
    "tokens": {"max_length": 128},
    "drafter": {"num_draft_layers": 2},
}


def _plan_of_workflow(target_dir, cache_dir):
    return MP.plan_for_workflow(
        load_config(overrides=WORKFLOW), target_dir=target_dir, num_target_features=3, block_size=8, cache_dir=cache_dir
    )


def test_the_workflow_plan_is_cached_by_the_target_config_bytes_without_loading_them(tmp_path, monkeypatch):
    target, cache = tmp_path / "target", tmp_path / "cache"
    TARGET.save_pretrained(target)
    plan, other, line = _plan_of_workflow(target, cache)
    assert plan.peak_bytes > 0 and other.settings.gradient_checkpointing and line.startswith("device memory:")
    with monkeypatch.context() as m:  # a hit reads neither the target's config nor plans
        m.setattr("dflash_pipeline.target.loading.load_target_config", lambda *a, **k: pytest.fail("config loaded"))
        m.setattr(MP, "plan_step_memory", lambda *a, **k: pytest.fail("planned again"))
        again = _plan_of_workflow(target, cache)
    assert again[0] == plan and again[1] == other and again[2] == line
    entries = set(cache.iterdir())
    TARGET.__class__(**{**TARGET.to_dict(), "hidden_size": 128}).save_pretrained(target)  # the target changed
    wider = _plan_of_workflow(target, cache)
    assert wider[0].peak_bytes > plan.peak_bytes and wider[2] != line
    assert set(cache.iterdir()) > entries
    (entry,) = [f for f in set(cache.iterdir()) - entries if "other" in str(json.loads(f.read_text())["value"])]
    entry.write_text('{"value": {"plan": {}}}')  # an entry of another shape is planned again and rewritten
    assert _plan_of_workflow(target, cache) == wider
    assert json.loads(entry.read_text())["value"]["plan"] == wider[0].to_json()
