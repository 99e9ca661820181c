"""End to end: real Snakemake on the reduced config (tests/e2e_config.yaml) in a temp working directory.

One full build, then the rebuild semantics users rely on (DESIGN.md §3), each asserted on the job
counts of `snakemake -n`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


def snakemake(workdir: Path, *args: str, configfile: Path | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run snakemake on the repo's Snakefile in ``workdir`` with the local profile; returns the process."""
    cmd = [
        sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir),
        "--profile", str(REPO / "profiles" / "local"), "--configfile", str(configfile or workdir / "config.yaml"),
        *args,
    ]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=timeout, env=env)


def planned_jobs(proc: subprocess.CompletedProcess) -> dict[str, int]:
    """Job counts per rule from a dry run's "Job stats" table ({} when there is nothing to do)."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    if "Nothing to be done" in out:
        return {}
    table = out.split("Job stats:", 1)[1]
    counts = {}
    for line in table.splitlines()[3:]:
        m = re.match(r"^(\w+)\s+(\d+)$", line.strip())
        if not m:
            break
        counts[m.group(1)] = int(m.group(2))
    return counts


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The reduced workflow, built once for this module."""
    work = tmp_path_factory.mktemp("e2e")
    cfg = yaml.safe_load((REPO / "tests" / "e2e_config.yaml").read_text())
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    proc = snakemake(work)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return work, cfg


def test_full_build_outputs(built):
    work, cfg = built
    probe = json.loads((work / "results/probe/target.json").read_text())
    assert probe["drafter"]["block_size"] == 4 and len(probe["drafter"]["target_layer_ids"]) == 2
    manifest = json.loads((work / "results/prompts/manifest.json").read_text())
    assert manifest["datasets"]["gsm8k"]["kept"] == 12 and manifest["datasets"]["mt_bench"]["kept"] == 4
    final = work / "results/checkpoints/e2e/final"
    ckpt = json.loads((final / "config.json").read_text())
    assert ckpt["architectures"] == ["DFlashDraftModel"] and ckpt["block_size"] == 4
    assert ckpt["dflash_config"]["mask_token_id"] == probe["drafter"]["mask_token_id"]
    assert (final / "model.safetensors").stat().st_size > 0
    ev = json.loads((work / "results/eval/e2e/acceptance.json").read_text())
    for label in ("trained", "untrained"):
        s = ev["drafters"][label]["sets"]["gsm8k"]
        assert 1.0 <= s["tau"] <= 4.0 and s["num_responses"] == 2
    assert ev["settings"]["thinking"] == "disable" and ev["settings"]["block_size"] == 4
    assert (work / "results/eval/e2e/acceptance.png").stat().st_size > 1000
    assert (work / "results/checkpoints/e2e/state/step.json").is_file()  # resumable state kept


def test_rerun_does_nothing(built):
    work, _ = built
    assert planned_jobs(snakemake(work, "-n")) == {}


def test_tokenization_change_never_regenerates_completions(built):
    work, cfg = built
    changed = dict(cfg, tokens={**cfg["tokens"], "max_length": 150})
    path = work / "tokens_changed.yaml"
    path.write_text(yaml.safe_dump(changed))
    jobs = planned_jobs(snakemake(work, "-n", configfile=path))
    assert jobs.get("tokenize_completions") == 3  # gsm8k 12 prompts -> 2 shards of 8, mt_bench 4 -> 1
    assert "generate_completions" not in jobs and "shard_prompts" not in jobs
    assert jobs.get("train_drafter") == 1 and jobs.get("evaluate_acceptance") == 1


def test_generation_change_regenerates_all_completions(built):
    work, cfg = built
    changed = dict(cfg, generation={**cfg["generation"], "max_tokens": 13})
    path = work / "gen_changed.yaml"
    path.write_text(yaml.safe_dump(changed))
    jobs = planned_jobs(snakemake(work, "-n", configfile=path))
    assert jobs.get("generate_completions") == 3 and jobs.get("tokenize_completions") == 3


def test_failed_shard_reruns_only_that_shard(built):
    """A run where one generation job died (keep-going) has neither that completion nor its token shard,
    and no checkpoint or eval: the rerun does only that shard, its tokens, train and eval; the other
    shards' completions are kept."""
    work, _ = built
    lost = [work / "results/completions/gsm8k/00001.parquet", work / "results/tokens/gsm8k/00001.parquet",
            work / "results/eval/e2e/acceptance.json"]
    final = work / "results/checkpoints/e2e/final"
    saved = [p.read_bytes() for p in lost]
    for p in lost:
        p.unlink()
    final.rename(final.with_name("final.aside"))
    try:
        jobs = planned_jobs(snakemake(work, "-n"))
        assert jobs.get("generate_completions") == 1 and jobs.get("tokenize_completions") == 1
        assert jobs.get("train_drafter") == 1 and jobs.get("evaluate_acceptance") == 1
        assert "shard_prompts" not in jobs and "probe_target" not in jobs
    finally:
        for p, data in zip(lost, saved):
            p.write_bytes(data)
        final.with_name("final.aside").rename(final)
