"""Issue #23 training-side defects, each reproduced: held-out validation on feature shards in full
precision (3), shards training of a kimi_k2 target without remote code (4), the kl teacher capped like
the target (6)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import models_dir, tiny_target_and_drafter

MODELS = models_dir()


def test_heldout_validation_on_bf16_shard_features_with_fp32_drafter():
    """Feature shards give bf16 features; with ``mixed_precision: "no"`` the drafter is fp32. The held-out
    pass casts as the training step does (to the drafter's dtype) instead of crashing on mixed dtypes."""
    from dflash_pipeline.target import loading as T
    from dflash_pipeline.target.hidden import target_features
    from dflash_pipeline.train import heldout as V

    target, drafter = tiny_target_and_drafter(num_hidden_layers=4, num_draft_layers=1, target_layer_ids=[1, 2])
    ids = torch.randint(0, 90, (2, 24), generator=torch.Generator().manual_seed(0))
    batch = {
        "input_ids": ids,
        "loss_mask": torch.ones_like(ids, dtype=torch.uint8),
        "attention_mask": torch.ones_like(ids),
    }
    feats, _ = target_features(target, ids, batch["attention_mask"], [1, 2])
    kw = {"target_layer_ids": [1, 2], "mask_token_id": 95, "num_anchors": 4}
    counts = V.batch_acceptance(
        drafter, None, T.input_embeddings(target), T.lm_head(target), batch, features=feats.to(torch.bfloat16), **kw
    )
    ref = V.batch_acceptance(
        drafter,
        None,
        T.input_embeddings(target),
        T.lm_head(target),
        batch,
        features=feats.to(torch.bfloat16).float(),
        **kw,
    )
    assert float(counts.blocks) == 8 and torch.equal(counts.chain, ref.chain)


def test_shards_training_data_reads_kimi_k2_config_without_remote_code(tmp_path):
    """``open_training_data`` (shards) reads the target config through the target loader, so a kimi_k2
    config (custom code in ``auto_map``, no ``trust_remote_code``) opens via its native architecture."""
    from safetensors.torch import save_file

    from dflash_pipeline.features.format import FeatureLayout, FeatureShardWriter
    from dflash_pipeline.train.data import open_training_data

    raw = json.loads((MODELS / "Kimi-K2-Instruct" / "config.json").read_text())
    assert raw["model_type"] == "kimi_k2" and raw.get("auto_map")
    raw.update(hidden_size=16, vocab_size=80, num_hidden_layers=4)
    raw.pop("quantization_config", None)
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(raw))
    g = torch.Generator().manual_seed(0)
    save_file(
        {
            "model.embed_tokens.weight": torch.randn(80, 16, generator=g),
            "lm_head.weight": torch.randn(80, 16, generator=g),
        },
        str(tmp_path / "target" / "model.safetensors"),
    )
    tok = _token_shard(tmp_path / "a.parquet", 6)
    from dflash_pipeline.core.contracts import FEATURE_SCHEMA_VERSION
    from dflash_pipeline.features.extract import read_token_arrays
    from dflash_pipeline.features.format import sha256_file

    ids, mask, lengths = read_token_arrays(tok)
    meta = {
        "schema_version": FEATURE_SCHEMA_VERSION,
        "token_shard": tok.name,
        "token_shard_sha256": sha256_file(tok),
        "num_records": len(lengths),
        "num_tokens": int(lengths.sum()),
        "target_layer_ids": [1, 2],
        "hidden_size": 16,
        "dtype": "bfloat16",
        "last_hidden": False,
        "backend": "test",
    }
    w = FeatureShardWriter(
        tmp_path / "a.safetensors", FeatureLayout(lengths, 2, 16, "bfloat16", False, meta), ids, mask
    )
    for r in range(len(lengths)):
        w.write(r, torch.randn(int(lengths[r]), 32, generator=g))
    w.commit(len(lengths))
    w.finish()
    probe = {
        "hidden_size": 16,
        "tie_word_embeddings": False,
        "trust_remote_code": False,
        "drafter": {"target_layer_ids": [1, 2]},
    }
    data = open_training_data(
        {"target_features": "shards"},
        [tok],
        [tmp_path / "a.safetensors"],
        target_dir=tmp_path / "target",
        out_dir=tmp_path / "run",
        probe=probe,
        device="cpu",
        target_dtype="float32",
    )
    assert data.from_shards and type(data.target_config).__name__ == "DeepseekV3Config"
    assert data.target_config.hidden_size == 16 and data.embed.weight.shape == (80, 16)


