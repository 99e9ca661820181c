"""A fourth drafter family, defined here and nowhere else (docs/how-to/add-a-drafter-family.md walks through it):
it registers itself, trains through the one trainer (its objective hook adds a term), validates on held-out
records with its own verify rule, exports (its config class, weights and serve.md), resumes exactly after a crash,
and evaluates through the speculative loop — without a change to any file outside this module.

The toy, "gated DFlash": DFlash with a learned gate per block slot on the drafter's final hidden state
(``hidden[k] · (1 + gate[k])``), an L2 pull of the gates towards 0 (``gate_weight``, a ``train.*`` key of its
own), and a config key of its own at the top of config.json (``gate_init``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import counting_train_setup
from huggingface_hub.dataclasses import strict
from safetensors.torch import load_file
from torch import nn

from dflash_pipeline.drafter import build as DB
from dflash_pipeline.drafter import families as FR
from dflash_pipeline.drafter.config import DFlashConfig
from dflash_pipeline.drafter.dflash import DFlashFamily
from dflash_pipeline.drafter.model import DFlashDrafter

# ---------------------------------------------------------------------------------------------------
# The family: config class, model, family object (what a family module holds)
# ---------------------------------------------------------------------------------------------------


@strict
class GatedConfig(DFlashConfig):
    """config.json of a gated drafter: DFlash's fields plus ``gate_init``; served (in theory) as ``GatedDraftModel``."""

    gate_init: float = 0.0

    architecture = "GatedDraftModel"


class GatedDrafter(DFlashDrafter):
    """DFlash with ``slot_gate`` [B]: the final hidden state of block slot k is scaled by ``1 + slot_gate[k]``."""

    architecture = "GatedDraftModel"

    def __init__(self, config: GatedConfig):
        super().__init__(config)
        self.slot_gate = nn.Parameter(torch.full((self.block_size,), float(config.gate_init)))

    def forward(self, noise_embedding, target_hidden, ctx_position_ids, block_position_ids, attn_mask=None, cache=None):
        hidden = super().forward(noise_embedding, target_hidden, ctx_position_ids, block_position_ids, attn_mask, cache)
        q = hidden.shape[1]
        k = torch.arange(q, device=hidden.device) % min(self.block_size, q)  # slot of each query row
        return hidden * (1.0 + self.slot_gate[k]).to(hidden.dtype).view(1, q, 1)


class GatedFamily(DFlashFamily):
    name = "gated"
    title = "gated DFlash"
    config_class = GatedConfig
    drafter_class = GatedDrafter
    settings_keys = ("gate_init",)
    train_keys = ()
    supports_fsdp = False

    def apply_settings(self, cfg, settings):
        cfg.gate_init = float(settings["gate_init"])

    def settings_of(self, raw):
        return {"gate_init": raw["gate_init"]}

    def objective(self, ctx, core, hidden, blocks, teacher, base):
        out = base()  # the plain train.loss objective, then the family's own term
        pull = GATE_WEIGHT * core.slot_gate.float().pow(2).sum() * out.normalizer.detach()
        return type(out)(total=out.total + pull, normalizer=out.normalizer, stats=out.stats)

    def serve_md(self, cfg, meta, drafter_dir, target):
        return f"# Serving this gated DFlash drafter\n\nNo engine serves `{self.architecture}`; evaluate it with our loop.\n"


GATE_WEIGHT = 0.01
ARCH = {"family": "gated", "gated": {"gate_init": 0.25}}
CFG = {
    "num_processes": 1,
    "epochs": 2,
    "batch_size": 4,
    "learning_rate": 2e-3,
    "warmup_ratio": 0.1,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "num_anchors": 8,
    "loss_gamma": None,
    "mixed_precision": "no",
    "seed": 0,
    "save_every_steps": 2,
    "log_every_steps": 1,
    "trace_batches": False,
    "validation_fraction": 0.2,
    "trackers": [],
    "loss": "ce_decay",
}


