"""Helpers for end-to-end tests that run real Snakemake up to the completion/token shards only, on an
already built tiny target (the session `demo_target`): first the prompts checkpoint, then the token shards
it lists as explicit targets (`--until` does not see past a checkpoint in a dry run)."""

from __future__ import annotations

from pathlib import Path

import yaml
from conftest import REPO, planned_jobs, snakemake  # noqa: F401  (re-exported)


def token_targets(workdir: Path, configfile: Path | None = None) -> list[str]:
    """Build the prompts checkpoint (if needed) and return the token shard paths it implies."""
    from dflash_pipeline.prompts import list_shards

    proc = snakemake(workdir, "results/prompts/manifest.json", configfile=configfile)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return [f"results/tokens/{d}/{s}.parquet" for d, s in list_shards(workdir / "results/prompts/manifest.json")]


def mini_config(target: Path, *, generation: dict, max_prompts: int = 6, shard_size: int = 4) -> dict:
    """A reduced config: `max_prompts` GSM8K prompts in shards of `shard_size`, the given target."""
    return {
        "run": "mini",
        "target": {"path": str(target)},
        "drafter": {"block_size": 4, "num_draft_layers": 1, "num_target_features": 2},
        "datasets": {"gsm8k": {"path": str(REPO / "data/gsm8k/train.jsonl"), "max_prompts": max_prompts}},
        "prompts": {"shard_size": shard_size},
        "generation": generation,
        "tokens": {"max_length": 160},
        "eval": {"sets": {"gsm8k": {"path": str(REPO / "data/gsm8k/test.jsonl"), "num_samples": 1}}},
    }


def write_config(workdir: Path, cfg: dict, name: str = "config.yaml") -> Path:
    path = workdir / name
    path.write_text(yaml.safe_dump(cfg))
    return path
