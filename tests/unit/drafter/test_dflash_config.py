"""DFlashConfig, the one reader and writer of a drafter checkpoint's config.json, and the block-size rules.

The golden files are the config.json bytes the code before DFlashConfig wrote (a Qwen3Config with the DFlash
attributes patched on; vLLM and SGLang load them): the class must keep writing exactly those bytes (only
``transformers_version`` follows the installed transformers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from transformers import Gemma3TextConfig, Qwen3Config

from dflash_pipeline.core.contracts import CHECKPOINT_FORMAT_VERSION
from dflash_pipeline.drafter.block_size import BlockSizeError, check_block_size, resolve_block_size
from dflash_pipeline.drafter.config import DFlashConfig, checkpoint_meta
from dflash_pipeline.target.layer_ids import hf_hidden_state_index

GOLDEN = Path(__file__).parent / "golden"


def qwen3_target():
    return Qwen3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )


def gemma3_target():
    return Gemma3TextConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=512,
    )


def golden_bytes(name: str) -> bytes:
    """The golden config.json, re-serialized as the checkpoint writer does, with this transformers' version."""
    raw = json.loads((GOLDEN / name).read_text())
    raw["transformers_version"] = transformers.__version__
    return (json.dumps(raw, indent=2, sort_keys=True) + "\n").encode()


CASES = {
    "qwen3_plain_config.json": (
        qwen3_target,
        dict(block_size=4, num_draft_layers=1, target_layer_ids=[1, 3], mask_token_id=7),
        "bfloat16",
        {"train_steps": 3, "zero_target_features": False},
    ),
    "gemma3_sliding_config.json": (
        gemma3_target,
        dict(
            block_size=8,
            num_draft_layers=3,
            target_layer_ids=[0, 2, 4],
            mask_token_id=5,
            sliding_window=32,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
        "float32",
        {"train_steps": 3, "zero_target_features": True},
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_json_bytes_are_those_the_engines_load(name, tmp_path):
    target, sizes, dtype, meta = CASES[name]
    cfg = DFlashConfig.from_target(target(), **sizes)
    path = cfg.save(tmp_path, dtype=dtype, meta=meta)
    assert path == tmp_path / "config.json" and path.read_bytes() == golden_bytes(name)
    again = DFlashConfig.from_checkpoint(tmp_path)  # read back and written again: the same bytes
    again.save(tmp_path / "again", dtype=dtype, meta=meta)
    assert (tmp_path / "again" / "config.json").read_bytes() == golden_bytes(name)


def test_dflash_fields_and_engine_layer_ids(tmp_path):
    cfg = DFlashConfig.from_target(
        qwen3_target(), block_size=4, num_draft_layers=2, target_layer_ids=[1, 3], mask_token_id=95
    )
    assert isinstance(cfg, Qwen3Config) and cfg.model_type == "qwen3" and cfg.architectures == ["DFlashDraftModel"]
    assert (cfg.block_size, cfg.num_target_layers, cfg.target_layer_ids, cfg.mask_token_id) == (4, 6, [1, 3], 95)
    assert cfg.engine_layer_ids == [hf_hidden_state_index(i) for i in (1, 3)] == [2, 4]
    cfg.save(tmp_path, dtype="bfloat16", meta={"train_steps": 12})
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 4] and raw["dtype"] == "bfloat16"
    assert checkpoint_meta(tmp_path) == {"format_version": CHECKPOINT_FORMAT_VERSION, "train_steps": 12}
    assert not hasattr(DFlashConfig.from_checkpoint(tmp_path), "dflash_pipeline")  # the block stays in the file


def test_bad_checkpoints_name_file_and_field(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json: not found"):
        DFlashConfig.from_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        checkpoint_meta(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 8}))
    with pytest.raises(ValueError, match=r"config\.json: not a DFlash drafter config"):
        DFlashConfig.from_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"block_size": 4, "dflash_config": {"target_layer_ids": [1]}}))
    with pytest.raises(ValueError, match=r"`dflash_config\.mask_token_id` is missing"):
        DFlashConfig.from_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "block_size": 4,
                "num_target_layers": "six",
                "dflash_config": {"target_layer_ids": [1], "mask_token_id": 0},
            }
        )
    )
    with pytest.raises(ValueError, match=r"config\.json: .*num_target_layers"):
        DFlashConfig.from_checkpoint(tmp_path)


def test_from_target_refuses_inconsistent_layer_types():
    with pytest.raises(ValueError, match="2 entries for 3 draft layers"):
        DFlashConfig.from_target(
            qwen3_target(),
            block_size=4,
            num_draft_layers=3,
            target_layer_ids=[1],
            mask_token_id=0,
            layer_types=["full_attention"] * 2,
        )
    with pytest.raises(ValueError, match="set drafter.sliding_window"):
        DFlashConfig.from_target(
            qwen3_target(),
            block_size=4,
            num_draft_layers=1,
            target_layer_ids=[1],
            mask_token_id=0,
            layer_types=["sliding_attention"],
        )


def test_block_size_rules_in_one_place():
    assert resolve_block_size(None, 16) == 16 and resolve_block_size(8, 16) == 8 and resolve_block_size(16, 16) == 16
    with pytest.raises(BlockSizeError, match=r"^eval\.block_size: 17 exceeds the drafter's trained block size 16"):
        resolve_block_size(17, 16)
    with pytest.raises(BlockSizeError, match=r"^eval\.block_size 1 must be >= 2"):
        resolve_block_size(1, 16)
    with pytest.raises(BlockSizeError, match=r"^drafter\.block_size 1 must be >= 2"):
        resolve_block_size(None, 1)
    assert check_block_size(2) == 2
    for bad in (1, 0, 2.5, True):
        with pytest.raises(ValueError):  # BlockSizeError is a ValueError and a ConfigError
            check_block_size(bad, key="drafter.block_size")
