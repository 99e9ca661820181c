"""DFlash2 and DSpark through the real trainer (dflash_pipeline.train.run): resume, bf16, two gloo ranks and
(DFlash2) packing, as tests/unit/train/test_train.py does for DFlash. FSDP2 and DSpark packing are refused at
planning (tests/unit/drafter/test_families.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import counting_train_setup

from dflash_pipeline.drafter import build as DB
from dflash_pipeline.drafter import model as M
from dflash_pipeline.train.run import train
from dflash_pipeline.workflow.policy import accelerate_launch_args

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
    "selector_gold": "insert",
    "selector_weight": 1.0,
    "confidence_weight": 1.0,
}
ARCH = {
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
LOSS = {"dflash2": "ce_decay", "dspark": "dspark_tv"}
CLASS = {"dflash2": "DFlash2Drafter", "dspark": "DSparkDrafter"}


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


@pytest.mark.parametrize("family", ["dflash2", "dspark"])
def test_family_trains_resumes_and_exports_its_class(setup, tmp_path, family):
    summary = _train(setup, tmp_path, family)
    assert summary["steps"] == 6 and all(np.isfinite(r["loss"]) for r in _log(tmp_path))
    drafter = DB.load_drafter(tmp_path / "final")
    assert type(drafter).__name__ == CLASS[family] and summary["trainable_params"] == M.count_parameters(drafter)
    first = (tmp_path / "final" / "model.safetensors").read_bytes()
    before = len(_log(tmp_path))
    _train(setup, tmp_path, family, cfg={"epochs": 2})
    assert [r["step"] for r in _log(tmp_path)[before:]] == list(range(7, 13))  # resumed at the saved step 6
    assert (tmp_path / "final" / "model.safetensors").read_bytes() != first


@pytest.mark.parametrize("family", ["dflash2", "dspark"])
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


def test_dflash2_trains_on_packed_rows(setup, tmp_path):
    _train(setup, tmp_path, "dflash2", cfg={"packing": True, "save_every_steps": 1000})
    assert all(np.isfinite(r["loss"]) for r in _log(tmp_path))


@pytest.mark.parametrize("family", ["dflash2", "dspark"])
def test_family_trains_on_two_gloo_ranks(setup, tmp_path, family):
    root, _ = setup
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    port = {"dflash2": "29527", "dspark": "29529"}[family]
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *accelerate_launch_args(2),
        "--main_process_port",
        port,
        "-m",
        "dflash_pipeline.train.run",
        "--probe",
        str(root / "probe.json"),
        "--target",
        str(root / "target"),
        "--out-dir",
        str(tmp_path),
        "--train-config",
        json.dumps(dict(CFG, num_processes=2, loss=LOSS[family])),
        "--drafter-arch",
        json.dumps(ARCH[family]),
        str(root / "tokens.parquet"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["steps"] == 3
    assert len(_log(tmp_path)) == 3 and all(np.isfinite(r["loss"]) for r in _log(tmp_path))
    assert type(DB.load_drafter(tmp_path / "final")).__name__ == CLASS[family]
