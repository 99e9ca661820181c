"""Config errors: every schema problem on one line with its key path (and a close-match hint for a typo),
both from the library (validate_config) and from `snakemake -n` (the Snakefile), plus plan-time checks."""

from __future__ import annotations

import pytest
import yaml
from conftest import REPO, snakemake

from dflash_pipeline.core.config import coerce_cli_strings, schema_problems, validate_config
from dflash_pipeline.core.errors import ConfigError


def test_schema_problems_lists_every_error_with_its_key():
    problems = schema_problems(
        {
            "token": {"max_length": 100},
            "datasets": {"d": {"path": "x.jsonl", "max_prompt": 3}},
            "generation": {"temperature": "hot", "thinking": "maybe"},
            "tokens": {"max_length": -5},
        }
    )
    assert problems == [
        "`datasets.d.max_prompt`: unknown key (did you mean `max_prompts`?)",
        "`generation.temperature`: 'hot' is not valid: expected type 'number'",
        "`generation.thinking`: 'maybe' is not valid: expected one of ['none', 'save', 'disable']",
        "`token`: unknown key (did you mean `tokens`?)",
        "`tokens.max_length`: -5 is not valid: expected >= 8",
    ]
    assert schema_problems({}) == []
    (leak,) = schema_problems({"generation": {"endpoints": {"base_url": "http://user:sk-secret@host/v1"}}})
    assert "sk-secret" not in leak and "http://host/v1" in leak  # a URL's credentials never reach a message
    with pytest.raises(ConfigError, match=r"`token`: unknown key.*`tokens.max_length`: -5"):
        validate_config({"token": {}, "tokens": {"max_length": -5}})


def test_nested_cli_strings_take_their_schema_types():
    """Snakemake reads nested --config values with YAML's BaseLoader (every scalar a string): they take the
    type their field asks for; a field that allows a string, or a string that spells no number, is left."""
    cfg = {
        "run": "2024",  # a string field: stays
        "drafter": {"block_size": "4", "target_layer_ids": ["1", "3"], "num_target_features": "null"},
        "generation": {"temperature": "0.5", "max_tokens": "many"},
        "train": {"packing": "true", "epochs": 2},
    }
    assert coerce_cli_strings(cfg) is cfg
    assert cfg == {
        "run": "2024",
        "drafter": {"block_size": 4, "target_layer_ids": [1, 3], "num_target_features": None},
        "generation": {"temperature": 0.5, "max_tokens": "many"},  # still refused by the schema, by name
        "train": {"packing": True, "epochs": 2},
    }


def test_snakemake_plan_takes_numbers_in_nested_config_overrides(tmp_path):
    proc = snakemake(
        tmp_path,
        "-n",
        "--config",
        "run=demo-b",
        "drafter={block_size: 4, target_layer_ids: [1, 3]}",
        configfile=REPO / "config" / "config.yaml",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "train_drafter" in out and "expected type" not in out


def test_snakemake_plan_reports_config_problems_in_a_few_lines(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"token": {"max_length": 100}, "generation": {"max_tokens": "many"}}))
    proc = snakemake(tmp_path, "-n", configfile=bad)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "`token`: unknown key (did you mean `tokens`?)" in out
    assert "`generation.max_tokens`: 'many' is not valid: expected type 'integer'" in out
    assert len(out.splitlines()) < 40, out  # not the whole schema

    missing = tmp_path / "missing.yaml"
    missing.write_text(
        yaml.safe_dump({"target": {"path": "demo", "chat_template": str(tmp_path / "nope.jinja")}, "datasets": {}})
    )
    proc = snakemake(tmp_path, "-n", "--replace-workflow-config", configfile=missing)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"target.chat_template: {tmp_path / 'nope.jinja'} not found" in out
    assert "datasets: no prompt source configured" in out


