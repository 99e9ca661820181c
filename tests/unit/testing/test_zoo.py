"""Every production family trains and evaluates, fp32 and bf16 (issue 14).

One tiny random-weight twin per ``config.json`` of the model metadata corpus (``conftest.models_dir()``),
built once per session by :mod:`dflash_pipeline.testing.zoo`. Per family and dtype, the DFlash method
invariants already proven for the demo target (tests/unit/drafter/test_model.py, test_evaluate.py):

* the training forward's block logits equal the inference draft's for the same context;
* the speculative loop's output equals the target's greedy output, with rejections at every step (random
  drafter) and with partial / full acceptances (a noisy oracle), across sliding windows (prompts are longer
  than ``zoo_shrink.SLIDING_WINDOW``) and linear-attention layers (cache policy ``crop`` where transformers
  records their recurrent states, ≥ 5.25, else ``recompute``);
* one real training step with the target in that dtype, through ``Accelerator(cpu=True,
  mixed_precision=bf16|no)``, gives a finite loss and a gradient on every drafter parameter.

The Kimi-K2.5 twin (``kimi_k25``: nested ``text_config``, MLA + MoE, a vision tower beside it) also runs the
in-process stages end to end: completions (transformers backend), tokens (its template), train fp32 and
bf16, eval τ.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import GSM8K_TRAIN, REPO_ROOT, models_dir

from dflash_pipeline.drafter import model as M
from dflash_pipeline.evaluate.acceptance import speculative_generate
from dflash_pipeline.target import loading as T
from dflash_pipeline.target.chat import load_tokenizer, render
from dflash_pipeline.testing import zoo, zoo_shrink
from dflash_pipeline.train.run import StepContext, build_drafter, make_accelerator, target_features, training_step

MODELS = models_dir()
FAMILIES = zoo.families(MODELS) if MODELS is not None else []
B = 4
NEW_TOKENS = 10
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@pytest.fixture(scope="session")
def twin(tmp_path_factory, real_models_dir):
    """``twin(family) -> Path``: the family's twin, built on first use and cached for the session."""
    root = tmp_path_factory.mktemp("zoo")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = zoo.build_twin(real_models_dir, family, root / family, corpus_file=GSM8K_TRAIN)
        return built[family]

    return get


def _prompt(tok) -> list[int]:
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. How many in all?"},
    ]
    ids = render(tok, msgs, thinking="none", add_generation_prompt=True, tokenize=True)
    assert len(ids) > 2 * zoo_shrink.SLIDING_WINDOW  # the sliding windows are crossed
    return ids


