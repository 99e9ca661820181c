"""Every drafter family through the real trainer (dflash_pipeline.train.run): exact resume, bf16, two gloo ranks
and (DFlash2) packing, and the planning refusals of the rest: the README's support table (Drafter families).

| family  | resume (exact) | packing             | bf16 | 2 gloo ranks | FSDP2               |
|---------|----------------|---------------------|------|--------------|---------------------|
| dflash  | here           | test_resume.py      | here | here         | test_resume.py      |
| dflash2 | here           | here                | here | here         | refused at planning |
| dspark  | here           | refused at planning | here | here         | refused at planning |
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import REPO, counting_train_setup
from safetensors.torch import load_file

from dflash_pipeline.core.procs import free_port
from dflash_pipeline.drafter import build as DB
from dflash_pipeline.drafter import model as M
from dflash_pipeline.train import loop as L
from dflash_pipeline.train.run import train
from dflash_pipeline.workflow.policy import accelerate_launch_args
from dflash_pipeline.workflow.problems import problems

CFG = {
    "num_processes": 1,
    "epochs": 1,
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
    "validation_fraction": 0.0,
    "trackers": [],
    "selector_gold": "insert",
    "selector_weight": 1.0,
    "confidence_weight": 1.0,
}
FAMILIES = ("dflash", "dflash2", "dspark")
ARCH = {
    "dflash": None,
    "dflash2": {
        "family": "dflash2",
        "dflash2": {
            "conv_kernel_size": 2,
            "conv_group_size": 8,
            "selector_rank": 4,
            "selector_top_k": 4,
            "output_multiplier": 1.0,
            "final_logit_softcapping": None,
        },
    },
    "dspark": {
        "family": "dspark",
        "dspark": {
            "markov_rank": 4,
            "markov_head_type": "vanilla",
            "enable_confidence_head": True,
            "confidence_head_with_markov": True,
        },
    },
}
LOSS = {"dflash": "ce_decay", "dflash2": "ce_decay", "dspark": "dspark_tv"}
CLASS = {"dflash": "DFlashDrafter", "dflash2": "DFlash2Drafter", "dspark": "DSparkDrafter"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return counting_train_setup(
        tmp_path_factory.mktemp("family_train"), min_len=20, max_position_embeddings=128, unsupervised_record=5
    )


def _train(setup, out, family, **over):
    root, probe = setup
    cfg = dict(CFG, loss=LOSS[family], **over.pop("cfg", {}))
    return train(
        token_shards=[root / "tokens.parquet"],
        probe=probe,
        target_dir=root / "target",
        out_dir=out,
        cfg=cfg,
        drafter_arch=ARCH[family],
        **over,
    )


def _log(out):
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


class _Crash(RuntimeError):
    """Raised after an optimizer step to stop a run the way a crash does (its ``state/`` is what was saved)."""


@pytest.mark.parametrize("family", FAMILIES)
def test_family_resumes_exactly(setup, tmp_path, monkeypatch, capsys, family):
    """A run stopped after step 9 of 12 (state saved at 8, mid-epoch) and run again ends with the weights of the
    uninterrupted run, bit for bit: the family's heads, optimizer moments and random streams all resume (the
    SIGKILL variant for DFlash's settings is tests/unit/train/test_resume.py)."""
    summary = _train(setup, tmp_path / "whole", family, cfg={"epochs": 2})
    assert summary["steps"] == 12 and all(np.isfinite(r["loss"]) for r in _log(tmp_path / "whole"))
    drafter = DB.load_drafter(tmp_path / "whole" / "final")
    assert type(drafter).__name__ == CLASS[family] and summary["trainable_params"] == M.count_parameters(drafter)
    after_step = L._after_step

    def crash_after_9(run, step, *args, **kwargs):
        window = after_step(run, step, *args, **kwargs)
        if step == 9:
            raise _Crash(step)
        return window

    monkeypatch.setattr(L, "_after_step", crash_after_9)
    with pytest.raises(_Crash):
        _train(setup, tmp_path / "cut", family, cfg={"epochs": 2})
    monkeypatch.setattr(L, "_after_step", after_step)
    capsys.readouterr()
    _train(setup, tmp_path / "cut", family, cfg={"epochs": 2})
    assert "at step 8/12" in capsys.readouterr().out
    assert [r["step"] for r in _log(tmp_path / "cut")] == list(range(1, 10)) + list(range(9, 13))
    whole, cut = (load_file(tmp_path / d / "state" / "model.safetensors") for d in ("whole", "cut"))
    assert whole.keys() == cut.keys() and len(whole) > 0
    differ = [k for k in whole if not torch.equal(whole[k], cut[k])]
    assert not differ, f"{len(differ)}/{len(whole)} tensors differ after the resume, e.g. {differ[:3]}"
    assert (tmp_path / "whole" / "final" / "model.safetensors").read_bytes() == (
        tmp_path / "cut" / "final" / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_under_bf16(setup, tmp_path, family):
    summary = _train(
        setup,
        tmp_path,
        family,
        cfg={"mixed_precision": "bf16", "save_every_steps": 1000},
        target_dtype="bfloat16",
        device="cpu",
    )
    assert summary["target_dtype"] == "bfloat16" and all(np.isfinite(r["loss"]) for r in _log(tmp_path))
    assert DB.load_drafter(tmp_path / "final").fc.weight.dtype == torch.float32


@pytest.mark.parametrize("family", FAMILIES)
def test_family_validates_on_held_out_records(setup, tmp_path, family):
    """Held-out validation (train.validation_fraction, bucketed by context length) runs the family's own draft
    rule: per-block τ within [1, drafts + 1] with DSpark's B drafts, and the context-length buckets filled.
    (It raised on adding bucketed to unbucketed counts for DFlash2 / DSpark.)"""
    _train(setup, tmp_path, family, cfg={"validation_fraction": 0.2, "validation_length_buckets": [16, 32]})
    val = [json.loads(line) for line in (tmp_path / "val_log.jsonl").read_text().splitlines()]
    drafts = 4 if family == "dspark" else 3  # block size 4
    assert val and all(len(r["per_position_acceptance"]) == drafts for r in val)
    assert all(1.0 <= r["tau"] <= drafts + 1 and r["num_blocks"] > 0 for r in val)
    assert sum(b["num_blocks"] for b in val[-1]["by_context_length"].values()) == val[-1]["num_blocks"]


def test_dflash2_trains_on_packed_rows(setup, tmp_path):
    _train(setup, tmp_path, "dflash2", cfg={"packing": True, "save_every_steps": 1000})
    assert all(np.isfinite(r["loss"]) for r in _log(tmp_path))


#: The training CLI, each rank writing its own drafter weights after the last step (``weights.<rank>.pt``):
#: under DDP both ranks must hold the same weights, which fails if a family head's gradients were not
#: all-reduced (its heads run on the drafter's parameters after the DDP forward).
RANK_WEIGHTS_TRAIN = r"""
import sys
import torch
import yaml
from dflash_pipeline.train import loop as L

after_step = L._after_step

def after_step_then_dump(run, step, *args, **kwargs):
    window = after_step(run, step, *args, **kwargs)
    if step == run.schedule.total_steps:
        module = getattr(run.drafter, "module", run.drafter)
        sd = {k: v.detach().clone() for k, v in module.state_dict().items()}
        torch.save(sd, run.out_dir / f"weights.{run.accelerator.process_index}.pt")
    return window

L._after_step = after_step_then_dump
from dflash_pipeline.train.run import main

main(sys.argv[1:])
"""


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_on_two_gloo_ranks(setup, tmp_path, family):
    root, _ = setup
    script = tmp_path / "rank_weights_train.py"
    script.write_text(RANK_WEIGHTS_TRAIN)
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    port = str(free_port())
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *accelerate_launch_args(2),
        "--main_process_port",
        port,
        str(script),
        "--probe",
        str(root / "probe.json"),
        "--target",
        str(root / "target"),
        "--out-dir",
        str(tmp_path),
        "--train-config",
        json.dumps(dict(CFG, num_processes=2, loss=LOSS[family])),
        "--drafter-arch",
        json.dumps(ARCH[family] or {}),
        str(root / "tokens.parquet"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["steps"] == 3
    assert len(_log(tmp_path)) == 3 and all(np.isfinite(r["loss"]) for r in _log(tmp_path))
    assert type(DB.load_drafter(tmp_path / "final")).__name__ == CLASS[family]
    ranks = [torch.load(tmp_path / f"weights.{r}.pt", weights_only=True) for r in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys() and ranks[0]
    apart = [k for k in ranks[0] if not torch.equal(ranks[0][k], ranks[1][k])]
    assert not apart, f"the two ranks' weights differ in {apart[:5]}"
    export = load_file(tmp_path / "final" / "model.safetensors")  # rank 0's trained weights, in the export's dtype
    shared = [k for k in export if k in ranks[0]]
    assert shared and all(torch.equal(export[k], ranks[0][k].to(export[k].dtype)) for k in shared)


#: (family, setting) → the reason planning gives; every other cell of the support table plans and trains.
REFUSED = {
    ("dspark", "packing"): "train.packing is not supported with drafter.family: dspark",
    ("dflash2", "fsdp2"): "train.fsdp is not supported with drafter.family: dflash2",
    ("dspark", "fsdp2"): "train.fsdp is not supported with drafter.family: dspark",
}
SETTINGS = {
    "packing": {"train": {"packing": True}},
    "bf16": {"train": {"mixed_precision": "bf16"}},
    "2_gloo_ranks": {"train": {"num_processes": 2}},
    "fsdp2": {"train": {"fsdp": True, "num_processes": 2}},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_planning_refuses_exactly_the_unsupported_settings(family):
    """What the Snakefile runs before anything else (workflow.problems): each refused family × setting names
    its reason, and the supported ones plan without a problem."""
    base = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for setting, over in SETTINGS.items():
        cfg = json.loads(json.dumps(base))
        cfg["drafter"]["family"] = family
        cfg["train"].update(over["train"], loss=LOSS[family])
        found = problems(cfg, base_dir=REPO)
        if (family, setting) in REFUSED:
            assert any(REFUSED[family, setting] in p for p in found), (setting, found)
            assert len(found) == 1, found  # the family's refusal only, nothing else of the config
        else:
            assert found == [], (setting, found)