def test_snakemake_plan_rejects_a_target_without_tokenizer_files(tmp_path):
    """A model directory with config.json and a template but no vocabulary (as the shared model configs):
    the tokens stage could never run, so the plan fails naming what is missing."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"model_type": "qwen3"}')
    (target / "chat_template.jinja").write_text("{{ messages }}")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"target": {"path": str(target)}}))
    proc = snakemake(tmp_path, "-n", configfile=cfg)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "target.path: no tokenizer files (tokenizer.json" in out and "need the target's tokenizer" in out


def test_snakemake_plan_rejects_a_transformers_target_without_weights(tmp_path):
    """Issue #18: `generation.backend: transformers` with a target directory that has config and tokenizer
    but no weights fails at plan time (not at runtime); the openai backend does not need them to generate."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"model_type": "qwen3"}')
    (target / "tokenizer.json").write_text("{}")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"target": {"path": str(target)}, "generation": {"backend": "transformers"}}))
    out = (lambda p: p.stdout + p.stderr)(proc := snakemake(tmp_path, "-n", configfile=cfg))
    assert proc.returncode != 0 and f"target.path: no weights (*.safetensors, pytorch_model*.bin) in {target}" in out
    server = tmp_path / "s.yaml"
    server.write_text(
        yaml.safe_dump(
            {
                "target": {"path": str(target)},
                "generation": {"backend": "openai", "endpoints": [{"base_url": "http://127.0.0.1:9/v1"}]},
            }
        )
    )
    assert "no weights" not in (lambda p: p.stdout + p.stderr)(snakemake(tmp_path, "-n", configfile=server))
    (target / "model.safetensors").write_bytes(b"")
    assert "no weights" not in (lambda p: p.stdout + p.stderr)(snakemake(tmp_path, "-n", configfile=cfg))


@pytest.mark.parametrize("name", [".", "..", "...", ".hidden", "a/b", "a\\b", "", "x" * 129, "a b"])
def test_run_and_dataset_names_are_path_safe_tokens(name):
    """Run and dataset names become directories under results/: `.`, `..`, separators and the like are
    refused by the schema (outputs left the per-run directories before)."""
    assert any(p.startswith("`run`") for p in schema_problems({"run": name})), name
    assert schema_problems({"datasets": {name: {"path": "x.jsonl"}}}), name


@pytest.mark.parametrize("name", ["demo", "qwen3-8b_v1.2", "a..b", "run-"])
def test_path_safe_run_names_pass(name):
    assert schema_problems({"run": name}) == []


def test_stream_endpoints_take_an_api_key_env_by_name():
    ok = {"features": {"stream": {"endpoints": [{"base_url": "http://n:8000/v1", "api_key_env": "MY_KEY"}]}}}
    assert schema_problems(ok) == []
    bad = {"features": {"stream": {"endpoints": [{"base_url": "http://n:8000/v1", "api_key_env": "sk-abc 123"}]}}}
    assert any("api_key_env" in p for p in schema_problems(bad))


@pytest.mark.parametrize(
    "url,want",
    [
        ("http://user:pw@host:8000/v1", "http://host:8000/v1"),
        ("http://user:p@ss@host/v1", "http://host/v1"),  # a password holding @ goes whole
        ("https://tok@host", "https://host"),
        ("http://host:8000/v1?x=a@b", "http://host:8000/v1?x=a@b"),  # no credentials: unchanged
        ("see http://u:s3cret@h/v1 and 'http://a:b@c'", "see http://h/v1 and 'http://c'"),
    ],
)
def test_one_redaction_for_every_url(url, want):
    from dflash_pipeline.completions import redact_url
    from dflash_pipeline.core.errors import strip_url_credentials
    from dflash_pipeline.evaluate.engine_acceptance import _no_acceptance

    assert strip_url_credentials(url) == want
    assert redact_url(url) == want
    if url.startswith("http://user"):
        assert "pw" not in str(_no_acceptance(url, url + "/metrics"))
