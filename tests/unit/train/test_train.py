"""Training with Accelerate on CPU: one process, resume after a kill, and two real gloo ranks."""

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

from dflash_pipeline.core.procs import free_port
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
    "trace_batches": True,
    "validation_fraction": 0.0,
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return counting_train_setup(
        tmp_path_factory.mktemp("train"), min_len=20, max_position_embeddings=128, unsupervised_record=5
    )


def test_single_process_train_exports_and_logs(setup, tmp_path):
    root, probe = setup
    summary = train(
        token_shards=[root / "tokens.parquet"], probe=probe, target_dir=root / "target", out_dir=tmp_path, cfg=CFG
    )
    assert summary["records"] == 23 and summary["num_processes"] == 1
    assert summary["steps"] == 6  # ceil(23 / 4)
    # only the drafter trains: the count equals the drafter's parameters, not the target's
    drafter = DB.load_drafter(tmp_path / "final")
    assert summary["trainable_params"] == M.count_parameters(drafter)
    log = [json.loads(l) for l in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 7)) and all(np.isfinite(r["loss"]) for r in log)
    assert json.loads((tmp_path / "state" / "step.json").read_text())["step"] == 6


def test_resume_continues_from_saved_step(setup, tmp_path):
    root, probe = setup
    train(token_shards=[root / "tokens.parquet"], probe=probe, target_dir=root / "target", out_dir=tmp_path, cfg=CFG)
    first = (tmp_path / "final" / "model.safetensors").read_bytes()
    # a "killed" longer run: the state says step 6; asking for 2 epochs (12 steps) resumes at 6
    cfg2 = dict(CFG, epochs=2)
    proc_log = tmp_path / "train_log.jsonl"
    before = len(proc_log.read_text().splitlines())
    train(token_shards=[root / "tokens.parquet"], probe=probe, target_dir=root / "target", out_dir=tmp_path, cfg=cfg2)
    steps = [json.loads(l)["step"] for l in proc_log.read_text().splitlines()[before:]]
    assert steps == list(range(7, 13))  # nothing before the saved step was redone
    assert (tmp_path / "final" / "model.safetensors").read_bytes() != first


