"""One embedding convention on every path, the one vLLM serves: vLLM's DFlash
``embed_input_ids`` is the bare shared ``embed_tokens`` (Gemma's ×√H normaliser lives outside it), so
online training, the feature-shard path and the eval loop all look the table up bare."""

from __future__ import annotations

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig


def test_gemma_embedding_is_bare_on_every_path(tmp_path):
    from dflash_pipeline.features.weights import load_embed_and_head
    from dflash_pipeline.target import loading as T
    from dflash_pipeline.train.step import StepContext

    cfg = Gemma3TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    torch.manual_seed(0)
    Gemma3ForCausalLM(cfg).save_pretrained(tmp_path / "t")
    target = T.load_target(tmp_path / "t", dtype="float32")
    ids = torch.tensor([[1, 5, 63, 7]])
    raw = target.get_input_embeddings().weight[ids]
    scaled = target.get_input_embeddings()(ids)
    assert not torch.allclose(scaled, raw)  # the module's own forward scales by √H (what vLLM does not serve)
    online = StepContext(
        drafter=None, target=target, probe={}, num_anchors=1, block_size=4, gamma=None, generator=torch.Generator()
    ).embed(ids)
    shards, _ = load_embed_and_head(tmp_path / "t", tie_word_embeddings=True, dtype=torch.float32)
    for got in (online, T.input_embeddings(target)(ids), shards(ids)):  # training online, eval loop, feature shards
        assert torch.equal(got, raw)
    assert T.input_embeddings(target).weight is target.get_input_embeddings().weight


def test_plain_embedding_is_returned_as_is():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_pipeline.target import loading as T

    m = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
        )
    )
    assert T.input_embeddings(m) is m.get_input_embeddings()
