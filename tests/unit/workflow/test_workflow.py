"""Rerun policy of the Snakemake layer (dflash_pipeline.workflow.policy): what a rule's params hold decides what
reruns, so these pin it without running Snakemake (tests/e2e/test_e2e.py checks the same on real runs)."""

from __future__ import annotations

from dflash_pipeline.core.config import validate_config
from dflash_pipeline.workflow.policy import (
    GENERATION_OUTPUT_KEYS,
    as_json,
    baseline_runs,
    baseline_train_flags,
    canonical,
    generation_output_params,
)


def gen(**kw) -> dict:
    return validate_config({"generation": kw})["generation"]


def test_operational_generation_keys_do_not_reach_the_params():
    base = generation_output_params(gen())
    operational = gen(
        request_timeout_s=1234,
        max_retries=2,
        batch_size=3,
        client_processes=1,
        endpoints=[{"base_url": "http://h:1/v1", "max_concurrency": 8}],
        circuit_breaker_failures=7,
    )
    assert generation_output_params(operational) == base
    assert set(base) == set(GENERATION_OUTPUT_KEYS) - {"api"}  # the default api is left out (older params)


def test_output_generation_keys_change_the_params():
    base = generation_output_params(gen())
    for change in (
        {"max_tokens": 13},
        {"temperature": 0.7},
        {"thinking": "save"},
        {"model": "m"},
        {"extra_body": {"x": 1}},
        {"seed": 1},
    ):
        assert generation_output_params(gen(**change)) != base, change
    raw = generation_output_params(gen(backend="openai", api="completions", endpoints=[{"base_url": "http://h/v1"}]))
    assert raw["api"] == "completions"


def test_canonical_sorts_keys_recursively_but_keeps_a_meaningful_top_order():
    assert repr(canonical({"b": {"y": 1, "x": [{"d": 1, "c": 2}]}, "a": 0})) == repr(
        {"a": 0, "b": {"x": [{"c": 2, "d": 1}], "y": 1}}
    )
    assert list(canonical({"second": {"z": 1, "y": 2}, "first": {}}, keep_order=True)) == ["second", "first"]
    assert list(canonical({"second": {"z": 1, "y": 2}}, keep_order=True)["second"]) == ["y", "z"]
    assert as_json({"b": 1, "a": 2}) == '{"a": 2, "b": 1}'


def test_baseline_run_names_and_flags():
    assert baseline_runs("demo", ["zero_features"]) == {"zero_features": "demo.zero_features"}
    assert baseline_train_flags("demo.zero_features") == "--zero-target-features"
    assert baseline_train_flags("demo") == "" and baseline_train_flags("v1.2") == ""
