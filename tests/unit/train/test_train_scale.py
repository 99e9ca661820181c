"""The trainer at scale, on CPU: objectives, packing, global normalisation across accumulation micro-steps,
held-out τ, TensorBoard, FSDP2 over gloo, and 2 "machines" × 1 process on loopback — the last two are
killed (SIGKILL) once they have saved state and must resume from it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import counting_train_setup

from dflash_pipeline.core.procs import free_port
from dflash_pipeline.drafter import build as DB
from dflash_pipeline.drafter import model as M
from dflash_pipeline.train.run import train

CFG = {
    "num_processes": 1,
    "epochs": 1,
    "batch_size": 4,
    "learning_rate": 2e-3,
    "warmup_ratio": 0.1,
    "num_anchors": 8,
    "seed": 0,
    "save_every_steps": 1000,
    "log_every_steps": 1,
    "validation_fraction": 0.0,
    "trackers": [],
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return counting_train_setup(tmp_path_factory.mktemp("train_scale"), min_len=12, max_position_embeddings=256)


def _run(root, probe, out, **over):
    return train(
        token_shards=[root / "tokens.parquet"],
        probe=probe,
        target_dir=root / "target",
        out_dir=out,
        cfg={**CFG, **over},
    )


def _log(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.parametrize("loss", ["ce_decay", "dpace", "kl"])
def test_accumulation_is_normalised_globally(setup, tmp_path, loss):
    """1 micro-batch of 4 per step vs 2 micro-batches of 2: with every anchor candidate taken (no sampling
    noise) the loss curve and the trained weights are the same — each slot weighs the same whichever
    micro-batch holds it."""
    root, probe = setup
    a = _run(root, probe, tmp_path / "a", loss=loss, num_anchors=64)
    b = _run(root, probe, tmp_path / "b", loss=loss, num_anchors=64, batch_size=2, gradient_accumulation_steps=2)
    assert a["steps"] == b["steps"] == 6
    la, lb = (
        [r["loss"] for r in _log(tmp_path / "a" / "train_log.jsonl")],
        [r["loss"] for r in _log(tmp_path / "b" / "train_log.jsonl")],
    )
    assert np.allclose(la, lb, rtol=1e-4), (la, lb)
    wa, wb = DB.load_drafter(tmp_path / "a" / "final"), DB.load_drafter(tmp_path / "b" / "final")
    for (k, x), (_, y) in zip(wa.state_dict().items(), wb.state_dict().items()):
        assert torch.allclose(x, y, atol=2e-2), k  # bf16 export


def test_packed_training_validates_and_writes_tensorboard(setup, tmp_path):
    root, probe = setup
    s = _run(
        root,
        probe,
        tmp_path,
        loss="dpace",
        packing=True,
        pack_max_tokens=80,
        batch_size=1,
        epochs=5,
        learning_rate=1e-2,
        validation_fraction=0.25,
        validation_every_steps=10,
        trackers=["tensorboard"],
        validation_length_buckets=[24, 48],
    )
    assert s["packing"] and s["rows"] < s["records"] and s["heldout_records"] > 0
    val = _log(tmp_path / "val_log.jsonl")
    assert val and val[-1]["step"] == s["steps"]
    for r in val:
        assert 1.0 <= r["tau"] <= 4.0 and len(r["per_position_acceptance"]) == 3 and r["num_blocks"] > 0
        assert all(a >= b for a, b in zip(r["per_position_acceptance"], r["per_position_acceptance"][1:]))
        # held-out τ per context-length bucket: every block in one bucket, by its anchor's position
        # in its record (packed rows restart positions per record)
        buckets = r["by_context_length"]
        assert set(buckets) <= {"<24", "24–48", "≥48"}
        assert sum(b["num_blocks"] for b in buckets.values()) == r["num_blocks"]
        assert abs(sum(b["tau"] * b["num_blocks"] for b in buckets.values()) / r["num_blocks"] - r["tau"]) < 1e-9
    assert val[-1]["tau"] > val[0]["tau"]  # it learns the +1 pattern on prompts it never saw
    events = list((tmp_path / "trackers").rglob("events.out.tfevents.*"))
    assert events and (tmp_path / "val_tau.png").is_file()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for e in events:
        acc = EventAccumulator(str(e))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert {"train/loss", "val/tau", "val/per_position_acceptance/1"} <= tags


def test_packing_refuses_a_target_that_leaks_across_records(setup, tmp_path, monkeypatch):
    root, probe = setup
    from dflash_pipeline.train import packing

    def leaky(target, layer_ids, **kw):
        raise ValueError("train.packing: target X does not keep packed records apart")

    monkeypatch.setattr(packing, "check_target_isolates_records", leaky)
    with pytest.raises(ValueError, match="packed records apart"):
        _run(root, probe, tmp_path, packing=True)


def _env():
    return {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def _train_args(root, out, cfg):
    return [
        "-m",
        "dflash_pipeline.train.run",
        "--probe",
        str(root / "probe.json"),
        "--target",
        str(root / "target"),
        "--out-dir",
        str(out),
        "--train-config",
        json.dumps(cfg),
        str(root / "tokens.parquet"),
    ]


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc), the ranks torchrun started in sessions of their own."""
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [c for c, pp in parents.items() if pp == parent]
        out += kids
        todo += kids
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_when_saved(main: subprocess.Popen, others: list, out: Path, at_least: int) -> int:
    """Read the main launcher's output lines until state/ holds a step ≥ ``at_least``; SIGKILL every
    launcher's process group (launcher + its ranks). Returns the saved step. The ranks (torchrun starts each
    in a session of its own, out of the killed group) must end with their launcher: a rank living on would
    write state/ under the resumed run."""
    saved = None
    for line in main.stdout:
        if line.startswith("[train] step ") and (out / "state" / "step.json").is_file():
            saved = json.loads((out / "state" / "step.json").read_text())["step"]
            if saved >= at_least:
                break
    ranks = [r for p in [main, *others] for r in _descendants(p.pid)]
    assert ranks, "no rank processes under the launchers"
    for p in [main, *others]:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=60)
    deadline = time.monotonic() + 60
    while any(_alive(r) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [r for r in ranks if _alive(r)], "ranks outlived their killed launcher"
    assert saved is not None and saved >= at_least, "the run ended before saving state"
    return saved


def _resumed_step(text: str) -> int:
    m = re.search(r"resumed from .* at step (\d+)/", text)
    assert m, text[-3000:]
    return int(m.group(1))


def test_fsdp_two_cpu_ranks_train_save_kill_resume(setup, tmp_path):
    root, probe = setup
    cfg = {
        **CFG,
        "num_processes": 2,
        "fsdp": True,
        "epochs": 30,
        "save_every_steps": 3,
        "validation_fraction": 0.2,
        "validation_every_steps": 3,
        "log_every_steps": 1,
    }
    launch = [
        sys.executable,
        "-m",
        "dflash_pipeline.workflow.policy",
        "launch",
        json.dumps({**cfg, "main_process_port": free_port()}),
        "--",
    ]
    cmd = launch + _train_args(root, tmp_path, cfg)
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), start_new_session=True
    )
    saved = _kill_when_saved(p, [], tmp_path, 3)
    assert not (tmp_path / "final").exists()
    assert any(x.name.startswith("pytorch_model_fsdp") for x in (tmp_path / "state").iterdir())  # sharded state
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert _resumed_step(out.stdout + out.stderr) >= saved
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["fsdp"] is True and summary["num_processes"] == 2
    drafter = DB.load_drafter(tmp_path / "final")  # the gathered export is a full, servable checkpoint
    assert M.count_parameters(drafter) == summary["trainable_params"]
    assert _log(tmp_path / "val_log.jsonl")[-1]["step"] == summary["steps"]


