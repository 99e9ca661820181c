"""Upgrading reruns nothing: a results directory built by the previous main with the reduced e2e config
plans nothing (`snakemake -n`) under this code. The previous main's tree comes from git
(`git archive`, no checkout is touched) and builds with its own Snakefile, profile and package."""

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
PREVIOUS_MAIN = os.environ.get("DFLASH_PREVIOUS_MAIN", "9f2a889")


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
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", PREVIOUS_MAIN],
                             capture_output=True, timeout=120)
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


def test_previous_main_results_plan_nothing(previous_main_workdir):
    proc = snakemake(previous_main_workdir, "-n")
    assert planned_jobs(proc) == {}, (proc.stdout + proc.stderr)[-4000:]
