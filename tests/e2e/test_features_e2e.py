"""End to end on CPU through real Snakemake, in one working directory on the same data: trained online, from vLLM
feature shards, and from a colocated vLLM feature server (``train.target_features: stream``).

- ``online`` and ``shards``: one vLLM engine start for the extract_features job of the single token shard; then
  the hf backend extracts the same token shard in-process and the two feature shards are compared.
- ``stream``: the ``shards`` run's settings through a real vLLM CPU feature server (the train job starts
  ``vllm serve`` with extract_hidden_states and our CPU connector, trains against it, stops it; the first
  epoch's features cached for the others, ``features.stream.cache: first_epoch``): the second engine start.
  The two runs see the same batches in the same order (the batch sequence is a function of the seed and
  epoch), but vLLM computes the features in differently composed batches (the offline engine takes a chunk of
  records at once, the server whatever requests are in flight), so fp32 matmuls over other shapes give features
  that differ in the last bits, and a bf16 rounding can flip; the loss curves then agree to 1e-3 relative per
  step, not bit for bit (the hf server's stream run is bit-equal to its shards run:
  tests/unit/features/test_stream.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mini_workflow import REPO, planned_jobs, snakemake, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]  # four runs, two vLLM engine starts


def _tau(work: Path, run: str) -> dict:
    ev = json.loads((work / f"results/eval/{run}/acceptance.json").read_text())
    return {s: v["tau"] for s, v in ev["drafters"]["trained"]["sets"].items()}


def _losses(work: Path, run: str) -> list[float]:
    return [
        json.loads(x)["loss"] for x in (work / f"results/checkpoints/{run}/train_log.jsonl").read_text().splitlines()
    ]


@pytest.fixture(scope="module")
def built(tmp_path_factory, vllm_python):
    """The reduced e2e config (the shipped target) on 8 GSM8K prompts in one shard, its four runs:
    ``(work, shards plan, shards config, stream plan)``."""
    import yaml

    work = tmp_path_factory.mktemp("features-e2e")
    cfg = yaml.safe_load((REPO / "tests" / "e2e" / "e2e_config.yaml").read_text())
    cfg["datasets"] = {"gsm8k": {"path": str(REPO / "data/gsm8k/train.jsonl"), "max_prompts": 8}}
    cfg["train"] = {**cfg["train"], "epochs": 25, "batch_size": 2, "learning_rate": 2.0e-3, "save_every_steps": 1000}
    cfg["eval"] = {
        "max_new_tokens": 12,
        "checkpoint_samples": 0,
        "exclude_training_prompts": False,
        "sets": {"gsm8k": {"path": str(REPO / "data/gsm8k/train.jsonl"), "num_samples": 4}},
    }
    features = {"backend": "vllm", "keep": True, "vllm": {"python": vllm_python}}
    online = dict(cfg, run="online")
    shards = dict(cfg, run="shards", train={**cfg["train"], "target_features": "shards"}, features=features)
    # the shards run's settings, streamed; the first epoch's features are cached for the other 24
    stream = dict(
        cfg,
        run="stream",
        train={**cfg["train"], "target_features": "stream"},
        features={**features, "stream": {"backend": "vllm", "servers": 1, "cache": "first_epoch"}},
    )
    c_on, c_sh = write_config(work, online, "online.yaml"), write_config(work, shards, "shards.yaml")
    c_st = write_config(work, stream, "stream.yaml")
    proc = snakemake(work, "results/eval/online/acceptance.json", configfile=c_on, timeout=2400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    plan = snakemake(work, "-n", "results/eval/shards/acceptance.json", configfile=c_sh)
    proc = snakemake(work, "results/eval/shards/acceptance.json", configfile=c_sh, timeout=2400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    stream_plan = snakemake(work, "-n", "results/checkpoints/stream/final", configfile=c_st)
    proc = snakemake(work, "results/checkpoints/stream/final", configfile=c_st, timeout=3000)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return work, plan, c_sh, stream_plan


def test_plan_states_feature_disk(built):
    work, plan, _, _ = built
    out = plan.stdout + plan.stderr
    probe = json.loads((work / "results/probe/shards.json").read_text())
    k, h = len(probe["drafter"]["target_layer_ids"]), probe["hidden_size"]
    assert f"= {k * h * 2 + 5:,} B/token" in out, out[-3000:]
    assert "tokens (exact)" in out and "free on the results filesystem" in out
    jobs = planned_jobs(plan)
    assert jobs.get("extract_features") == 1 and jobs.get("train_drafter") == 1
    assert "generate_completions" not in jobs and "tokenize_completions" not in jobs  # same data as online


def test_shards_run_matches_online(built):
    work, _, _, _ = built
    t_on, t_sh = _tau(work, "online"), _tau(work, "shards")
    l_on, l_sh = _losses(work, "online"), _losses(work, "shards")
    print(f"tau online {t_on} shards {t_sh}; final loss online {l_on[-1]:.4f} shards {l_sh[-1]:.4f}")
    assert len(l_on) == len(l_sh)
    assert abs(l_on[0] - l_sh[0]) <= 0.02 * l_on[0]  # same batches, features equal up to bf16
    assert abs(l_on[-1] - l_sh[-1]) <= 0.1 * l_on[-1]
    for s in t_on:
        assert abs(t_on[s] - t_sh[s]) <= 0.35, (s, t_on[s], t_sh[s])
    log = (work / "results/logs/train_drafter/shards.log").read_text()
    assert "records=" in log
    meta = json.loads((work / "results/checkpoints/shards/train_summary.json").read_text())
    assert meta["train_config"]["target_features"] == "shards"


def test_hf_and_vllm_features_agree(built, tmp_path):
    from dflash_pipeline.features import FeatureShard
    from dflash_pipeline.features.extract import extract_shard

    work, _, _, _ = built
    probe = json.loads((work / "results/probe/shards.json").read_text())
    (vllm_path,) = sorted((work / "results/features").glob("*/*.safetensors"))
    token = work / "results/tokens" / vllm_path.parent.name / (vllm_path.stem + ".parquet")
    v = FeatureShard(vllm_path)
    assert v.metadata["backend"] == "vllm"
    v.check_tokens(token)
    target_dir = Path(probe["target_dir"])
    target_dir = target_dir if target_dir.is_absolute() else work / target_dir  # the demo target: workdir-relative
    hf = extract_shard(
        token,
        tmp_path / "hf.safetensors",
        target_dir=target_dir,
        target_layer_ids=probe["drafter"]["target_layer_ids"],
        hidden_size=probe["hidden_size"],
        num_hidden_layers=probe["num_hidden_layers"],
        backend="hf",
    )
    h = FeatureShard(tmp_path / "hf.safetensors")
    diff = scale = 0.0
    for r in range(len(h)):
        a, b = h.features(r).float(), v.features(r).float()
        diff, scale = max(diff, (a - b).abs().max().item()), max(scale, a.abs().max().item())
    print(f"hf vs vllm features: max abs diff {diff:.3g} (max |x| {scale:.3g}); hf {hf['tokens_per_s']:.0f} tokens/s")
    assert diff <= 0.02 * scale


def test_rerun_does_nothing(built):
    work, _, c_sh, _ = built
    assert planned_jobs(snakemake(work, "-n", "results/eval/shards/acceptance.json", configfile=c_sh)) == {}


def test_plan_fails_early_without_disk(built):
    """`snakemake -n` refuses a plan whose missing feature shards do not fit (here: a free-space floor of
    the whole filesystem, after removing the shards so that they count as missing)."""
    import shutil

    import yaml

    work, _, c_sh, _ = built
    cfg = yaml.safe_load(c_sh.read_text())
    cfg["features"] = {**cfg["features"], "min_free_fraction": 1.0}
    path = write_config(work, dict(cfg, run="nodisk"), "nodisk.yaml")
    shutil.copytree(work / "results/features", work / "features.bak")
    shutil.rmtree(work / "results/features")
    try:
        proc = snakemake(work, "-n", "results/eval/nodisk/acceptance.json", configfile=path)
    finally:
        shutil.copytree(work / "features.bak", work / "results/features")
    assert proc.returncode != 0
    assert "features: the feature shards need" in proc.stdout + proc.stderr


def test_stream_plan_names_the_server_and_no_extraction(built):
    _, _, _, plan = built
    out = plan.stdout + plan.stderr
    assert "[plan] stream: 1 colocated vllm server(s) x 0 GPU(s); 1 trainer rank(s); window" in out, out[-3000:]
    jobs = planned_jobs(plan)
    assert jobs.get("train_drafter") == 1 and "extract_features" not in jobs


def test_stream_through_vllm_equals_the_shards_run(built):
    work, _, _, _ = built
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
