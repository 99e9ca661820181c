"""The drafter's rotary is the one vLLM serves: partial rotary trained, M-RoPE dropped,
and a rope vLLM cannot serve refused at planning. (Against vLLM's own ``get_rope`` on every real config:
tests/e2e/test_family_parity.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import models_dir
from transformers import Qwen3Config

from dflash_pipeline.drafter import model as M
from dflash_pipeline.drafter.rope import (
    DFlashRotaryEmbedding,
    apply_rope,
    drafter_rope_parameters,
    servable_rope_problems,
)

MODELS = models_dir()


def _drafter_cfg(family: str):
    from dflash_pipeline.target.loading import load_target_config, text_config

    tc = text_config(load_target_config(MODELS / family))
    return M.drafter_config_from_target(tc, block_size=4, num_draft_layers=1, target_layer_ids=[1], mask_token_id=0)


@pytest.mark.parametrize(
    ("family", "rotary_dim", "head_dim"),
    [
        ("Qwen3.5-27B", 64, 256),
        ("Qwen3-Next-80B-A3B-Thinking", 64, 256),
        ("MiniMax-M2.7", 64, 128),
        ("Qwen3-8B", 128, 128),
    ],
)
def test_drafter_rotates_what_vllm_rotates(family, rotary_dim, head_dim):
    cfg = _drafter_cfg(family)
    assert cfg.head_dim == head_dim and not {"mrope_section", "mrope_interleaved"} & set(cfg.rope_parameters)
    drafter = M.DFlashDrafter(cfg)
    cos, _ = drafter.rotary_emb(torch.zeros(1), torch.tensor([[3, 1000]]))
    assert cos.shape[-1] == rotary_dim == drafter.rotary_emb.rotary_dim


def test_channels_past_rotary_dim_pass_through():
    cfg = Qwen3Config(
        head_dim=16,
        hidden_size=64,
        num_attention_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    rope = DFlashRotaryEmbedding(cfg)
    x = torch.randn(1, 2, 3, 16)
    cos, sin = rope(x, torch.tensor([[5, 50, 500]]))
    y = apply_rope(x, cos, sin)
    assert rope.rotary_dim == 4 and torch.equal(y[..., 4:], x[..., 4:]) and not torch.allclose(y[..., :4], x[..., :4])


def test_mrope_is_dropped_and_legacy_type_renamed():
    r = drafter_rope_parameters(
        {
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
        },
        rope_theta=1.0,
    )
    assert r == {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    r = drafter_rope_parameters(
        {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096}, rope_theta=1e4
    )
    assert r["rope_type"] == "yarn" and "type" not in r
    assert drafter_rope_parameters(None, rope_theta=5e6, rotary_dim=64, head_dim=128)["partial_rotary_factor"] == 0.5


def test_unservable_rope_is_refused_at_planning(tmp_path):
    """A rope the drafter would train one way and vLLM serve another (dynamic NTK) is refused by the probe."""
    from dflash_pipeline.core.errors import ProbeError
    from dflash_pipeline.probe.checks import _check_drafter_config

    assert servable_rope_problems({"rope_type": "dynamic", "factor": 2.0}, 16)
    assert servable_rope_problems({"rope_type": "default", "mrope_section": [2, 3, 3]}, 16)
    assert not servable_rope_problems({"rope_type": "yarn", "factor": 4.0}, 16)
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "intermediate_size": 64,
        "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ProbeError, match="vLLM cannot serve the drafter.*dynamic"):
        _check_drafter_config(tmp_path, False, 4, 1, [1, 2], 0)