def test_two_machines_one_process_each_on_loopback_kill_resume(setup, tmp_path):
    """2 "machines" (two launchers, DFLASH_MACHINE_RANK 0 and 1, rank 0 at 127.0.0.1) × 1 CPU process."""
    root, probe = setup
    cfg = {
        **CFG,
        "num_processes": 1,
        "num_machines": 2,
        "main_process_ip": "127.0.0.1",
        "main_process_port": free_port(),
        "epochs": 30,
        "save_every_steps": 3,
        "trace_batches": True,
    }
    cmd = [sys.executable, "-m", "dflash_pipeline.workflow.policy", "launch", json.dumps(cfg), "--"] + _train_args(
        root, tmp_path, cfg
    )

    def start(rank, stdout):
        return subprocess.Popen(
            cmd,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**_env(), "DFLASH_MACHINE_RANK": str(rank)},
        )

    with open(tmp_path / "machine1.log", "w") as m1:
        p0, p1 = start(0, subprocess.PIPE), start(1, m1)
        saved = _kill_when_saved(p0, [p1], tmp_path, 3)
    with open(tmp_path / "machine1.resume.log", "w") as m1:
        p1 = start(1, m1)
        p0 = start(0, subprocess.PIPE)
        text, _ = p0.communicate(timeout=600)
        assert p1.wait(timeout=120) == 0 and p0.returncode == 0, text[-3000:]
    assert "machines=2 rank=0" in text and "machines=2 rank=1" in (tmp_path / "machine1.log").read_text()
    assert _resumed_step(text) >= saved
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["num_processes"] == 2 and (tmp_path / "final" / "model.safetensors").is_file()
    # per step, the batch each rank saw last (the killed run traced the steps it redid after resume too)
    r0, r1 = ({x["step"]: x["batch"] for x in _log(tmp_path / "trace" / f"rank{r}.jsonl")} for r in (0, 1))
    assert set(r0) == set(r1) == set(range(summary["steps"]))
    assert all(r0[k] != r1[k] for k in r0)  # the two machines' ranks see different data