@pytest.fixture(scope="module")
def gated():
    FR.register(GatedFamily)
    yield FR.get("gated")
    FR.unregister("gated")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return counting_train_setup(tmp_path_factory.mktemp("gated"), min_len=20, max_position_embeddings=128)


def _train(setup, out):
    from dflash_pipeline.train.run import train

    root, probe = setup
    return train(
        token_shards=[root / "tokens.parquet"],
        probe=probe,
        target_dir=root / "target",
        out_dir=out,
        cfg=dict(CFG),
        drafter_arch=ARCH,
    )


class _Crash(RuntimeError):
    pass


def test_the_family_is_asked_not_named(gated):
    assert "gated" in FR.names() and FR.get("gated") is gated
    assert (gated.drafts_per_block(4), gated.label_slots(4), gated.first_draft_slot) == (3, 4, 1)
    with pytest.raises(ValueError, match="built in"):
        FR.unregister("dspark")


def test_gated_family_trains_exports_resumes_and_evaluates(gated, setup, tmp_path, monkeypatch, capsys):
    from dflash_pipeline.evaluate.acceptance import eval_set_stats, family_build_args
    from dflash_pipeline.evaluate.speculative import speculative_generate
    from dflash_pipeline.train import loop as L

    # trains through the one trainer, with its own objective term and held-out validation
    summary = _train(setup, tmp_path / "whole")
    log = [json.loads(x) for x in (tmp_path / "whole" / "train_log.jsonl").read_text().splitlines()]
    assert summary["steps"] == len(log) > 0 and all(np.isfinite(r["loss"]) for r in log)
    val = [json.loads(x) for x in (tmp_path / "whole" / "val_log.jsonl").read_text().splitlines()]
    assert val and all(1.0 <= r["tau"] <= 4 and len(r["per_position_acceptance"]) == 3 for r in val)

    # exports: its architecture and config key, its weights, its serve.md (the one writer, its text)
    final = tmp_path / "whole" / "final"
    cfg = json.loads((final / "config.json").read_text())
    assert cfg["architectures"] == ["GatedDraftModel"] and cfg["gate_init"] == 0.25
    assert cfg["speculative_config"]["speculative_tokens"] == 3
    assert "slot_gate" in load_file(final / "model.safetensors")
    assert "No engine serves `GatedDraftModel`" in (final / "serve.md").read_text()
    drafter = DB.load_drafter(final)
    assert type(drafter) is GatedDrafter and FR.of_drafter(drafter) is gated
    assert not torch.equal(drafter.slot_gate, torch.full((4,), 0.25))  # trained

    # resumes exactly after a crash
    after_step = L._after_step

    def crash_after_5(run, step, *args, **kwargs):
        window = after_step(run, step, *args, **kwargs)
        if step == 5:
            raise _Crash(step)
        return window

    monkeypatch.setattr(L, "_after_step", crash_after_5)
    with pytest.raises(_Crash):
        _train(setup, tmp_path / "cut")
    monkeypatch.setattr(L, "_after_step", after_step)
    capsys.readouterr()
    _train(setup, tmp_path / "cut")
    assert "at step 4/" in capsys.readouterr().out
    assert (final / "model.safetensors").read_bytes() == (tmp_path / "cut" / "final" / "model.safetensors").read_bytes()

    # evaluates: the speculative loop is lossless, τ counts its 3 drafts; the untrained floor is of its family
    root, probe = setup
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(root / "target").eval()
    prompt = [10, 11, 12, 13, 14, 15]
    greedy = target.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt) :].tolist()
    res = speculative_generate(target, drafter.eval(), prompt, block_size=4, max_new_tokens=16)
    assert res.output_ids == greedy[: len(res.output_ids)] and len(res.output_ids) == 16
    stats = eval_set_stats([[res]], block_size=4, seconds=1.0, family=FR.of_drafter(drafter).name)
    assert 1.0 <= stats["tau"] <= 4 and len(stats["histogram"]) == 4
    floor = DB.build_drafter(target, probe, **family_build_args(final))
    assert type(floor) is GatedDrafter and float(floor.slot_gate.detach()[0]) == 0.25
