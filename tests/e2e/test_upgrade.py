"""Upgrading never regenerates completions: a results directory built by the previous main with the reduced
e2e config keeps every completion shard under this code. The previous main's tree comes from git
(`git archive`, no checkout is touched) and builds with its own Snakefile, profile and package.

What an upgrade may rerun is the cheap part, and only where its inputs changed: the prompts checkpoint
(new `prompts` keys; it rewrites only shards whose bytes change, and none do here), tokenization (the
tokenization code changed), training and eval (new `train`/`eval` keys). README "Upgrading" lists it."""

from __future__ import annotations

import os
import subprocess
import tarfile
import io

import pytest
import yaml

from conftest import REPO, planned_jobs, snakemake

pytestmark = pytest.mark.e2e

#: The main this code was branched from (override: $DFLASH_PREVIOUS_MAIN, a commit or ref).
PREVIOUS_MAIN = os.environ.get("DFLASH_PREVIOUS_MAIN", "77e52f4")


def upgrade_config() -> dict:
    """The e2e config with fewer prompts and eval samples (every stage and a baseline run). Data paths stay
    relative: the workdir links ``data/`` to this repo's, so both trees resolve them the same."""
    cfg = yaml.safe_load((REPO / "tests" / "e2e" / "e2e_config.yaml").read_text())
    cfg["run"] = "upgrade"
    cfg["datasets"]["gsm8k"]["max_prompts"] = 4
    cfg["datasets"]["mt_bench"]["max_prompts"] = 2
    cfg["prompts"]["shard_size"] = 4
    cfg["eval"]["max_new_tokens"] = 4
    for s in cfg["eval"]["sets"].values():
        s["num_samples"] = 1
    return cfg


@pytest.fixture(scope="module")
def previous_main_workdir(tmp_path_factory):
    """A workdir fully built by the previous main (its Snakefile, profile and src on PYTHONPATH)."""
    def archive_of(ref):
        return subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", ref], capture_output=True, timeout=120)

    archive = archive_of(PREVIOUS_MAIN)
    if archive.returncode != 0:  # a shallow clone: deepen it from its origin, then try again
        subprocess.run(["git", "-C", str(REPO), "fetch", "--quiet", "--unshallow"], capture_output=True, timeout=300)
        archive = archive_of(PREVIOUS_MAIN)
    assert archive.returncode == 0, (f"previous main {PREVIOUS_MAIN} is not in this clone (fetch it, or set "
                                     f"DFLASH_PREVIOUS_MAIN): {archive.stderr.decode()[-500:]}")
    old = tmp_path_factory.mktemp("previous-main")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(old, filter="data")
    work = tmp_path_factory.mktemp("upgrade-work")
    (work / "data").symlink_to(REPO / "data")  # relative data paths: the same params under both trees
    (work / "config.yaml").write_text(yaml.safe_dump(upgrade_config()))
    env = {**os.environ, "PYTHONPATH": str(old / "src")}
    proc = snakemake(work, snakefile=old / "Snakefile", profile=old / "profiles" / "local", env=env, timeout=1800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return work


def _snapshot(paths):
    return {str(p): (p.stat().st_mtime_ns, p.read_bytes()) for p in paths}


def test_upgrade_never_regenerates_completions(previous_main_workdir):
    work = previous_main_workdir
    completions = sorted((work / "results" / "completions").rglob("*.parquet"))
    prompt_shards = sorted((work / "results" / "prompts").rglob("*.parquet"))
    assert completions and prompt_shards
    before, prompts_before = _snapshot(completions), _snapshot(prompt_shards)

    plan = planned_jobs(snakemake(work, "-n"))
    assert "generate_completions" not in plan, plan
    # the prompts checkpoint reruns under the new code when its params changed; the DAG past it is known after
    proc = snakemake(work, "results/prompts/manifest.json")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert _snapshot(prompt_shards) == prompts_before  # identical shards are never rewritten
    plan = planned_jobs(snakemake(work, "-n"))
    assert "generate_completions" not in plan and "shard_prompts" not in plan, plan
    assert _snapshot(completions) == before