def test_two_cpu_ranks_really_train_as_two_processes(setup, tmp_path):
    root, probe = setup
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *accelerate_launch_args(2),
        "--main_process_port",
        str(free_port()),
        "-m",
        "dflash_pipeline.train.run",
        "--probe",
        str(root / "probe.json"),
        "--target",
        str(root / "target"),
        "--out-dir",
        str(tmp_path),
        "--train-config",
        json.dumps(dict(CFG, num_processes=2)),
        str(root / "tokens.parquet"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["steps"] == 3  # ceil(23 / (4 * 2))
    r0 = [json.loads(l) for l in (tmp_path / "trace" / "rank0.jsonl").read_text().splitlines()]
    r1 = [json.loads(l) for l in (tmp_path / "trace" / "rank1.jsonl").read_text().splitlines()]
    assert len(r0) == len(r1) == 3
    assert all(a["batch"] != b["batch"] for a, b in zip(r0, r1))  # ranks see different data
    log = [json.loads(l) for l in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 3 and all(np.isfinite(r["loss"]) for r in log)


def test_killed_run_resumes_at_its_last_saved_step(setup, tmp_path):
    """SIGKILL a real training process once it has saved state; the rerun starts from that step."""
    import signal

    root, probe = setup
    cfg = dict(CFG, epochs=20, save_every_steps=3, trace_batches=False)
    cmd = [
        sys.executable,
        "-m",
        "dflash_pipeline.train.run",
        "--probe",
        str(root / "probe.json"),
        "--target",
        str(root / "target"),
        "--out-dir",
        str(tmp_path),
        "--train-config",
        json.dumps(cfg),
        str(root / "tokens.parquet"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    saved = None
    for line in proc.stdout:  # wait on the process's own progress lines, not on time
        if line.startswith("[train] step ") and (tmp_path / "state" / "step.json").is_file():
            saved = json.loads((tmp_path / "state" / "step.json").read_text())["step"]
            if saved >= 3:
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait(timeout=60)
    assert saved is not None and saved >= 3 and proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "final").exists()  # a killed run leaves no finished-looking checkpoint
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    import re

    resumed = re.search(r"resumed from .* at step (\d+)/", out.stdout + out.stderr)
    # the state read just before the kill, or a later save that landed in between
    assert resumed and int(resumed.group(1)) >= saved and int(resumed.group(1)) % 3 == 0
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_two_ranks_follow_the_one_process_loss_curve(setup, tmp_path):
    """Same data and global batch (1×4 vs 2×2): the two-rank run learns like the one-process run."""
    root, probe = setup
    cfg = dict(CFG, epochs=4, save_every_steps=1000, trace_batches=False, learning_rate=1e-2)
    one = tmp_path / "one"
    train(token_shards=[root / "tokens.parquet"], probe=probe, target_dir=root / "target", out_dir=one, cfg=cfg)
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    two = tmp_path / "two"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *accelerate_launch_args(2),
        "--main_process_port",
        str(free_port()),
        "-m",
        "dflash_pipeline.train.run",
        "--probe",
        str(root / "probe.json"),
        "--target",
        str(root / "target"),
        "--out-dir",
        str(two),
        "--train-config",
        json.dumps(dict(cfg, batch_size=2, num_processes=2)),
        str(root / "tokens.parquet"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    curves = {}
    for name, d in (("one", one), ("two", two)):
        losses = [json.loads(l)["loss"] for l in (d / "train_log.jsonl").read_text().splitlines()]
        assert len(losses) == 24  # 6 optimizer steps per epoch either way
        curves[name] = (np.mean(losses[:6]), np.mean(losses[-6:]))
    for first, last in curves.values():
        assert last < 0.7 * first  # both runs learn
    assert abs(curves["one"][1] - curves["two"][1]) < 0.25 * curves["one"][1]  # and end at a similar loss


RANK_SCRIPT = r"""
import json, os, sys
import torch, torch.distributed as dist
from dflash_pipeline.drafter import model as M
from dflash_pipeline.drafter import build as DB
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
lin = torch.nn.Linear(8, 8, bias=False)
head = torch.randn(11, 8)
ddp = torch.nn.parallel.DistributedDataParallel(lin)
g = torch.Generator().manual_seed(100 + rank)
x, y = torch.randn(1, 12, 8, generator=g), torch.randint(0, 11, (1, 12), generator=g)
w = torch.zeros(1, 12)
w[0, : (1 if rank == 0 else 12)] = 1.0  # rank 0: one supervised slot, rank 1: twelve
out = {}
for mode in ("global", "per_rank"):
    ddp.zero_grad()
    norm = M.loss_normalizer(w.sum(), world, lambda t: (dist.all_reduce(t), t)[1]) if mode == "global" else None
    loss, _ = M.decayed_cross_entropy(ddp(x), head, y, w, normalizer=norm)
    loss.backward()  # DDP averages the gradients over the ranks
    out[mode] = lin.weight.grad.flatten().tolist()
    out[mode + "_loss"] = float(loss)
json.dump({"x": x.tolist(), "y": y.tolist(), "w": w.tolist(), **out}, open(sys.argv[1] + f".{rank}", "w"))
"""


def test_loss_is_normalised_by_the_global_weight_sum_across_ranks(tmp_path):
    """Two gloo ranks under DDP: rank 0 holds 1 supervised slot, rank 1 twelve. With the global
    normaliser the DDP gradient equals the gradient of Σw·CE / Σw over all 13 slots pooled in one process
    (every slot weighs the same); the old per-rank normalisation gives rank 0's lone slot 12× the weight."""
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(script),
        str(tmp_path / "out"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = [json.loads((tmp_path / f"out.{i}").read_text()) for i in range(2)]
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8, bias=False)
    head = torch.randn(11, 8)
    x = torch.cat([torch.tensor(r[i]["x"]) for i in range(2)], dim=1)
    y = torch.cat([torch.tensor(r[i]["y"]) for i in range(2)], dim=1)
    w = torch.cat([torch.tensor(r[i]["w"]) for i in range(2)], dim=1)
    loss, _ = M.decayed_cross_entropy(lin(x), head, y, w)
    loss.backward()
    pooled = lin.weight.grad.flatten()
    for i in range(2):
        assert torch.allclose(torch.tensor(r[i]["global"]), pooled, atol=1e-5)
    assert not torch.allclose(torch.tensor(r[0]["per_rank"]), pooled, atol=1e-3)  # the bug this fixes
    # the logged loss (mean of the rank losses) is the pooled loss
    assert abs((r[0]["global_loss"] + r[1]["global_loss"]) / 2 - float(loss.detach())) < 1e-5


def test_bf16_target_trains_under_accelerate_bf16_on_cpu(setup, tmp_path):
    """The GPU recipe on a CPU box (train.device: cpu): bf16 target, mixed_precision bf16, the real loop."""
    root, probe = setup
    cfg = dict(CFG, mixed_precision="bf16", save_every_steps=1000, trace_batches=False)
    summary = train(
        token_shards=[root / "tokens.parquet"],
        probe=probe,
        target_dir=root / "target",
        out_dir=tmp_path,
        cfg=cfg,
        target_dtype="bfloat16",
        device="cpu",
    )
    assert summary["target_dtype"] == "bfloat16" and summary["train_config"]["mixed_precision"] == "bf16"
    log = [json.loads(l) for l in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == summary["steps"] and all(np.isfinite(r["loss"]) for r in log)
    assert DB.load_drafter(tmp_path / "final").fc.weight.dtype == torch.float32  # master weights were fp32