def _token_shard(path: Path, n: int) -> Path:
    from dflash_pipeline.core.contracts import TOKEN_SCHEMA
    from dflash_pipeline.core.shards import table_from_records, write_parquet

    recs = [
        {
            "prompt_id": f"p{i}",
            "input_ids": [(i + j) % 78 for j in range(20 + i)],
            "loss_mask": [0] * 10 + [1] * (10 + i),
            "num_tokens": 20 + i,
            "num_loss_tokens": 10 + i,
            "truncated": False,
            "turn": 0,
        }
        for i in range(n)
    ]
    write_parquet(path, table_from_records(recs, TOKEN_SCHEMA))
    return path


def test_kl_teacher_is_capped_like_the_target():
    """gemma's ``final_logit_softcapping`` (30): the teacher's logits are c·tanh(z/c) as the target's are;
    uncapped they reach ~150 here and the KL is far larger (inf in bf16 on real targets)."""
    from dflash_pipeline.train import losses as L

    g = torch.Generator().manual_seed(0)
    w = torch.randn(50, 8, generator=g) * 20.0
    hidden, teacher = torch.randn(1, 4, 8, generator=g), torch.randn(1, 4, 8, generator=g)
    labels, weights = torch.randint(0, 50, (1, 4), generator=g), torch.ones(1, 4)
    assert float((teacher @ w.T).abs().max()) > 100
    capped = L.kl(hidden, w, labels, weights, teacher, logit_softcap=30.0)
    z_t = torch.tanh((teacher @ w.T) / 30.0) * 30.0
    ref = (torch.softmax(z_t, -1) * (torch.log_softmax(z_t, -1) - torch.log_softmax(hidden @ w.T, -1))).sum()
    assert math.isfinite(float(capped.total)) and torch.allclose(capped.total, ref, rtol=1e-4)
    uncapped = L.kl(hidden, w, labels, weights, teacher)
    assert not torch.allclose(uncapped.total, capped.total, rtol=1e-2)


def test_step_context_reads_the_targets_softcap():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from dflash_pipeline.train.step import StepContext

    cfg = Gemma3TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=30.0,
    )
    ctx = StepContext(
        drafter=None,
        target=Gemma3ForCausalLM(cfg),
        probe={},
        num_anchors=1,
        block_size=4,
        gamma=None,
        generator=torch.Generator(),
        loss="kl",
    )
    assert ctx.logit_softcap == 30.0


@pytest.mark.parametrize("cap", [None, 30.0])
def test_compute_loss_passes_the_cap(cap):
    from dflash_pipeline.train import losses as L

    g = torch.Generator().manual_seed(1)
    w = torch.randn(20, 8, generator=g) * 30.0
    h, t = torch.randn(1, 4, 8, generator=g), torch.randn(1, 4, 8, generator=g)
    y, wt = torch.randint(0, 20, (1, 4), generator=g), torch.ones(1, 4)
    a = L.compute_loss("kl", h, w, y, wt, 4, teacher_hidden=t, logit_softcap=cap)
    b = L.kl(h, w, y, wt, t, logit_softcap=cap)
    assert torch.equal(a.total, b.total)


def test_kl_step_caps_the_teacher_with_the_contexts_softcap():
    """step_objective hands ``ctx.logit_softcap`` to the loss: the same kl step differs with a cap of 1 (every
    teacher logit squeezed into (-1, 1)) and equals itself without one (a merge once dropped the argument)."""
    from dflash_pipeline.train.step import StepContext, step_objective

    target, drafter = tiny_target_and_drafter(num_hidden_layers=6, num_draft_layers=1, target_layer_ids=[1, 3])
    batch = {
        "input_ids": torch.randint(0, 90, (2, 16), generator=torch.Generator().manual_seed(0)),
        "loss_mask": torch.ones(2, 16, dtype=torch.uint8),
        "attention_mask": torch.ones(2, 16, dtype=torch.long),
    }
    probe = {"drafter": {"target_layer_ids": drafter.target_layer_ids, "mask_token_id": 95}}

    def loss(cap):
        ctx = StepContext(
            drafter=drafter,
            target=target,
            probe=probe,
            num_anchors=4,
            block_size=4,
            gamma=None,
            generator=torch.Generator().manual_seed(0),
            loss="kl",
            logit_softcap=cap,
        )
        with torch.no_grad():
            return step_objective(ctx, batch).total

    assert torch.equal(loss(None), loss(None))
    assert not torch.allclose(loss(None), loss(1.0), rtol=1e-3)
