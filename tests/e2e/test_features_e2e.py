"""End to end on CPU through real Snakemake: the same data trained online and from vLLM feature shards.

One vLLM engine start in all (the extract_features job of the single token shard). Then the hf backend
extracts the same token shard in-process and the two feature shards are compared (max abs diff printed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mini_workflow import REPO, planned_jobs, snakemake, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3000)]  # a demo target, two runs and one vLLM engine


def _tau(work: Path, run: str) -> dict:
    ev = json.loads((work / f"results/eval/{run}/acceptance.json").read_text())
    return {s: v["tau"] for s, v in ev["drafters"]["trained"]["sets"].items()}


def _losses(work: Path, run: str) -> list[float]:
    return [
        json.loads(x)["loss"] for x in (work / f"results/checkpoints/{run}/train_log.jsonl").read_text().splitlines()
    ]


@pytest.fixture(scope="module")
def built(tmp_path_factory, vllm_python):
    """The reduced e2e config (its demo target, built by the workflow) on 8 GSM8K prompts in one shard."""
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
    online = dict(cfg, run="online")
    shards = dict(
        cfg,
        run="shards",
        train={**cfg["train"], "target_features": "shards"},
        features={"backend": "vllm", "keep": True, "vllm": {"python": vllm_python}},
    )
    c_on, c_sh = write_config(work, online, "online.yaml"), write_config(work, shards, "shards.yaml")
    proc = snakemake(work, "results/eval/online/acceptance.json", configfile=c_on, timeout=2400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    plan = snakemake(work, "-n", "results/eval/shards/acceptance.json", configfile=c_sh)
    proc = snakemake(work, "results/eval/shards/acceptance.json", configfile=c_sh, timeout=2400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return work, plan, c_sh


def test_plan_states_feature_disk(built):
    work, plan, _ = built
    out = plan.stdout + plan.stderr
    probe = json.loads((work / "results/probe/shards.json").read_text())
    k, h = len(probe["drafter"]["target_layer_ids"]), probe["hidden_size"]
    assert f"= {k * h * 2 + 5:,} B/token" in out, out[-3000:]
    assert "tokens (exact)" in out and "free on the results filesystem" in out
    jobs = planned_jobs(plan)
    assert jobs.get("extract_features") == 1 and jobs.get("train_drafter") == 1
    assert "generate_completions" not in jobs and "tokenize_completions" not in jobs  # same data as online


def test_shards_run_matches_online(built):
    work, _, _ = built
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

    work, _, _ = built
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
    work, _, c_sh = built
    assert planned_jobs(snakemake(work, "-n", "results/eval/shards/acceptance.json", configfile=c_sh)) == {}


def test_plan_fails_early_without_disk(built):
    """`snakemake -n` refuses a plan whose missing feature shards do not fit (here: a free-space floor of
    the whole filesystem, after removing the shards so that they count as missing)."""
    import shutil

    import yaml

    work, _, c_sh = built
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
