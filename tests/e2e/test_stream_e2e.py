"""End to end on CPU through real Snakemake: the reduced e2e config trained with
``train.target_features: stream`` through a real vLLM CPU feature server (colocated: the train job starts
``vllm serve`` with extract_hidden_states + our CPU connector, trains against it, stops it), against the
same data trained from vLLM feature shards.

Tolerance: the two runs see the same batches in the same order (the batch sequence is a function of the
seed and epoch), but vLLM computes the features in differently composed batches (the offline engine takes a
chunk of records at once, the server whatever requests are in flight), so fp32 matmuls over other shapes
give features that differ in the last bits, and a bf16 rounding can flip; the loss curves then agree to
1e-3 relative per step, not bit for bit (the hf server's stream run is bit-equal to its shards run:
tests/unit/features/test_stream.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mini_workflow import REPO, planned_jobs, snakemake, write_config

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(3600),
]  # a demo target, two runs, two vLLM engine starts


def _losses(work: Path, run: str) -> list[float]:
    return [
        json.loads(x)["loss"] for x in (work / f"results/checkpoints/{run}/train_log.jsonl").read_text().splitlines()
    ]


@pytest.fixture(scope="module")
def built(tmp_path_factory, vllm_python):
    import yaml

    work = tmp_path_factory.mktemp("stream-e2e")
    cfg = yaml.safe_load((REPO / "tests" / "e2e" / "e2e_config.yaml").read_text())
    cfg["datasets"] = {"gsm8k": {"path": str(REPO / "data/gsm8k/train.jsonl"), "max_prompts": 8}}
    cfg["train"] = {
        **cfg["train"],
        "epochs": 3,
        "batch_size": 2,
        "save_every_steps": 1000,
    }
    cfg["eval"] = {
        "baselines": [],
        "sets": {"gsm8k": {"path": str(REPO / "data/gsm8k/test.jsonl"), "num_samples": 1}},
    }
    vllm = {"python": vllm_python}
    shards = dict(
        cfg,
        run="shards",
        train={**cfg["train"], "target_features": "shards"},
        features={"backend": "vllm", "vllm": vllm},
    )
    stream = dict(
        cfg,
        run="stream",
        train={**cfg["train"], "target_features": "stream"},
        features={"vllm": vllm, "stream": {"backend": "vllm", "servers": 1}},
    )
    c_sh, c_st = (
        write_config(work, shards, "shards.yaml"),
        write_config(work, stream, "stream.yaml"),
    )
    proc = snakemake(work, "results/checkpoints/shards/final", configfile=c_sh, timeout=3000)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    plan = snakemake(work, "-n", "results/checkpoints/stream/final", configfile=c_st)
    proc = snakemake(work, "results/checkpoints/stream/final", configfile=c_st, timeout=3000)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return work, plan


def test_stream_plan_names_the_server_and_no_extraction(built):
    _, plan = built
    out = plan.stdout + plan.stderr
    assert "[plan] stream: 1 colocated vllm server(s) x 0 GPU(s); 1 trainer rank(s); window" in out, out[-3000:]
    jobs = planned_jobs(plan)
    assert jobs.get("train_drafter") == 1 and "extract_features" not in jobs


def test_stream_through_vllm_equals_the_shards_run(built):
    work, _ = built
    l_sh, l_st = _losses(work, "shards"), _losses(work, "stream")
    print(f"loss shards {l_sh[0]:.5f}..{l_sh[-1]:.5f} stream {l_st[0]:.5f}..{l_st[-1]:.5f}")
    assert len(l_sh) == len(l_st)
    for a, b in zip(l_sh, l_st):
        assert abs(a - b) <= 1e-3 * abs(a), (a, b)
    log = (work / "results/logs/train_drafter/stream.log").read_text()
    assert "[stream] colocated: 1 vllm feature server(s)" in log and "peak scratch" in log
    summary = json.loads((work / "results/checkpoints/stream/train_summary.json").read_text())
    assert summary["stream"]["requests"] > 0 and summary["train_config"]["target_features"] == "stream"
    assert not any((work / "results/stream_scratch/stream/server0").iterdir())  # every answer's file deleted
