"""One target loader for every family (dflash_pipeline.target.loading): dtype policy, remote code, class choice."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_pipeline.probe import probe_target
from dflash_pipeline.target import loading as T

CONFIG_PY = """
from transformers import Qwen3Config


class TinyRemoteConfig(Qwen3Config):
    model_type = "tiny_remote"
"""
MODELING_PY = """
from transformers import Qwen3ForCausalLM

from .configuration_tiny_remote import TinyRemoteConfig


class TinyRemoteForCausalLM(Qwen3ForCausalLM):
    config_class = TinyRemoteConfig
"""


@pytest.fixture(scope="module")
def remote_dir(tmp_path_factory):
    """A target whose model class exists only as code shipped in its directory (auto_map)."""
    d = tmp_path_factory.mktemp("remote")
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(d)
    raw = json.loads((d / "config.json").read_text())
    raw.update(
        model_type="tiny_remote",
        architectures=["TinyRemoteForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_tiny_remote.TinyRemoteConfig",
            "AutoModelForCausalLM": "modeling_tiny_remote.TinyRemoteForCausalLM",
        },
    )
    (d / "config.json").write_text(json.dumps(raw))
    (d / "configuration_tiny_remote.py").write_text(CONFIG_PY)
    (d / "modeling_tiny_remote.py").write_text(MODELING_PY)
    return d


def test_dtype_policy():
    assert T.resolve_dtype("auto", "cpu") == torch.float32 and T.resolve_dtype("auto", "cuda") == torch.bfloat16
    assert T.resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="float32"):
        T.resolve_dtype("fp8", "cpu")
    # fp32 drafter output through a bf16 head: no dtype error, float32 logits equal to the bf16 matmul
    h, w = torch.randn(3, 16), torch.randn(10, 16).to(torch.bfloat16)
    logits = T.lm_head_logits(h, w)
    assert logits.dtype == torch.float32 and torch.equal(logits, (h.to(torch.bfloat16) @ w.T).float())


def test_remote_code_target_needs_trust_remote_code(remote_dir):
    with pytest.raises(T.TargetLoadError, match="trust_remote_code"):
        T.load_target(remote_dir)
    model = T.load_target(remote_dir, trust_remote_code=True, dtype="bfloat16")
    assert type(model).__name__ == "TinyRemoteForCausalLM" and T.module_dtype(model) == torch.bfloat16
    assert not any(p.requires_grad for p in model.parameters())
    out = T.hidden_states_of(model, torch.tensor([[1, 2, 3]]))
    assert len(out.hidden_states) == T.num_decoder_layers(model) + 1 == 5


def test_probe_refuses_an_unloadable_target_at_plan_time(remote_dir):
    """The reason is in the probe record (CLI) and in the error (the pipeline rule), not at training step 1."""
    rec = probe_target(remote_dir, block_size=4, num_draft_layers=1, target_layer_ids=[1, 2], strict=False)
    assert rec["target_loader"]["class"] is None and "trust_remote_code" in rec["target_loader"]["error"]
    assert any("cannot be loaded" in w for w in rec["warnings"])
    ok = probe_target(
        remote_dir, block_size=4, num_draft_layers=1, target_layer_ids=[1, 2], strict=False, trust_remote_code=True
    )
    assert ok["target_loader"]["class"] == "AutoModelForCausalLM" and ok["target_loader"]["error"] is None


def test_template_messages_keep_tool_calls_and_tool_results():
    """Assistant ``tool_calls`` (JSON text or list; arguments parsed into objects) and a tool result's
    ``tool_call_id``/``name`` reach the template; records without them render as before."""
    from dflash_pipeline.target.chat import template_messages, tool_calls_of, tools_of

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    msgs = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "reasoning_content": None, "tool_calls": json.dumps([call])},
        {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f", "reasoning_content": None},
        {"role": "assistant", "content": "done", "tool_calls": None},
    ]
    got = template_messages(msgs)
    assert got[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
    }
    assert got[2] == {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"}
    assert got[3] == {"role": "assistant", "content": "done"}
    assert tool_calls_of({"tool_calls": [{"function": {"name": "g", "arguments": "not json"}}]}) == [
        {"type": "function", "function": {"name": "g", "arguments": "not json"}}
    ]
    with pytest.raises(ValueError, match=r"tool_calls\[0\]"):
        tool_calls_of({"tool_calls": [{"name": "g"}]})
    assert tools_of(None) is None and tools_of('[{"type": "function"}]') == [{"type": "function"}]
