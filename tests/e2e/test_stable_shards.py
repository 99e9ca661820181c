"""Stable sharding, proved on the real workflow (issue 4, DESIGN.md §3): appending prompts to a source and
adding a new source plan `generate_completions` only for the new or changed shards (`snakemake -n` job
counts); the untouched shards and their completions keep their bytes and mtimes. Also: the prompts
checkpoint depends on the target (its tokenizer) only when `prompts.max_prompt_tokens` is set.

Runs Snakemake up to the completions on the session demo target (`target.path` = its directory), with
small generated .jsonl sources in the temp working directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import planned_jobs, snakemake

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
MANIFEST = "results/prompts/manifest.json"


def write_prompts(path: Path, start: int, stop: int, *, mode: str = "w") -> None:
    with open(path, mode, encoding="utf-8") as fh:
        for i in range(start, stop):
            fh.write(json.dumps({"question": f"What is {i} plus {i}?", "answer": f"#### {2 * i}"}) + "\n")


def completion_targets(work: Path) -> list[str]:
    manifest = json.loads((work / MANIFEST).read_text())
    return [
        f"results/completions/{name}/{s['name']}.parquet"
        for name, ds in manifest["datasets"].items()
        for s in ds["shards"]
    ]


def state(work: Path, pattern: str) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(work)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(work.glob(pattern))}


def run(work: Path, *targets: str, config: str = "config.yaml") -> None:
    proc = snakemake(
        work, *targets, configfile=work / config
    )  # targets go before --configfile (the helper puts it last)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]


def dry(work: Path, *targets: str, config: str = "config.yaml") -> dict[str, int]:
    jobs = planned_jobs(snakemake(work, "-n", *targets, configfile=work / config))
    return jobs


def test_append_and_new_source_regenerate_only_new_or_changed_shards(tmp_path, demo_target):
    """Appending prompts to a source and adding a new source regenerate only the new or changed shards.

    Slow: three workflow builds (the first, an append, a new source; about 2 min on 2 cores)."""
    work = tmp_path
    target = work / "target"  # a copy: its config.json is edited below
    shutil.copytree(demo_target, target)
    cfg = yaml.safe_load((REPO / "tests" / "e2e" / "e2e_config.yaml").read_text())
    cfg["target"] = {"path": str(target)}
    cfg["drafter"] = {"block_size": 4, "num_draft_layers": 1, "num_target_features": 2}
    cfg["generation"] = {"backend": "transformers", "max_tokens": 4, "batch_size": 8}
    # `keep`: no special-token check, so the checkpoint ignores the target until max_prompt_tokens is set
    cfg["prompts"] = {"shard_size": 8, "special_token_text": "keep"}
    write_prompts(work / "alpha.jsonl", 0, 20)  # 20 prompts -> shards of 8, 8, 4
    cfg["datasets"] = {"alpha": {"path": "alpha.jsonl"}}
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))

    # first build: prompts checkpoint, then every completion shard
    run(work, MANIFEST)
    targets = completion_targets(work)
    assert targets == [f"results/completions/alpha/0000{i}.parquet" for i in range(3)]
    assert dry(work, *targets) == {"generate_completions": 3}
    run(work, *targets)
    assert dry(work, MANIFEST, *targets) == {}
    before_prompts = state(work, "results/prompts/*/*.parquet")
    before_completions = state(work, "results/completions/*/*.parquet")

    # append 10 prompts to alpha (shard 00002 grows 4 -> 8, new 00003 of 6) and add a source beta
    write_prompts(work / "alpha.jsonl", 20, 30, mode="a")
    with open(work / "beta.jsonl", "w", encoding="utf-8") as fh:
        for i in range(5):
            fh.write(json.dumps({"prompt": f"Name a colour number {i}."}) + "\n")
        fh.write(json.dumps({"prompt": "very " * 60 + "long"}) + "\n")
    cfg["datasets"]["beta"] = {"path": "beta.jsonl"}
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))

    # the plan before the checkpoint reruns: only the checkpoint (its outputs decide the rest)
    assert dry(work, MANIFEST, *targets) == {"shard_prompts": 1}
    run(work, MANIFEST)
    targets = completion_targets(work)
    assert targets == [f"results/completions/alpha/0000{i}.parquet" for i in range(4)] + [
        "results/completions/beta/00000.parquet"
    ]
    # the dry run plans exactly the changed shard (alpha/00002) and the new ones (alpha/00003, beta/00000)
    proc = snakemake(work, "-n", *targets, configfile=work / "config.yaml")
    assert planned_jobs(proc) == {"generate_completions": 3}
    planned = {
        line.split("output:", 1)[1].split(",")[0].strip()
        for line in (proc.stdout + proc.stderr).splitlines()
        if line.strip().startswith("output:")
    }
    assert planned == {
        "results/completions/alpha/00002.parquet",
        "results/completions/alpha/00003.parquet",
        "results/completions/beta/00000.parquet",
    }
    # the full shards and their completions are byte-identical, mtimes untouched
    after_prompts = state(work, "results/prompts/*/*.parquet")
    for shard in ("results/prompts/alpha/00000.parquet", "results/prompts/alpha/00001.parquet"):
        assert after_prompts[shard] == before_prompts[shard]
    assert (
        after_prompts["results/prompts/alpha/00002.parquet"][0]
        != before_prompts["results/prompts/alpha/00002.parquet"][0]
    )
    run(work, *targets)
    after_completions = state(work, "results/completions/*/*.parquet")
    for shard in ("results/completions/alpha/00000.parquet", "results/completions/alpha/00001.parquet"):
        assert after_completions[shard] == before_completions[shard]
    assert dry(work, MANIFEST, *targets) == {}

    # max_prompt_tokens: without it (and special_token_text: keep) the checkpoint ignores the target; with it,
    # it depends on it.
    # (Snakemake reruns on a newer input only when its content changed too, so the target is edited.)
    def edit_target(note: int) -> None:
        target_cfg = target / "config.json"
        target_cfg.write_text(json.dumps({**json.loads(target_cfg.read_text()), "_edited": note}))

    edit_target(1)
    assert dry(work, MANIFEST) == {}
    cfg["prompts"]["max_prompt_tokens"] = 40
    (work / "filtered.yaml").write_text(yaml.safe_dump(cfg))
    assert dry(work, MANIFEST, config="filtered.yaml") == {"shard_prompts": 1}
    run(work, MANIFEST, config="filtered.yaml")
    manifest = json.loads((work / MANIFEST).read_text())
    assert manifest["max_prompt_tokens"] == 40 and manifest["tokenizer"] == str(target)
    assert manifest["datasets"]["beta"]["dropped"] == {"too_long": 1}
    assert manifest["datasets"]["alpha"]["dropped"] == {}
    assert dry(work, MANIFEST, config="filtered.yaml") == {}
    edit_target(2)  # a changed target re-shards when the filter uses its tokenizer
    assert dry(work, MANIFEST, config="filtered.yaml") == {"shard_prompts": 1}
