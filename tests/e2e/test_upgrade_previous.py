"""Upgrading from an older main (:data:`upgrade_run.PREVIOUS_MAIN`, from before the features/engine/trainer keys)
never regenerates completions: every completion shard and prompt shard keeps its bytes and mtime. What may rerun
is the cheap part, and only where its inputs changed (tests/e2e/upgrade_run.py says why)."""

from __future__ import annotations

import pytest
from conftest import planned_jobs, snakemake
from upgrade_run import PREVIOUS_MAIN, built_by, snapshot

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def previous_main_workdir(tmp_path_factory):
    return built_by(PREVIOUS_MAIN, tmp_path_factory)


def test_upgrade_never_regenerates_completions(previous_main_workdir):
    work = previous_main_workdir
    completions = sorted((work / "results" / "completions").rglob("*.parquet"))
    prompt_shards = sorted((work / "results" / "prompts").rglob("*.parquet"))
    assert completions and prompt_shards
    before, prompts_before = snapshot(completions), snapshot(prompt_shards)

    plan = planned_jobs(snakemake(work, "-n"))
    assert "generate_completions" not in plan, plan
    # the prompts checkpoint reruns under the new code when its params changed; the DAG past it is known after
    proc = snakemake(work, "results/prompts/manifest.json")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert snapshot(prompt_shards) == prompts_before  # identical shards are never rewritten
    plan = planned_jobs(snakemake(work, "-n"))
    assert "generate_completions" not in plan and "shard_prompts" not in plan, plan
    assert snapshot(completions) == before
