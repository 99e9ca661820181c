"""workflow.problems: the schema's problems, then the stages' cross-field checks, one line each (no Snakemake)."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from dflash_pipeline.core.config import generation_problems, schema_default, schema_defaults, validate_config
from dflash_pipeline.workflow.problems import problems

REPO = Path(__file__).resolve().parents[3]


def gen(**kw) -> dict:
    return validate_config({"generation": kw})["generation"]


def test_generation_combinations_each_named_once():
    raw_local = gen(api="completions", client_processes=2, extra_body={"chat_template_kwargs": {"x": 1}})
    assert [p.split(":")[0] for p in generation_problems(raw_local, target_dir="t")] == [
        "generation.client_processes",
        "generation.api",
        "generation.extra_body.chat_template_kwargs",
    ]
    assert generation_problems(gen(), target_dir=None) == [
        "generation.backend: transformers needs the target directory (target.path)"
    ]
    openai = gen(
        backend="openai", api="completions", endpoints=[{"base_url": "http://u:pw@h/v1", "api_key_env": "NOPE_KEY"}]
    )
    found = generation_problems(openai, target_dir=None, environ={})
    assert "needs the target's tokenizer" in found[0]
    assert found[1].startswith("generation.endpoints[0].api_key_env: $NOPE_KEY") and "pw" not in found[1]
    assert generation_problems(openai, target_dir="t", environ={"NOPE_KEY": "k"}) == []
    assert generation_problems(gen(backend="openai"), target_dir="t")[0].startswith("generation.endpoints:")


def test_problems_schema_first_then_cross_field(tmp_path):
    assert problems({"generation": {"max_tokens": "many"}}) == [
        "`generation.max_tokens`: 'many' is not valid: expected type 'integer'"
    ]
    found = problems(
        {"datasets": {"x": {"path": str(tmp_path / "missing.jsonl")}}, "eval": {"block_size": 99}}, base_dir=REPO
    )
    assert f"datasets.x.path: {tmp_path / 'missing.jsonl'} not found" in found
    assert any(p.startswith("eval.block_size: 99 exceeds") for p in found)
    default = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert problems(default, base_dir=REPO) == []  # bundled data found through base_dir from any cwd
    unordered = {**default, "eval": {**default["eval"], "context_length_buckets": [512, 256]}}
    assert "eval.context_length_buckets: [512, 256] must be ascending token counts (bucket edges)" in problems(
        unordered, base_dir=REPO
    )
    assert problems({}) == ["datasets: no prompt source configured (see config/config.yaml for the shape)"]


def test_schema_defaults_are_read_not_restated():
    assert schema_default("generation", "api") == "chat"
    assert schema_defaults("datasets", "*")["fraction"] == 1.0
    d = schema_defaults("datasets", "*")
    d["mapping"]["x"] = "y"  # a copy
    assert schema_defaults("datasets", "*")["mapping"] == {}


def test_every_missing_vllm_environment_named_at_once(monkeypatch, tmp_path):
    """eval.engine: vllm and features.backend: vllm without a vLLM environment: both in one plan-time list."""
    monkeypatch.setenv("DFLASH_VLLM_PYTHON", str(tmp_path / "no-vllm" / "python"))
    cfg = {"train": {"target_features": "shards"}, "features": {"backend": "vllm"}, "eval": {"engine": "vllm"}}
    found = [p for p in problems(cfg, base_dir=REPO) if "vLLM" in p]
    assert [p.split(":")[0] for p in found] == ["eval.engine", "features.backend"], found
    assert all(str(tmp_path / "no-vllm" / "python") in p for p in found)
    assert found[0].endswith("or give eval.engine_base_url") and found[1].endswith("or features.backend: hf")
    # a configured environment that exists: no problem (features.vllm.python wins over $DFLASH_VLLM_PYTHON)
    cfg["features"]["vllm"] = {"python": sys.executable}
    cfg["eval"]["engine_base_url"] = "http://127.0.0.1:9/v1"
    assert [p for p in problems(cfg, base_dir=REPO) if "vLLM" in p] == []


def test_stream_and_engine_urls_carry_no_credentials_and_keys_come_by_name(monkeypatch):
    """A URL password on a stream endpoint or eval.engine_base_url would land in the job's params and argv:
    refused at plan time (redacted in the message); an endpoint's api_key_env that is not set is named."""
    monkeypatch.delenv("NOPE_STREAM_KEY", raising=False)
    cfg = {
        "train": {"target_features": "stream"},
        "features": {
            "stream": {
                "endpoints": [
                    {"base_url": "http://u:pw-secret@n1:8000/v1"},
                    {"base_url": "http://n2:8000/v1", "api_key_env": "NOPE_STREAM_KEY"},
                ]
            }
        },
        "eval": {"engine": "sglang", "engine_base_url": "http://u:pw-secret@n3:30000/v1"},
    }
    found = problems(cfg, base_dir=REPO)
    assert not any("pw-secret" in p for p in found)
    mine = [p.split(":")[0] for p in found if "user:password@" in p or "NOPE_STREAM_KEY" in p]
    assert mine == [
        "features.stream.endpoints[0].base_url",
        "eval.engine_base_url",
        "features.stream.endpoints[1].api_key_env",
    ], found
    monkeypatch.setenv("NOPE_STREAM_KEY", "k")
    cfg["features"]["stream"]["endpoints"][0]["base_url"] = "http://n1:8000/v1"
    cfg["eval"]["engine_base_url"] = "http://n3:30000/v1"
    assert not [p for p in problems(cfg, base_dir=REPO) if "base_url" in p.split(":")[0] or "api_key_env" in p]
