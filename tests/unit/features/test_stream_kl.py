"""``train.loss: kl`` without the target: feature shards and feature servers carry the last decoder layer's
output *before* the final norm; the trainer applies the target's own final norm (read from its safetensors)
and its LM head. The teacher then equals the online path's (transformers' last ``hidden_states`` entry),
and a kl run from shards, from an hf feature server and online are the same run up to bf16 storage."""

from __future__ import annotations

import pytest
import torch
from test_features import LAYERS, TRAIN_CFG
from test_stream import FAST_FLEET, Server, _log, setup  # noqa: F401 - setup is a fixture

from dflash_pipeline.features.extract import extract_shard
from dflash_pipeline.features.hf_backend import HFExtractor
from dflash_pipeline.features.weights import load_final_norm
from dflash_pipeline.target.loading import load_target_config


def _gemma_target(root):
    """A tiny Gemma-2 target: its RMSNorm scales by ``1 + weight`` and it caps logits at 30."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(1)
    cfg = Gemma2Config(
        vocab_size=80,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        final_logit_softcapping=30.0,
    )
    model = Gemma2ForCausalLM(cfg)
    with torch.no_grad():
        model.model.norm.weight.normal_()  # not the init's zeros: 1 + w must differ from w
    model.save_pretrained(root / "gemma")
    return root / "gemma", 3


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_final_norm_of_the_carried_last_hidden_is_hf_last_hidden_state(setup, tmp_path, family):  # noqa: F811
    """norm(the pre-norm last layer output the extractor carries) == transformers' ``hidden_states[-1]``
    (the LM head's input) to fp32 rounding, for a plain RMSNorm (Qwen3) and Gemma's ``1 + weight`` one;
    the carried value itself is not it (the norm matters)."""
    target, n = (setup[0] / "target", 4) if family == "qwen3" else _gemma_target(tmp_path)
    h = HFExtractor(target, [1], num_hidden_layers=n, last_hidden=True)
    ids = torch.arange(5, 29) % 80
    ((_, _, pre),) = list(h.run([0], [ids.numpy()]))
    with torch.no_grad():
        want = h.model(ids[None], output_hidden_states=True).hidden_states[-1][0]
    norm = load_final_norm(target, load_target_config(target), dtype=torch.float32)
    assert type(norm).__name__ == type(h.model.model.norm).__name__
    got = norm(pre)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(pre, want, atol=1e-2)


@pytest.fixture(scope="module")
def kl_shards(setup):  # noqa: F811
    """The setup's token shards extracted again with the last hidden state (what the rules do for kl)."""
    root, _, tokens, _ = setup
    out = []
    for t in tokens:
        f = root / f"kl-{t.stem}.safetensors"
        extract_shard(
            t,
            f,
            target_dir=root / "target",
            target_layer_ids=LAYERS,
            hidden_size=32,
            num_hidden_layers=4,
            backend="hf",
            dtype="bfloat16",
            last_hidden=True,
        )
        out.append(f)
    return out


KL = {"loss": "kl", "kl_temperature": 1.0, "kl_ce_weight": 0.0}


def _train(setup, feats, out_dir, mode, stream=None):  # noqa: F811
    from dflash_pipeline.train import train

    root, probe, tokens, _ = setup
    return train(
        token_shards=tokens,
        feature_shards=feats if mode == "shards" else (),
        probe=probe,
        target_dir=root / "target",
        out_dir=out_dir,
        cfg=dict(TRAIN_CFG, target_features=mode, **KL),
        stream=stream,
    )


def test_kl_from_shards_and_from_a_server_equal_online(setup, kl_shards, tmp_path):  # noqa: F811
    """kl from feature shards == kl streamed from an hf server (started with --last-hidden) bit for bit
    (same batches, same bf16 bits; tolerance 0). Both equal the online kl run to bf16 storage: the online
    path feeds fp32 features and teacher, the others bf16-rounded ones (relative error ≤ 2^-9 ≈ 2e-3 per
    value; a loss averaged over tokens moves by about that), so the first and the last step's losses are held
    to 1e-2 relative (5x that bound; measured here: 4e-4 and 3e-5)."""
    from safetensors.torch import load_file

    root = setup[0]
    shards = _train(setup, kl_shards, tmp_path / "shards", "shards")
    server = Server(root / "target", tmp_path / "scratch", last_hidden=True)
    try:
        stream = _train(
            setup,
            (),
            tmp_path / "stream",
            "stream",
            stream={"endpoints": [{"base_url": server.url}], "scratch_dir": str(server.scratch), "fleet": FAST_FLEET},
        )
    finally:
        server.kill()
    online = _train(setup, (), tmp_path / "online", "online")
    ls, lt, lo = ([r["loss"] for r in _log(tmp_path / d)] for d in ("shards", "stream", "online"))
    assert shards["steps"] == stream["steps"] == online["steps"] == len(ls) > 2
    assert ls == lt
    a, b = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("shards", "stream"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    print(
        f"[figures] relative difference to online: first {abs(ls[0] - lo[0]) / lo[0]:.2e}, last {abs(ls[-1] - lo[-1]) / lo[-1]:.2e}"
    )
    assert abs(ls[0] - lo[0]) <= 1e-2 * lo[0] and abs(ls[-1] - lo[-1]) <= 1e-2 * lo[-1], (ls, lo)
    assert ls[-1] < ls[0]


def test_kl_shards_without_last_hidden_are_refused_by_name(setup, tmp_path):  # noqa: F811
    """Feature shards written without the last hidden state cannot teach kl: the error names the shard."""
    from dflash_pipeline.features import FeatureShardError

    with pytest.raises(FeatureShardError, match=r"a\.safetensors: no last_hidden tensor \(train.loss: kl"):
        _train(setup, setup[3], tmp_path, "shards")


def test_planning_no_longer_refuses_kl_with_shards_or_stream():
    from dflash_pipeline.core.config import validate_config
    from dflash_pipeline.workflow.problems import training_problems

    for mode in ("shards", "stream"):
        cfg = validate_config({"train": {"target_features": mode, "loss": "kl"}})
        assert not [p for p in training_problems(cfg) if "kl" in p], training_problems(cfg)
