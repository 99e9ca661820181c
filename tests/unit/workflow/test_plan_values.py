"""Plan-time values computed once per process (dflash_pipeline.workflow.policy): the target dir of the rules'
`target` input and the manifest's shard list, which every job's params and every aggregate's input ask for."""

from __future__ import annotations

import json
import os

from dflash_pipeline import prompts
from dflash_pipeline.prompts import sharding
from dflash_pipeline.workflow import policy


def test_target_dir_of_a_real_target_and_of_the_demo():
    assert policy.target_dir_of("/models/qwen/config.json") == "/models/qwen"
    assert policy.target_dir_of("resources/demo-target") == "resources/demo-target"
    assert policy.target_dir_of("config.json") == "."


def write_manifest(path, names):
    path.write_text(
        json.dumps({"datasets": {"gsm8k": {"shards": [{"name": n, "path": f"gsm8k/{n}.parquet"} for n in names]}}})
    )


def test_shard_list_parses_a_manifest_once_and_again_when_it_changes(tmp_path, monkeypatch):
    manifest = tmp_path / "manifest.json"
    write_manifest(manifest, ["00000", "00001"])
    reads = []
    real = sharding.list_shards
    monkeypatch.setattr(prompts, "list_shards", lambda p: reads.append(p) or real(p))
    first = policy.shard_list(manifest)
    assert first == [("gsm8k", "00000"), ("gsm8k", "00001")]
    first.append(("x", "y"))  # a caller's list is its own
    assert policy.shard_list(str(manifest)) == [("gsm8k", "00000"), ("gsm8k", "00001")]
    assert len(reads) == 1
    # the checkpoint rewrites it (atomically: a new file) during the run: the new shards are planned
    tmp = tmp_path / "manifest.json.tmp"
    write_manifest(tmp, ["00000", "00001", "00002"])
    os.replace(tmp, manifest)
    assert policy.shard_list(manifest)[-1] == ("gsm8k", "00002")
    assert len(reads) == 2
