"""Exact resume through Snakemake: the reduced e2e workflow (tests/e2e/e2e_config.yaml with 6 prompts, as
tests/e2e/test_upgrade.py reduces it, an untrained demo target, 6 epochs of 4 steps) killed with
SIGKILL (its whole process group: Snakemake, the train job's shell, launcher and trainer) once the train job
has saved its first state, then rerun after ``--unlock``, ends with the ``final/model.safetensors`` bytes of
an uninterrupted run (tests/unit/train/test_resume.py holds the same for every trainer setting)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest
import yaml
from conftest import REPO, snakemake, snakemake_command

pytestmark = pytest.mark.e2e

FINAL = "results/checkpoints/e2e/final"


def test_killed_workflow_resumes_to_the_uninterrupted_bytes(tmp_path):
    cfg = yaml.safe_load((REPO / "tests" / "e2e" / "e2e_config.yaml").read_text())
    cfg["datasets"]["gsm8k"]["max_prompts"], cfg["datasets"]["mt_bench"]["max_prompts"] = 4, 2
    cfg["prompts"]["shard_size"] = 4
    # 4 training records one per step: 4 steps per epoch, 24 in all, state every 2 (the first save is mid-epoch)
    cfg["train"] = {**cfg["train"], "epochs": 6, "batch_size": 1}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    whole = snakemake(tmp_path, FINAL, timeout=1800)
    assert whole.returncode == 0, (whole.stdout + whole.stderr)[-6000:]
    expected = (tmp_path / FINAL / "model.safetensors").read_bytes()
    run_dir = tmp_path / FINAL.rsplit("/", 1)[0]
    total = json.loads((run_dir / "train_summary.json").read_text())["steps"]
    assert total >= 12, total
    shutil.rmtree(run_dir)  # the same run again from step 0: only train_drafter is out of date

    cmd, env = snakemake_command(tmp_path, FINAL)
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while not (run_dir / "state" / "step.json").is_file():  # the first state save (atomic rename)
                assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-6000:]
                time.sleep(0.02)
            os.killpg(proc.pid, signal.SIGKILL)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    saved = json.loads((run_dir / "state" / "step.json").read_text())["step"]
    assert not (run_dir / "final").exists() and 0 < saved < total, saved  # killed mid-run, after a state save

    unlock = snakemake(tmp_path, "--unlock")
    assert unlock.returncode == 0, (unlock.stdout + unlock.stderr)[-3000:]
    again = snakemake(tmp_path, FINAL, timeout=1800)
    assert again.returncode == 0, (again.stdout + again.stderr)[-6000:]
    train_log = (tmp_path / "results/logs/train_drafter/e2e.log").read_text()
    resumed = re.search(rf"resumed from \S*checkpoints/e2e/state at step (\d+)/{total}", train_log)
    assert resumed and int(resumed.group(1)) >= saved, train_log[-3000:]  # a resume, not a restart
    assert (tmp_path / FINAL / "model.safetensors").read_bytes() == expected
