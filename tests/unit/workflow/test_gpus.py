"""GPU resources per rule and local device assignment (two concurrent GPU jobs never share a device)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dflash_pipeline.workflow.policy import claim_gpus, job_gpus, run_with_gpus


def cfg(mixed_precision="bf16", num_processes=4, backend="transformers", device="auto"):
    return {
        "train": {"mixed_precision": mixed_precision, "num_processes": num_processes, "device": device},
        "generation": {"backend": backend},
    }


def test_job_gpus_per_rule():
    assert job_gpus(cfg(), "train_drafter") == 4
    assert job_gpus(cfg(), "evaluate_acceptance") == 1
    assert job_gpus(cfg(), "generate_completions") == 1
    assert job_gpus(cfg(backend="openai"), "generate_completions") == 0
    assert job_gpus(cfg(), "tokenize_completions") == 0
    assert all(
        job_gpus(cfg(mixed_precision="no"), r) == 0
        for r in ("train_drafter", "evaluate_acceptance", "generate_completions")
    )
    # bf16 on a CPU box: train.device cpu claims no GPU for any rule
    assert all(
        job_gpus(cfg(device="cpu"), r) == 0 for r in ("train_drafter", "evaluate_acceptance", "generate_completions")
    )
    # feature extraction takes features.gpus (0 = CPU), whatever the run's precision
    for mp, n in (("no", 2), ("bf16", 8), ("bf16", 0)):
        assert job_gpus({**cfg(mixed_precision=mp), "features": {"gpus": n}}, "extract_features") == n


@pytest.fixture
def pool(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    monkeypatch.setenv("DFLASH_GPU_LOCK_DIR", str(tmp_path / "locks"))
    return tmp_path / "locks"


def test_claims_are_disjoint_and_restored(pool):
    devices = ["0", "1", "2"]  # nested claims stand for concurrent jobs: each sees the whole pool
    with claim_gpus(1) as a:
        assert os.environ["CUDA_VISIBLE_DEVICES"] == a[0]
        with claim_gpus(2, pool=devices) as b:
            assert len(b) == 2 and not set(a) & set(b)
            assert os.environ["CUDA_VISIBLE_DEVICES"] == ",".join(b)
            with pytest.raises(TimeoutError):  # all three are held
                with claim_gpus(1, pool=devices, poll_s=0.05, timeout_s=0.2):
                    pass
        with claim_gpus(2, pool=devices) as c:  # b's devices are free again
            assert not set(a) & set(c)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2"


def test_scheduler_assignment_is_kept_and_cpu_jobs_untouched(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_GPU_LOCK_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")  # e.g. SLURM's --gpus=2 or the ssh profile
    with claim_gpus(2) as got:
        assert got == ["5", "7"]
    assert not list(tmp_path.iterdir())  # no locks taken
    with claim_gpus(0) as got:
        assert got == [] and os.environ["CUDA_VISIBLE_DEVICES"] == "5,7"


def test_too_few_devices_is_a_clear_error(pool):
    with pytest.raises(RuntimeError, match="asks for 4 GPU"):
        with claim_gpus(4):
            pass


def test_wrapper_holds_devices_across_processes(pool):
    """A job run through the wrapper (as train_drafter's shell does) blocks that device for others."""
    code = "import os, time; print(os.environ['CUDA_VISIBLE_DEVICES'], flush=True); time.sleep(30)"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    holder = subprocess.Popen(
        [sys.executable, "-m", "dflash_pipeline.workflow.policy", "gpus", "2", "--", sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        held = holder.stdout.readline().strip().split(",")
        assert len(held) == 2
        with claim_gpus(1) as mine:
            assert mine[0] not in held
            with pytest.raises(TimeoutError):
                with claim_gpus(1, pool=["0", "1", "2"], poll_s=0.05, timeout_s=0.2):
                    pass
    finally:
        holder.kill()
        holder.wait()  # the wrapper's locks die with it
    with claim_gpus(3) as all3:  # the killed job's locks died with it
        assert sorted(all3) == ["0", "1", "2"]


def test_wrapper_usage_and_exit_code(pool, capsys):
    assert run_with_gpus(["nope"]) == 2
    assert "usage: python -m dflash_pipeline.workflow gpus N" in capsys.readouterr().err
    assert run_with_gpus(["--help"]) == 0  # asked for: the usage on stdout, success
    assert "python -m dflash_pipeline.workflow launch TRAIN_CONFIG_JSON" in capsys.readouterr().out
    assert run_with_gpus(["gpus", "1", "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3