def _greedy(target, prompt: list[int], n: int) -> list[int]:
    """The target's greedy continuation, recomputed from scratch at every token (no cache at all)."""
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(target(input_ids=ids, use_cache=False).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


class NoisyOracle(torch.nn.Module):
    """Drafts the target's greedy continuation, wrong at a few slots: acceptance lengths 1..B."""

    def __init__(self, drafter, greedy: list[int], prompt_len: int, vocab: int):
        super().__init__()
        self.block_size, self.target_layer_ids, self.layers = (
            drafter.block_size,
            drafter.target_layer_ids,
            drafter.layers,
        )
        self.greedy, self.prompt_len, self.vocab = greedy, prompt_len, vocab
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def draft_block(self, embed, head, bonus, new_context, start, cache, block_size):
        done = start - self.prompt_len + 1  # generated tokens committed through the bonus token
        logits = torch.zeros((1, block_size, self.vocab))
        for k in range(1, block_size):
            i = done + k - 1
            t = self.greedy[i] if i < len(self.greedy) else 0
            if (start * 7 + k * 3) % 5 == 0:  # a wrong draft: the rest of the block is rejected
                t = (t + 1) % self.vocab
            logits[0, k, t] = 1.0
        return logits


def _records_recurrent_states() -> bool:
    """Whether this transformers' cache can record linear layers' recurrent states for a rollback."""
    from transformers import DynamicCache

    from dflash_pipeline.evaluate.speculative import recurrent_rollback_kwargs

    return bool(recurrent_rollback_kwargs(DynamicCache().activate_past_recording, 1))


def _target_and_drafter(path, dtype):
    """``(target, tokenizer, probe, drafter)`` of the twin at ``path``: the target in ``dtype`` and a one-layer
    float32 drafter (master weights, as in training) on layers 1 and L - 2, mask id one past the vocabulary."""
    target = T.load_target(path, dtype=dtype)
    tok = load_tokenizer(path)
    probe = {
        "drafter": {
            "block_size": B,
            "num_draft_layers": 1,
            "target_layer_ids": [1, T.num_decoder_layers(target) - 2],
            "mask_token_id": len(tok),
        }
    }
    return target, tok, probe, build_drafter(target, probe).eval()


def test_recompute_policy_still_equals_greedy(twin, monkeypatch):
    """The snapshot + recompute rollback (transformers releases whose linear-attention layers cannot be
    cropped) on the Qwen3.5 twin, forced by making those layers report themselves not croppable: the
    speculative output still equals the target's greedy output, with rejections at every step."""
    from transformers import cache_utils

    monkeypatch.setattr(cache_utils.LinearAttentionCacheLayerMixin, "is_croppable", False)
    target, tok, _, drafter = _target_and_drafter(twin("Qwen3.5-27B"), "float32")
    prompt = _prompt(tok)
    greedy = _greedy(target, prompt, NEW_TOKENS)
    head = T.lm_head(target)
    for d in (drafter, NoisyOracle(drafter, greedy, len(prompt), head.weight.shape[0])):
        res = speculative_generate(target, d, prompt, block_size=B, max_new_tokens=NEW_TOKENS)
        assert res.cache_policy == "recompute" and res.output_ids == greedy, type(d).__name__


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_family_invariants(family, dtype, twin):
    target, tok, probe, drafter = _target_and_drafter(twin(family), DTYPES[dtype])
    embed, head = T.input_embeddings(target), T.lm_head(target)
    prompt = _prompt(tok)

    # 1. training logits == inference logits (fp32 drafter fed the target's features in its dtype)
    ids = torch.tensor([prompt[:24]])
    feats, _ = target_features(target, ids, None, drafter.target_layer_ids)
    assert feats.dtype == T.module_dtype(target)
    anchors = M.AnchorBatch(torch.tensor([[0, 9, 10, 17]]), torch.ones(1, 4, dtype=torch.bool))
    blk, pos, _, _ = M.block_inputs_and_labels(ids, torch.ones_like(ids), anchors, B, drafter.mask_token_id, None)
    with torch.no_grad():
        noise, f32 = T.to_drafter_dtype(drafter, embed(blk), feats)
        hidden = drafter(
            noise, f32, torch.arange(24).view(1, -1), pos, attn_mask=M.build_block_mask(anchors.anchors, 24, B)
        )
        train_logits = T.lm_head_logits(hidden, head.weight).view(1, 4, B, -1)
        for n, p in enumerate([0, 9, 10, 17]):
            inf = drafter.draft_block(embed, head, ids[:, p], feats[:, :p], p, M.DraftContextCache(1))
            tol = 1e-4 if dtype == "fp32" else 5e-2 * float(train_logits.abs().max())
            assert torch.allclose(train_logits[0, n], inf[0].float(), atol=tol), (family, p)

    # 2. speculative output == target greedy output (drafter in the target's dtype, as eval loads it)
    greedy = _greedy(target, prompt, NEW_TOKENS)
    drafter_inf = drafter.to(T.drafter_dtype(target))
    for d in (drafter_inf, NoisyOracle(drafter, greedy, len(prompt), head.weight.shape[0])):
        res = speculative_generate(target, d, prompt, block_size=B, max_new_tokens=NEW_TOKENS)
        assert res.output_ids == greedy, (family, dtype, type(d).__name__)
    hybrid = "linear_attention" in (getattr(T.text_config(target.config), "layer_types", None) or [])
    # linear-attention layers crop natively where transformers records their recurrent states (≥ 5.25),
    # else they are snapshotted and the accepted tokens re-run
    assert res.cache_policy == ("recompute" if hybrid and not _records_recurrent_states() else "crop")
    assert max(res.accept_lengths) == B and min(res.accept_lengths) < B  # full and partial acceptances

    # 3. one real training step: target in this dtype, Accelerate autocast bf16 (or none for fp32)
    acc = make_accelerator("bf16" if dtype == "bf16" else "no", "cpu")
    train_drafter = build_drafter(target, probe).train()
    opt = torch.optim.AdamW(train_drafter.parameters(), lr=1e-3)
    train_drafter, opt = acc.prepare(train_drafter, opt)
    n = len(prompt)
    batch = {
        "input_ids": torch.tensor([prompt]),
        "attention_mask": torch.ones(1, n, dtype=torch.long),
        "loss_mask": torch.tensor([[0] * (n // 2) + [1] * (n - n // 2)], dtype=torch.uint8),
    }
    ctx = StepContext(
        drafter=train_drafter,
        target=target,
        probe=probe,
        num_anchors=4,
        block_size=B,
        gamma=None,
        generator=torch.Generator().manual_seed(0),
    )
    loss, stats = training_step(ctx, batch)
    acc.backward(loss)
    assert loss.dtype == torch.float32 and torch.isfinite(loss) and stats["num_slots"] > 0
    core = acc.unwrap_model(train_drafter)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in core.parameters())
    assert all(p.dtype == torch.float32 for p in core.parameters())  # master weights stay fp32


def test_every_family_has_a_twin_and_a_template(real_models_dir):
    """The zoo covers every config.json in the corpus; each twin's template is a real one."""
    fams = zoo.families(real_models_dir)
    assert len(fams) >= 15 and "Kimi-K2.5" in fams and "Qwen3.5-35B-A3B" in fams
    for fam in fams:
        assert zoo.family_template(real_models_dir, fam).is_file()


def test_twin_keeps_what_makes_the_family_distinct(twin):
    """Shrunk, not flattened: nesting, MLA, MoE, layer-type patterns and remote-code markers survive."""
    k25 = json.loads((twin("Kimi-K2.5") / "config.json").read_text())
    assert k25["model_type"] == "kimi_k25" and k25["text_config"]["kv_lora_rank"] == 16
    assert k25["text_config"]["n_routed_experts"] == 4 and "quantization_config" not in k25["text_config"]
    q35 = json.loads((twin("Qwen3.5-35B-A3B") / "config.json").read_text())["text_config"]
    assert q35["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] and q35["num_experts"] == 4
    oss = json.loads((twin("gpt-oss-20b") / "config.json").read_text())
    assert oss["sliding_window"] == zoo_shrink.SLIDING_WINDOW and set(oss["layer_types"]) == {
        "sliding_attention",
        "full_attention",
    }
    kimi2 = json.loads((twin("Kimi-K2-Instruct") / "config.json").read_text())
    assert kimi2["model_type"] == "kimi_k2" and "auto_map" in kimi2  # loaded natively as DeepseekV3
    assert T.check_loadable(twin("Kimi-K2-Instruct"))["class"] == "DeepseekV3ForCausalLM"
    tok = load_tokenizer(twin("gpt-oss-20b"))
    text = render(tok, [{"role": "user", "content": "hi"}], thinking="none", add_generation_prompt=True)
    assert text.endswith("<|start|>assistant") and "<|message|>" in tok.get_vocab()


def test_twin_build_is_deterministic(twin, tmp_path, real_models_dir):
    again = zoo.build_twin(real_models_dir, "Qwen3-8B", tmp_path / "again", corpus_file=GSM8K_TRAIN)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (twin("Qwen3-8B") / name).read_bytes(), name


def test_kimi_k25_runs_every_in_process_stage(tmp_path, real_models_dir):
    """The story's target family: completions (transformers backend), tokens, train fp32 + bf16, eval."""
    out = zoo.run_stages(
        real_models_dir, "Kimi-K2.5", tmp_path, GSM8K_TRAIN, REPO_ROOT / "data" / "gsm8k" / "test.jsonl"
    )
    assert out == {s: "ok" for s in zoo.STAGES}, out
    summary = json.loads((tmp_path / "train_bfloat16" / "train_summary.json").read_text())
    assert summary["target_dtype"] == "bfloat16" and summary["train_config"]["mixed_precision"] == "bf16"
