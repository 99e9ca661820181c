"""Upgrading never regenerates completions, and a release that changes no output reruns nothing.

Two results directories are built with the reduced e2e config by earlier mains, each from git (`git archive`,
no checkout is touched) with its own Snakefile, profile and package:

- ``LAST_MAIN``, the main this code was branched from: this code plans *nothing* there (`snakemake -n`).
  A refactor keeps every rule's shell text, params and env files, and the token-shard revision
  (``contracts.TOKENIZATION_REVISION``), so no job is out of date.
- ``PREVIOUS_MAIN``, an older main from before the features/engine/trainer keys: every completion shard
  and prompt shard is kept byte- and mtime-identical. What may rerun there is the cheap part, and only where
  its inputs changed: the prompts checkpoint (new `prompts` keys; it rewrites only shards whose bytes change,
  and none do here), tokenization, training and eval (new `train`/`eval` keys). README "Upgrading" lists it.

When a release does change an output on purpose, move ``LAST_MAIN`` (tests/e2e/upgrade_run.py) to the main it
is branched from only after saying in ``LAST_MAIN_RERUNS`` which rules rerun and why. The older main's test is
tests/e2e/test_upgrade_previous.py."""

from __future__ import annotations

import pytest
from conftest import planned_jobs, snakemake
from upgrade_run import LAST_MAIN, LAST_MAIN_RERUNS, built_by

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def last_main_workdir(tmp_path_factory):
    return built_by(LAST_MAIN, tmp_path_factory)


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
