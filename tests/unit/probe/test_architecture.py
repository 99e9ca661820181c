"""Architectures the drafter cannot be built for are refused with the reason (a ``ProbeRefusal``), from
config.json alone, by the probe and at plan time; the ones that can are read as transformers builds them
(Nemotron-H's block list, MPT's ``max_seq_len``, Dory's layer count)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from dflash_pipeline.core.errors import ProbeRefusal
from dflash_pipeline.probe import probe_target
from dflash_pipeline.probe.checks import REASONS, architecture_refusal, raw_config_refusal
from dflash_pipeline.testing.zoo_extra import type_config
from dflash_pipeline.workflow.problems import probe_gate_problems, target_architecture_problems

TINY_DORY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    n_input_layers=1,
    n_output_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=8,
)


def write(tmp_path, raw: dict):
    (tmp_path / "config.json").write_text(json.dumps(raw, default=str))
    return tmp_path


def probe(path, **kw):
    return probe_target(path, block_size=4, num_draft_layers=1, mask_token_id=0, strict=False, **kw)


@pytest.mark.parametrize(
    "model_type, arch, reason, field",
    [
        ("mamba", "MambaForCausalLM", "attention-free", "no attention heads"),
        ("mamba2", "Mamba2ForCausalLM", "attention-free", "no attention heads"),  # its num_heads are SSM heads
        ("rwkv", "RwkvForCausalLM", "attention-free", "no attention heads"),
        ("xlstm", "xLSTMForCausalLM", "attention-free", "no attention heads"),
        ("recurrent_gemma", "RecurrentGemmaForCausalLM", "no context length", "max_position_embeddings"),
        ("cpmant", "CpmAntForCausalLM", "no context length", "max_position_embeddings"),
        ("gemma3n_text", "Gemma3nForCausalLM", "per-layer values", "`intermediate_size` is one value per layer"),
        ("dory", "DoryForCausalLM", "looped layers", "`n_recurrent_loops` = 2"),
        ("bart", "BartForCausalLM", "encoder-decoder", "is_encoder_decoder"),
        ("trocr", "TrOCRForCausalLM", "encoder-decoder", "decoder_layers"),
        ("xlm", "XLMWithLMHeadModel", "not a causal LM", "`causal` is false"),
        ("blt", "BltForCausalLM", "no language-model config", "patcher_config"),
    ],
)
def test_refused_with_the_reason_by_the_probe_and_at_planning(tmp_path, model_type, arch, reason, field):
    path = write(tmp_path, type_config(model_type, arch))
    with pytest.raises(ProbeRefusal) as err:
        probe(path)
    assert err.value.reason == reason and reason in REASONS
    msg = str(err.value)
    assert field in msg and str(path / "config.json") in msg and "AttributeError" not in msg
    planned = target_architecture_problems(path)  # the plan-time check gives the same refusal, one line
    assert planned == [f"target.path: the probe refuses this target ({reason}): {msg}"]


def test_refusals_that_need_the_config_class_come_from_the_probe(tmp_path):
    """LongCat-Flash's config.json states ``num_layers`` 28; only its config class knows that it builds 56
    attention sublayers (``num_hidden_layers``): the probe refuses it, the plan-time check cannot."""
    path = write(tmp_path, type_config("longcat_flash", "LongcatFlashForCausalLM"))
    with pytest.raises(ProbeRefusal, match="counts sublayers of 28 decoder layers") as err:
        probe(path)
    assert err.value.reason == "sublayer count" and target_architecture_problems(path) == []


@pytest.mark.parametrize(
    "model_type, arch, context",
    [
        ("mpt", "MptForCausalLM", 2048),
        ("gpt2", "GPT2LMHeadModel", 1024),
        ("kimi_linear", "KimiLinearForCausalLM", None),
    ],
)
def test_context_length_under_its_other_names(tmp_path, model_type, arch, context):
    """MPT's ``max_seq_len``, GPT-2's ``n_positions``, Kimi-Linear's ``model_max_length`` mean the context
    length: read as it, and the drafter states it."""
    raw = type_config(model_type, arch)
    path = write(tmp_path, raw)
    assert raw_config_refusal(path) is None
    rec = probe(path)
    assert rec["max_position_embeddings"] == (context or raw["model_max_length"])


def test_attention_heads_under_other_names_are_no_refusal():
    assert architecture_refusal(type_config("xglm", "XGLMForCausalLM")) is None  # `attention_heads`
    hybrid = type_config("falcon_h1", "FalconH1ForCausalLM")  # SSM fields and attention heads: a hybrid
    assert "mamba_d_state" in hybrid and architecture_refusal(hybrid) is None


def test_nemotron_h_as_transformers_5_saves_it(tmp_path):
    """``layers_block_type`` and no ``num_hidden_layers``: one layer per block, as transformers builds it."""
    raw = type_config("nemotron_h", "NemotronHForCausalLM")
    assert "num_hidden_layers" not in raw
    rec = probe(write(tmp_path, raw))
    assert rec["num_hidden_layers"] == len(raw["layers_block_type"]) == 4


def test_dory_reports_the_layers_transformers_builds(tmp_path):
    """Dory's config.json counts attention and MLP blocks as layers (8 here); transformers builds 4 decoder
    layers and returns 5 hidden states: the probe says 4, with a warning. With loops it is refused (above)."""
    cfg = transformers.DoryConfig(**TINY_DORY, n_recurrent_loops=1)
    raw = {**cfg.to_dict(), "architectures": ["DoryForCausalLM"]}
    assert raw["num_hidden_layers"] == 8
    rec = probe(write(tmp_path, raw))
    model = transformers.DoryForCausalLM(cfg)
    out = model(input_ids=torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    assert rec["num_hidden_layers"] == len(model.model.layers) == len(out.hidden_states) - 1 == 4
    assert any("transformers builds 4" in w for w in rec["warnings"])


def test_hand_written_config_without_a_context_length_is_left_to_the_config_class(tmp_path):
    """Only a config transformers wrote (``transformers_version``) states every field: a hand-written one
    without ``max_position_embeddings`` gets the class default, as before."""
    raw = {k: v for k, v in type_config("qwen3", "Qwen3ForCausalLM").items() if k != "max_position_embeddings"}
    assert architecture_refusal(raw) is not None and architecture_refusal(raw).reason == "no context length"
    raw.pop("transformers_version")
    assert architecture_refusal(raw) is None
    assert probe(write(tmp_path, raw))["max_position_embeddings"] == 32768  # Qwen3Config's default


def test_plan_time_gate_runs_the_config_class_checks_until_a_probe_record_accepts_the_target(tmp_path):
    """LongCat is refused at plan time by the gate (the config class's checks) while no probe record exists;
    a record newer than config.json means the probe accepted this target, and the gate reads nothing."""
    from dflash_pipeline.core.config import validate_config

    target = write(tmp_path, type_config("longcat_flash", "LongcatFlashForCausalLM"))
    cfg = validate_config({"target": {"path": str(target)}, "drafter": {"block_size": 4, "num_draft_layers": 1}})
    record = tmp_path / "probe.json"
    (found,) = probe_gate_problems(cfg, record)
    assert found.startswith("target.path: the probe refuses this target (sublayer count): ")
    record.write_text("{}")
    assert probe_gate_problems(cfg, record) == []
    (tmp_path / "qwen").mkdir()
    qwen = write(tmp_path / "qwen", type_config("qwen3", "Qwen3ForCausalLM"))
    assert probe_gate_problems({**cfg, "target": {**cfg["target"], "path": str(qwen)}}, tmp_path / "none") == []
    assert probe_gate_problems({**cfg, "target": {**cfg["target"], "path": "demo"}}, tmp_path / "none") == []


def test_plan_time_gate_answer_is_cached_by_the_config_json(tmp_path, monkeypatch):
    """Until the probe job has run, every plan asks the gate: its answer is read back from the plan cache while
    config.json and the drafter settings stay, and computed again when config.json changes; a check that fails
    otherwise than by refusing is never cached."""
    from dflash_pipeline import probe as P
    from dflash_pipeline.core.config import validate_config

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    target = write(tmp_path, type_config("longcat_flash", "LongcatFlashForCausalLM"))
    cfg = validate_config({"target": {"path": str(target)}, "drafter": {"block_size": 4, "num_draft_layers": 1}})
    none = tmp_path / "no-record"
    (refused,) = probe_gate_problems(cfg, none)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("not a refusal")

    monkeypatch.setattr(P, "check_target_config", counted)
    assert probe_gate_problems(cfg, none) == [refused] and calls == []  # read back, nothing checked
    other = dict(cfg, drafter={**cfg["drafter"], "block_size": 8})
    assert probe_gate_problems(other, none) == [] and len(calls) == 1  # other settings: checked (and failed)
    assert probe_gate_problems(other, none) == [] and len(calls) == 2  # the failure was not cached
    monkeypatch.undo()
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    write(tmp_path, type_config("qwen3", "Qwen3ForCausalLM"))  # the same directory, another config.json
    assert probe_gate_problems(cfg, none) == []
