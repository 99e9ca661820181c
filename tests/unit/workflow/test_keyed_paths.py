"""Outputs keyed by what they are built from: the demo target's directory and the probe record's
path (dflash_pipeline.workflow.keyed_paths). The Snakemake-level check (two configs in one checkout, then the
default plans nothing) is tests/e2e/test_e2e.py::test_second_config_never_rebuilds_the_first."""

from __future__ import annotations

import json

from dflash_pipeline.workflow.keyed_paths import (
    DEMO_TARGET_DIR,
    SHIPPED_DEMO_TARGET,
    demo_target_dir,
    embedded_demo_settings,
    params_digest,
    probe_matches,
    probe_record_path,
    recorded_demo_params,
)

DEFAULT = {"seed": 0, "vocab_size": 1024, "hidden_size": 128, "num_hidden_layers": 8, "train_steps": 600}


def _built(root, params, *, legacy_facts=False, where=DEMO_TARGET_DIR):
    d = root / where
    d.mkdir(parents=True)
    facts = {
        "seed": params["seed"],
        "train_steps": params["train_steps"],
        "hidden_size": params["hidden_size"],
        "num_hidden_layers": params["num_hidden_layers"],
        "len_tokenizer": params["vocab_size"] + 2,
        "vocab_size": 1088,
    }
    if not legacy_facts:
        facts["params"] = params
    (d / "demo_target.json").write_text(json.dumps(facts))


def test_default_settings_keep_todays_path_and_others_get_their_digest(tmp_path):
    from conftest import REPO

    assert embedded_demo_settings(REPO) == DEFAULT  # config/config.yaml's settings over the schema defaults
    assert demo_target_dir(DEFAULT, DEFAULT, root=tmp_path) == DEMO_TARGET_DIR
    other = {**DEFAULT, "train_steps": 400}
    assert demo_target_dir(other, DEFAULT, root=tmp_path) == f"{DEMO_TARGET_DIR}-{params_digest(other)}"
    assert params_digest(other) != params_digest(DEFAULT)
    assert params_digest(dict(reversed(list(other.items())))) == params_digest(other)  # key order is no setting


def test_an_existing_target_keeps_its_path_for_its_settings_only(tmp_path):
    e2e = {"seed": 0, "vocab_size": 600, "hidden_size": 64, "num_hidden_layers": 6, "train_steps": 150}
    _built(tmp_path, e2e, legacy_facts=True)  # built by an earlier release: no `params` in its facts
    assert recorded_demo_params(tmp_path / DEMO_TARGET_DIR) == e2e
    assert demo_target_dir(e2e, DEFAULT, root=tmp_path) == DEMO_TARGET_DIR  # an old results dir reruns nothing
    # the default settings no longer own today's path: they never rebuild the other config's target in place
    assert demo_target_dir(DEFAULT, DEFAULT, root=tmp_path) == f"{DEMO_TARGET_DIR}-{params_digest(DEFAULT)}"


def test_the_shipped_target_serves_its_settings_unless_a_results_dir_holds_its_own(tmp_path):
    from conftest import REPO

    # the committed target was built with the embedded config's settings, and records them
    assert recorded_demo_params(REPO / SHIPPED_DEMO_TARGET) == DEFAULT
    shipped = tmp_path / "checkout" / SHIPPED_DEMO_TARGET
    _built(tmp_path, DEFAULT, where="checkout/" + SHIPPED_DEMO_TARGET)
    work = tmp_path / "work"
    work.mkdir()
    assert demo_target_dir(DEFAULT, DEFAULT, root=work, shipped=shipped) == str(shipped)  # a fresh dir builds nothing
    other = {**DEFAULT, "train_steps": 400}
    assert demo_target_dir(other, DEFAULT, root=work, shipped=shipped) == f"{DEMO_TARGET_DIR}-{params_digest(other)}"
    # a results dir of an earlier release keeps the target its completions were made from
    _built(work, DEFAULT)
    assert demo_target_dir(DEFAULT, DEFAULT, root=work, shipped=shipped) == DEMO_TARGET_DIR


def test_probe_record_is_per_run_unless_an_old_shared_one_holds_the_same_decisions(tmp_path):
    drafter = {
        "block_size": 8,
        "num_draft_layers": 2,
        "num_target_features": 3,
        "target_layer_ids": None,
        "mask_token_id": None,
    }
    assert probe_record_path("results", "demo", drafter, root=tmp_path) == "results/probe/demo.json"
    legacy = tmp_path / "results" / "probe" / "target.json"
    legacy.parent.mkdir(parents=True)
    record = {
        "drafter": {
            "block_size": 8,
            "num_draft_layers": 2,
            "num_target_features": 3,
            "target_layer_ids": [1, 4, 6],
            "target_layer_ids_source": "reference formula (N=8, K=3)",
            "mask_token_id": 1026,
            "mask_token_source": "first embedding row past the real tokens",
        }
    }
    legacy.write_text(json.dumps(record))
    assert probe_record_path("results", "demo", drafter, root=tmp_path) == "results/probe/target.json"
    for change in (
        {"block_size": 4},
        {"num_target_features": 2},
        {"target_layer_ids": [1, 4, 6]},
        {"mask_token_id": 1026},
    ):
        assert not probe_matches(record, {**drafter, **change}), change
        assert probe_record_path("results", "other", {**drafter, **change}, root=tmp_path) == "results/probe/other.json"
    explicit = {"drafter": {**record["drafter"], "target_layer_ids_source": "explicit (drafter.target_layer_ids)"}}
    assert probe_matches(explicit, {**drafter, "target_layer_ids": [1, 4, 6]})


def test_the_default_config_plans_no_demo_target_build(tmp_path):
    """The default config in a fresh working directory: the plan reads the shipped target and builds none,
    and `git ls-files` holds it (a fresh clone has it)."""
    import subprocess

    from conftest import REPO, planned_jobs, snakemake

    proc = snakemake(tmp_path, "-n", configfile=REPO / "config" / "config.yaml")
    jobs = planned_jobs(proc)
    assert "build_demo_target" not in jobs and jobs["probe_target"] == 1, jobs
    assert f"input: {REPO / SHIPPED_DEMO_TARGET}" in proc.stdout + proc.stderr
    tracked = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", SHIPPED_DEMO_TARGET], capture_output=True, text=True, check=True
    ).stdout.split()
    assert {f"{SHIPPED_DEMO_TARGET}/{f}" for f in ("model.safetensors", "tokenizer.json", "config.json")} <= set(
        tracked
    )
