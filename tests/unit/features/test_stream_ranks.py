"""``train.target_features: stream`` on several ranks: two gloo ranks under FSDP2 (Accelerate's launcher, CPU),
each rank with its own :class:`~dflash_pipeline.features.FeatureClient` against one hf feature server, train
the same run as two ranks reading the feature shards ("several ranks and machines, FSDP2 work with
stream")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from test_stream import FAST_FLEET, Server, setup  # noqa: F401 (setup: the module fixture)

from dflash_pipeline.core.procs import free_port
from dflash_pipeline.workflow.policy import accelerate_launch_args

REPO = Path(__file__).resolve().parents[3]
#: Two ranks of two records per step under FSDP2, one epoch (34 records: 9 steps).
CFG = {"num_processes": 2, "batch_size": 2, "fsdp": True, "epochs": 1, "trace_batches": True}


def _launch(run_setup, out: Path, mode: str, port: int, stream: dict | None = None) -> dict:
    """One two-rank training run (``mode``: shards or stream) through ``accelerate launch``; its summary."""
    from test_features import TRAIN_CFG

    root, probe, tokens, feats = run_setup
    (root / "probe.json").write_text(json.dumps(probe))
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *accelerate_launch_args(2),
        "--main_process_port",
        str(port),
        "-m",
        "dflash_pipeline.train.run",
        "--probe",
        str(root / "probe.json"),
        "--target",
        str(root / "target"),
        "--out-dir",
        str(out),
        "--train-config",
        json.dumps(dict(TRAIN_CFG, **CFG, target_features=mode)),
        "--device",
        "cpu",
    ]
    if mode == "shards":
        cmd += [a for f in feats for a in ("--feature-shard", str(f))]
    if stream is not None:
        cmd += ["--stream-config", json.dumps(stream)]
    cmd += [str(t) for t in tokens]
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO / "src"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "train_summary.json").read_text())


def _losses(out: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (out / "train_log.jsonl").read_text().splitlines()]


def test_two_fsdp2_ranks_stream_the_shards_run(setup, tmp_path):  # noqa: F811
    """Same features (the server's bf16 values are the shards' bits): every loss and the final weights of the
    two-rank stream run equal the two-rank shards run's, bit for bit; each rank streamed its own records."""
    from safetensors.torch import load_file

    ref = _launch(setup, tmp_path / "shards", "shards", port=free_port())
    server = Server(setup[0] / "target", tmp_path / "scratch")
    try:
        st = _launch(
            setup,
            tmp_path / "stream",
            "stream",
            port=free_port(),
            stream={"endpoints": [{"base_url": server.url}], "scratch_dir": str(server.scratch), "fleet": FAST_FLEET},
        )
    finally:
        server.kill()
    assert st["num_processes"] == ref["num_processes"] == 2 and st["steps"] == ref["steps"] > 1
    assert _losses(tmp_path / "stream") == _losses(tmp_path / "shards")
    a = load_file(tmp_path / "shards" / "final" / "model.safetensors")
    b = load_file(tmp_path / "stream" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    traces = [
        [json.loads(x)["batch"] for x in (tmp_path / "stream" / "trace" / f"rank{r}.jsonl").read_text().splitlines()]
        for r in (0, 1)
    ]
    assert all(x != y for x, y in zip(*traces))  # the ranks trained on different records
    assert list(server.scratch.iterdir()) == []  # every streamed file was read and deleted
