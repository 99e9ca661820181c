"""A new tokenization revision or settings change -> token shards rerun, completions never (DESIGN.md §3);
an edit of the tokenization code that keeps the revision reruns nothing.

Real Snakemake on a tiny workdir built up to the token shards (transformers backend on the session demo
target); every assertion is on the job counts of `snakemake -n`.
"""

from __future__ import annotations

import os
import shutil

import pytest
from mini_workflow import REPO, mini_config, planned_jobs, snakemake, token_targets, write_config

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def built(tmp_path_factory, demo_target):
    work = tmp_path_factory.mktemp("rebuild-tokens")
    cfg = mini_config(demo_target, generation={"backend": "transformers", "max_tokens": 8, "batch_size": 8})
    write_config(work, cfg)
    targets = token_targets(work)
    assert len(targets) == 2, targets
    proc = snakemake(work, *targets)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert len(list((work / "results/tokens/gsm8k").glob("*.parquet"))) == 2
    return work, cfg, targets


def test_nothing_to_do(built):
    work, _, targets = built
    assert planned_jobs(snakemake(work, "-n", *targets)) == {}


def _plan_with_edited_package(work, targets, tmp_path, edit) -> dict[str, int]:
    """`snakemake -n` job counts with a copy of the package first on PYTHONPATH, ``edit(pkg_dir)`` applied."""
    pkg = tmp_path / "src" / "dflash_pipeline"
    shutil.copytree(REPO / "src" / "dflash_pipeline", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    edit(pkg)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(tmp_path / "src") + (os.pathsep + old if old else "")
    try:
        return planned_jobs(snakemake(work, "-n", *targets))
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


@pytest.mark.parametrize("module", ["tokens/shard.py", "target/chat.py"])
def test_tokenization_code_edit_keeping_the_revision_reruns_nothing(built, tmp_path, module):
    """An edit of a tokenization module that keeps ``workflow.TOKENIZATION_REVISION`` (a refactor: the
    golden test, tests/unit/tokens/test_tokenization_golden.py, proves the shard bytes stay) plans nothing."""
    work, _, targets = built

    def edit(pkg):
        assert (pkg / module).is_file()  # an edit of the module itself, not a new file beside its package
        with open(pkg / module, "a", encoding="utf-8") as fh:
            fh.write("\n# an edit of the tokenization code\n")

    assert _plan_with_edited_package(work, targets, tmp_path, edit) == {}


def test_tokenization_revision_bump_retokenizes_only(built, tmp_path):
    """A new ``TOKENIZATION_REVISION`` (the token-shard bytes changed): both token shards are planned again,
    no completion is."""
    work, _, targets = built

    def edit(pkg):
        from dflash_pipeline.workflow.policy import TOKENIZATION_REVISION

        text = (pkg / "workflow" / "policy.py").read_text(encoding="utf-8")
        line = f'TOKENIZATION_REVISION = "{TOKENIZATION_REVISION}"'
        assert line in text
        (pkg / "workflow" / "policy.py").write_text(
            text.replace(line, 'TOKENIZATION_REVISION = "bumped"'), encoding="utf-8"
        )

    jobs = _plan_with_edited_package(work, targets, tmp_path, edit)
    assert jobs.get("tokenize_completions") == 2, jobs
    assert "generate_completions" not in jobs and "shard_prompts" not in jobs and "probe_target" not in jobs


def test_tokenization_settings_change_retokenizes_only(built):
    work, cfg, targets = built
    path = write_config(work, dict(cfg, tokens={"max_length": 150, "last_turn_only": True}), "tok.yaml")
    jobs = planned_jobs(snakemake(work, "-n", *targets, configfile=path))
    assert jobs.get("tokenize_completions") == 2 and "generate_completions" not in jobs, jobs


def test_completion_stats_written_next_to_shards(built):
    import json

    work, _, _ = built
    for shard in ("00000", "00001"):
        stats = json.loads((work / f"results/completions/gsm8k/{shard}.stats.json").read_text())
        assert stats["backend"] == "transformers" and stats["prompts"] == stats["ok"] + stats["truncated"]
        assert stats["completion_tokens"] > 0 and stats["run"]["requests_per_s"] > 0
