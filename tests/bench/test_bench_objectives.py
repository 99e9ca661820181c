"""Smoke test of bench/bench_objectives.py: at its tiny size it trains every objective with two
seeds on the same token shard, evaluates them on the same prompts and prints τ with its bootstrap standard
error and 95 % interval per set; a second run reuses the finished runs. The bootstrap itself is checked on
hand-made numbers."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import bench_objectives as B  # noqa: E402


def test_bootstrap_separates_a_real_difference_from_noise():
    rng = np.random.default_rng(1)
    difficulty = rng.normal(0, 1.0, size=60)  # prompts differ a lot; the objectives differ by 0.3 everywhere
    per = {
        lo: {s: {"set": [[4.0 + d + shift + rng.normal(0, 0.05)] for d in difficulty]} for s in (0, 1, 2)}
        for lo, shift in (("a", 0.0), ("b", 0.3), ("c", 0.0))
    }
    st = B.bootstrap(per, ["a", "b", "c"], [0, 1, 2], resamples=500)["set"]
    assert st["num_conversations"] == 60 and st["num_responses"] == 60
    assert st["se"]["a"] > 0.08  # the prompts' spread makes each τ uncertain...
    assert st["delta_se"]["b"] < 0.05  # ...but the paired difference cancels it
    lo, hi = st["delta_ci95"]["b"]
    assert 0.2 < lo < 0.3 < hi < 0.4
    lo, hi = st["delta_ci95"]["c"]
    assert lo < 0 < hi
    lines = B.verdict({"set": st}, ["a", "b", "c"])
    assert lines[0].startswith("b beats a on every set") and "no difference" in lines[1]


def test_tiny_bench_prints_tau_with_standard_errors(tmp_path):
    cmd = [
        sys.executable,
        str(REPO / "bench" / "bench_objectives.py"),
        "--size",
        "tiny",
        "--losses",
        "ce_decay",
        "dpace",
        "--seeds",
        "0",
        "1",
        "--bootstrap",
        "100",
        "--work",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| objective | gsm8k (3 conv., 3 resp.) |" in proc.stdout
    assert "τ over 2 seeds (0, 1)" in proc.stdout and "± bootstrap SE" in proc.stdout
    rec = json.loads((tmp_path / "objectives.json").read_text())
    st = rec["stats"]["gsm8k"]
    assert set(st["per_seed"]) == {"ce_decay", "dpace"} and all(len(v) == 2 for v in st["per_seed"].values())
    assert all(len(st["ci95"][lo]) == 2 and st["se"][lo] >= 0 for lo in ("ce_decay", "dpace"))
    assert rec["train_steps"] == 4  # the same steps for every run: 32 records, batch 8, 1 epoch
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(("seed0", "seed1"))) == [
        "ce_decay-seed0",
        "ce_decay-seed1",
        "dpace-seed0",
        "dpace-seed1",
    ]
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and "[bench] trained" not in again.stdout  # finished runs are reused
    assert "[bench] evaluated" not in again.stdout  # and their evals
    assert json.loads((tmp_path / "objectives.json").read_text())["stats"] == rec["stats"]


@pytest.mark.parametrize("argv", [["--work", "x"], ["--work", "x", "--tokens", "t.parquet"]])
def test_inputs_are_required(argv):
    with pytest.raises(SystemExit):
        B.parse_args(argv)
