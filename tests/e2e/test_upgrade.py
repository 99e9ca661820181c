"""Upgrading never regenerates completions, and a release that changes no output reruns nothing.

Two results directories are built with the reduced e2e config by earlier mains, each from git (`git archive`,
no checkout is touched) with its own Snakefile, profile and package:

- :data:`LAST_MAIN`, the main this code was branched from: this code plans *nothing* there (`snakemake -n`).
  A refactor keeps every rule's shell text, params and env files, and the token-shard revision
  (``contracts.TOKENIZATION_REVISION``), so no job is out of date.
- :data:`PREVIOUS_MAIN`, an older main from before the features/engine/trainer keys: every completion shard
  and prompt shard is kept byte- and mtime-identical. What may rerun there is the cheap part, and only where
  its inputs changed: the prompts checkpoint (new `prompts` keys; it rewrites only shards whose bytes change,
  and none do here), tokenization, training and eval (new `train`/`eval` keys). README "Upgrading" lists it.

When a release does change an output on purpose, move :data:`LAST_MAIN` to the main it is branched from only
after saying in :data:`LAST_MAIN_RERUNS` which rules rerun and why."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile

import pytest
import yaml
from conftest import REPO, planned_jobs, snakemake

pytestmark = pytest.mark.e2e

#: An older main, from before the features/engine/trainer keys (override: $DFLASH_PREVIOUS_MAIN).
PREVIOUS_MAIN = os.environ.get("DFLASH_PREVIOUS_MAIN", "77e52f4")
#: The main this code was branched from (override: $DFLASH_LAST_MAIN, a commit or ref).
LAST_MAIN = os.environ.get("DFLASH_LAST_MAIN", "a2580b8")
#: Rules this code reruns in a results directory of LAST_MAIN, with the reason ({} for a pure refactor).
#: Earlier releases' reruns are in CHANGELOG.md ("Reruns on upgrade").
_TOKENS_RERUN = "its inputs, the token shards, are rewritten (tokenize_completions)"
LAST_MAIN_RERUNS: dict[str, str] = {
    "tokenize_completions": "TOKENIZATION_REVISION 3b1f0c9e5a7d2e48: markup in answer text without output ids is "
    "refused (markup_without_ids), tool calls render with tools",
    "summarize_tokens": _TOKENS_RERUN,
    "plot_data_lengths": _TOKENS_RERUN,
    "train_drafter": _TOKENS_RERUN,
    "evaluate_acceptance": _TOKENS_RERUN,
    "plot_training": _TOKENS_RERUN,
    "summarize_run": _TOKENS_RERUN,
    "all": _TOKENS_RERUN,
}


def upgrade_config() -> dict:
    """The e2e config with fewer prompts and eval samples (every stage and a baseline run). Data paths stay
    relative: the workdir links ``data/`` to this repo's, so both trees resolve them the same."""
    cfg = yaml.safe_load((REPO / "tests" / "e2e" / "e2e_config.yaml").read_text())
    cfg["run"] = "upgrade"
    # a small demo target that every main builds itself (the shipped one is newer than the earlier mains)
    cfg["target"] = {
        "path": "demo",
        "demo": {"train_steps": 40, "vocab_size": 600, "hidden_size": 64, "num_hidden_layers": 6},
    }
    cfg["datasets"]["gsm8k"]["max_prompts"] = 4
    cfg["datasets"]["mt_bench"]["max_prompts"] = 2
    cfg["prompts"]["shard_size"] = 4
    cfg["eval"]["max_new_tokens"] = 4
    for s in cfg["eval"]["sets"].values():
        s["num_samples"] = 1
    return cfg


