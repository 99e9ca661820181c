"""Outputs keyed by what they are built from, so two configs in one checkout never undo each other: the
demo target's directory names the settings it was built with (`demo_target_dir`), and the probe record is
per run (`probe_record_path`). Existing results directories keep their paths where those still hold what
the config asks for, so they rerun nothing (tests/e2e/test_upgrade.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

from dflash_pipeline.workflow.policy import as_json, canonical

#: Where the demo target of the default demo settings lives.
DEMO_TARGET_DIR = "resources/demo-target"
#: The shipped demo target, relative to the workflow's directory: built once by
#: `demo.build_demo_target` with the embedded config's `target.demo` settings and
#: committed, so every machine runs the default demo on the same weights.
SHIPPED_DEMO_TARGET = "data/demo-target"


def params_digest(obj) -> str:
    """First 10 hex digits of sha256 over the canonical JSON of `obj` (a path key for its parameters)."""
    return hashlib.sha256(as_json(canonical(obj)).encode("utf-8")).hexdigest()[:10]


def recorded_demo_params(target_dir: str | os.PathLike) -> Optional[dict]:
    """The `target.demo` settings a built demo target was made with, from its `demo_target.json`: the
    `params` it records, or for a target built before that key, those settings read back from its build
    facts (`vocab_size` asked = `len_tokenizer` − the two think tokens added on top). None when there is
    no readable build record."""
    path = Path(target_dir) / "demo_target.json"
    try:
        facts = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if isinstance(facts.get("params"), dict):
        return facts["params"]
    try:
        return {
            "seed": facts["seed"],
            "train_steps": facts["train_steps"],
            "hidden_size": facts["hidden_size"],
            "num_hidden_layers": facts["num_hidden_layers"],
            "vocab_size": facts["len_tokenizer"] - 2,
        }
    except (KeyError, TypeError):
        return None


def embedded_demo_settings(workflow_dir: str | os.PathLike) -> dict:
    """`target.demo` of the workflow's embedded default config (`<workflow_dir>/config/config.yaml`) with the
    schema's defaults filled: the settings whose demo target keeps `DEMO_TARGET_DIR`."""
    import yaml

    from dflash_pipeline.core.config import schema_defaults

    with open(Path(workflow_dir) / "config" / "config.yaml", encoding="utf-8") as fh:
        embedded = yaml.safe_load(fh) or {}
    return {**schema_defaults("target", "demo"), **((embedded.get("target") or {}).get("demo") or {})}


def demo_target_dir(
    demo: dict, default_demo: dict, *, root: str | os.PathLike = ".", shipped: str | os.PathLike | None = None
) -> str:
    """Directory of the demo target with the `target.demo` settings `demo` (relative to `root`, the
    working directory), so two configs never rebuild each other's target:

    * `DEMO_TARGET_DIR` when the target there was built with `demo` (a results directory of an earlier
      release keeps the target its outputs were made from);
    * `shipped` (the committed `SHIPPED_DEMO_TARGET`, as the workflow resolves it) when it was built
      with `demo`: no rule builds it;
    * `DEMO_TARGET_DIR` when there is none there yet and `demo` are the default config's settings
      `default_demo` (a checkout without the shipped target builds it);
    * else `resources/demo-target-<digest of demo>` (`params_digest`).
    """
    legacy = Path(root) / DEMO_TARGET_DIR
    recorded = recorded_demo_params(legacy) if legacy.exists() else None
    mine = canonical(demo)
    if recorded is not None and canonical(recorded) == mine:
        return DEMO_TARGET_DIR
    if shipped is not None:
        shipped_params = recorded_demo_params(Path(root) / shipped)
        if shipped_params is not None and canonical(shipped_params) == mine:
            return str(shipped)
    if not legacy.exists() and mine == canonical(default_demo):
        return DEMO_TARGET_DIR
    return f"{DEMO_TARGET_DIR}-{params_digest(demo)}"


def probe_matches(record: dict, drafter: dict) -> bool:
    """Whether a probe record's drafter decisions are those the `drafter` config section asks for: equal
    block size and depth, explicit layer ids / mask id equal and recorded as explicit, and left-null ones
    resolved by the defaults (K = `num_target_features` or `num_draft_layers` layer ids by the formula)."""
    d = record.get("drafter") or {}
    ids, src = d.get("target_layer_ids") or [], str(d.get("target_layer_ids_source", ""))
    if d.get("block_size") != drafter["block_size"] or d.get("num_draft_layers") != drafter["num_draft_layers"]:
        return False
    if drafter.get("target_layer_ids") is not None:
        if list(drafter["target_layer_ids"]) != list(ids) or not src.startswith("explicit"):
            return False
    elif src.startswith("explicit") or len(ids) != (drafter.get("num_target_features") or drafter["num_draft_layers"]):
        return False
    mask_src = str(d.get("mask_token_source", ""))
    if drafter.get("mask_token_id") is not None:
        return d.get("mask_token_id") == drafter["mask_token_id"] and mask_src.startswith("explicit")
    return not mask_src.startswith("explicit")


def probe_record_path(results: str, run: str, drafter: dict, *, root: str | os.PathLike = ".") -> str:
    """The probe record of run `run`: `<results>/probe/<run>.json`, or the shared `<results>/probe/target.json` while
    it holds this run's decisions (`probe_matches`), so an existing results directory reruns nothing."""
    legacy = Path(root) / results / "probe" / "target.json"
    try:
        record = json.loads(legacy.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        record = None
    if record is not None and probe_matches(record, drafter):
        return f"{results}/probe/target.json"
    return f"{results}/probe/{run}.json"
