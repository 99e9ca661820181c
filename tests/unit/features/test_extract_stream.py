"""``extract-many``: feature shards written through the stream client, one set of feature servers for the
whole job (started once by the job, stopped at its end): the shards hold the hf extractor's values."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from test_features import LAYERS, token_shard
from test_stream import FAST_FLEET, REPO, setup  # noqa: F401 - setup is a fixture

from dflash_pipeline.features import FeatureShard


def test_extract_many_through_one_server_equals_hf_extraction(setup, tmp_path):  # noqa: F811
    """Three token shards (the setup's two, with hf feature shards, and a third), last hidden state
    included, through one colocated server started by the job: every record's features equal the hf
    backend's shard bit for bit, each record is sent once, and the job starts exactly one server and
    leaves none behind (its scratch dir is empty, a killed job's leftover answers included)."""
    from dflash_pipeline.features.extract import extract_shard
    from dflash_pipeline.train.stream import stream_settings

    root, probe, tokens, _ = setup
    tokens = [*tokens, token_shard(tmp_path / "c.parquet", 6, 7)]
    ref = []
    for t in tokens:
        f = tmp_path / f"ref-{t.stem}.safetensors"
        extract_shard(
            t,
            f,
            target_dir=root / "target",
            target_layer_ids=LAYERS,
            hidden_size=32,
            num_hidden_layers=4,
            backend="hf",
            last_hidden=True,
        )
        ref.append(f)
    (tmp_path / "probe.json").write_text(json.dumps({**probe, "num_hidden_layers": 4}))
    stream = {**stream_settings({"fleet": FAST_FLEET}), "scratch_dir": str(tmp_path / "scratch"), "max_len": 4096}
    outs = [tmp_path / f"out-{t.stem}.safetensors" for t in tokens]
    leftover = tmp_path / "scratch" / "server0" / "killed-job-answer.safetensors"  # a SIGKILLed job's window
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"x" * 1024)
    cmd = [sys.executable, "-m", "dflash_pipeline.features", "extract-many", "--probe", str(tmp_path / "probe.json")]
    cmd += ["--target", str(root / "target"), "--stream-config", json.dumps(stream)]
    cmd += ["--features-config", json.dumps({"dtype": "bfloat16", "last_hidden": True, "chunk_tokens": 64})]
    for t, o in zip(tokens, outs):
        cmd += ["--token-shard", str(t), "--out", str(o)]
    p = subprocess.run(cmd, capture_output=True, text=True, env={"PYTHONPATH": str(REPO / "src"), **_env()})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "extract-many: 3 shard(s) through 1 feature server(s) (started once by this job" in p.stdout
    logs = sorted((tmp_path / "scratch").glob("server*.log"))  # one server for the three shards
    assert [x.name for x in logs] == ["server0.log"] and logs[0].read_text().count("[features] serving ") == 1
    stats = json.loads(p.stdout.split("[features] extract-many done ", 1)[1].splitlines()[0])
    for o, f, st in zip(outs, ref, stats):
        a, b = FeatureShard(o), FeatureShard(f)
        assert len(a) == len(b) and st["server_requests"] == sum(
            1 for r in range(len(b)) if b.offsets[r + 1] > b.offsets[r]
        )
        for r in range(len(b)):
            assert torch.equal(a.features(r), b.features(r)) and torch.equal(a.last_hidden(r), b.last_hidden(r))
            assert all((x == y).all() for x, y in zip(a.tokens(r), b.tokens(r)))
    assert list((tmp_path / "scratch" / "server0").iterdir()) == []


def _env():
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