def built_by(ref: str, tmp_path_factory):
    """A workdir fully built by the main at ``ref`` (its Snakefile, profile and src on PYTHONPATH)."""

    def archive_of(ref):
        return subprocess.run(
            ["git", "-C", str(REPO), "archive", "--format=tar", ref], capture_output=True, timeout=120
        )

    archive = archive_of(ref)
    if archive.returncode != 0:  # a shallow clone: deepen it from its origin, then try again
        subprocess.run(["git", "-C", str(REPO), "fetch", "--quiet", "--unshallow"], capture_output=True, timeout=300)
        archive = archive_of(ref)
    assert archive.returncode == 0, (
        f"earlier main {ref} is not in this clone (fetch it, or set "
        f"DFLASH_PREVIOUS_MAIN / DFLASH_LAST_MAIN): {archive.stderr.decode()[-500:]}"
    )
    old = tmp_path_factory.mktemp(f"main-{ref}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(old, filter="data")
    work = tmp_path_factory.mktemp(f"upgrade-from-{ref}")
    (work / "data").symlink_to(REPO / "data")  # relative data paths: the same params under both trees
    (work / "config.yaml").write_text(yaml.safe_dump(upgrade_config()))
    env = {**os.environ, "PYTHONPATH": str(old / "src")}
    proc = snakemake(work, snakefile=old / "Snakefile", profile=old / "profiles" / "local", env=env, timeout=1800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return work


@pytest.fixture(scope="module")
def previous_main_workdir(tmp_path_factory):
    return built_by(PREVIOUS_MAIN, tmp_path_factory)


@pytest.fixture(scope="module")
def last_main_workdir(tmp_path_factory):
    return built_by(LAST_MAIN, tmp_path_factory)


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


def test_last_main_workdir_plans_nothing(last_main_workdir):
    """The done-when of a refactor: an existing results directory of the last main is up to date under this
    code (every rule: probe, prompts checkpoint, completions, tokens, train, baselines, eval, report)."""
    work = last_main_workdir
    outputs = sorted(p for p in (work / "results").rglob("*") if p.is_file())
    assert any(p.suffix == ".safetensors" for p in outputs) and any(p.name == "acceptance.json" for p in outputs)
    before = {str(p): p.stat().st_mtime_ns for p in outputs}

    proc = snakemake(work, "-n")
    plan = planned_jobs(proc)
    assert set(plan) == set(LAST_MAIN_RERUNS), (plan, (proc.stdout + proc.stderr)[-4000:])
    if not LAST_MAIN_RERUNS:  # and a real run agrees with the plan: it touches no file
        proc = snakemake(work)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        assert "Nothing to be done" in proc.stdout + proc.stderr
        assert {str(p): p.stat().st_mtime_ns for p in outputs} == before


def _data_outputs(work) -> list:
    """What a run is made of: prompt, completion and token shards, the probe record, the checkpoints' weights and
    config.json (not logs, timings, plots or the report)."""
    res = work / "results"
    found = [*res.glob("prompts/**/*.parquet"), *res.glob("completions/**/*.parquet"), *res.glob("tokens/**/*.parquet")]
    found += [*res.glob("probe/*.json"), *res.glob("checkpoints/*/final/model.safetensors")]
    found += res.glob("checkpoints/*/final/config.json")
    return sorted(found)


#: Keys the export gained for the Open Spec Config schema, derived from the rest of config.json when it is written
#: (a retrained checkpoint has them, the last main's has not): everything else keeps the last main's bytes.
OPEN_SPEC_KEYS = ("open_spec_config_version", "speculative_config")


def _comparable(path):
    """A data output's bytes; for a checkpoint's config.json its JSON without :data:`OPEN_SPEC_KEYS`; for a token
    shard its table and its ``dflash`` metadata without the drop counters (their set of reasons grew:
    ``markup_without_ids``, counted 0 here), the rest byte for byte."""
    import json

    import pyarrow.parquet as pq

    if path.name == "config.json":
        return {k: v for k, v in json.loads(path.read_text()).items() if k not in OPEN_SPEC_KEYS}
    if "tokens" in path.parts and path.suffix == ".parquet":
        meta = json.loads(pq.read_metadata(path).metadata[b"dflash"])
        dropped = {k: v for k, v in meta["counts"].pop("dropped").items() if v}  # reasons that dropped a record
        return pq.read_table(path).replace_schema_metadata(None).to_pydict(), meta, dropped
    return path.read_bytes()


def _taus(record: dict) -> dict:
    return {(d, s): v["tau"] for d, e in record["drafters"].items() for s, v in e["sets"].items()}


def test_last_main_reruns_rewrite_the_same_bytes(last_main_workdir, tmp_path):
    """The reruns LAST_MAIN_RERUNS names change where a fact lives (params, the token-shard revision, the
    report), not what is built: after running them, every shard, the probe record and every checkpoint's weights
    and config.json have the last main's bytes (token shards rewritten, training rerun), prompt and completion
    shards were never touched, and the eval's τ are the same numbers."""
    import json
    import shutil

    work = tmp_path / "work"
    shutil.copytree(last_main_workdir, work, symlinks=True)  # the plan test above keeps its own copy untouched
    data = _data_outputs(work)
    assert any(p.suffix == ".safetensors" for p in data) and any("tokens" in p.parts for p in data)
    before = {p: _comparable(p) for p in data}
    kept = {p: p.stat().st_mtime_ns for p in data if {"prompts", "completions"} & set(p.parts)}
    tau_before = _taus(json.loads((work / "results/eval/upgrade/acceptance.json").read_text()))

    proc = snakemake(work, timeout=1800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert planned_jobs(snakemake(work, "-n")) == {}
    assert _data_outputs(work) == data
    assert [str(p) for p in data if _comparable(p) != before[p]] == []
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    assert _taus(json.loads((work / "results/eval/upgrade/acceptance.json").read_text())) == tau_before
