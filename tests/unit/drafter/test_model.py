"""DFlash method invariants (reference/dflash.md §2–4): masks, anchors, labels, loss, alignment, export."""

import math

import pytest
import torch
from conftest import tiny_target_and_drafter

from dflash_pipeline.drafter import build as DB
from dflash_pipeline.drafter import model as M
from dflash_pipeline.evaluate.acceptance import acceptance_stats, speculative_generate
from dflash_pipeline.target.hidden import target_features

B = 4


@pytest.fixture(scope="module")
def tiny():
    return tiny_target_and_drafter(num_hidden_layers=6, num_draft_layers=2, target_layer_ids=[1, 3], block_size=B)


def test_block_mask_context_strictly_before_anchor_by_position():
    anchors = torch.tensor([[0, 3, 4, 9]])  # overlapping blocks (3, 4) and anchor 0
    S = 12
    mask = M.build_block_mask(anchors, S, B)[0, 0]  # [N·B, S+N·B]
    assert mask.shape == (4 * B, S + 4 * B)
    for q in range(4 * B):
        n = q // B
        a = int(anchors[0, n])
        ctx = mask[q, :S]
        assert ctx[:a].all() and not ctx[a:].any(), (q, a)  # strictly before the anchor
        blk = mask[q, S:].view(4, B)
        assert blk[n].all()  # own block, bidirectional
        assert not torch.cat([blk[:n], blk[n + 1 :]]).any()  # never another block
    # anchor 0 sees no context at all, but still its own block (no fully masked row)
    assert not mask[:B, :S].any() and mask.any(dim=-1).all()


def test_block_mask_random_anchors_never_leak():
    g = torch.Generator().manual_seed(1)
    lm = (torch.rand(3, 40, generator=g) > 0.3).to(torch.uint8)
    ab = M.sample_anchors(lm, 16, generator=g)
    mask = M.build_block_mask(ab.anchors, 40, B)[:, 0]
    q_anchor = ab.anchors.repeat_interleave(B, dim=1)  # [b, Q]
    visible_ctx = mask[..., :40]
    j = torch.arange(40).view(1, 1, -1)
    assert not (visible_ctx & (j >= q_anchor.unsqueeze(-1))).any()


def test_sample_anchors_candidates_sorted_and_redrawn():
    lm = torch.zeros(2, 20, dtype=torch.uint8)
    lm[0, 5:15] = 1  # candidates 5..13 (p and p+1 supervised)
    lm[1, 18:20] = 1  # one candidate: 18
    g = torch.Generator().manual_seed(0)
    ab = M.sample_anchors(lm, 4, generator=g)
    assert ab.anchors.shape == (2, 4)
    kept0 = ab.anchors[0][ab.keep[0]].tolist()
    assert len(kept0) == 4 and kept0 == sorted(kept0) and all(5 <= p <= 13 for p in kept0)
    assert ab.keep[1].tolist() == [True, False, False, False] and int(ab.anchors[1, 0]) == 18
    draws = {tuple(M.sample_anchors(lm, 4, generator=g).anchors[0].tolist()) for _ in range(10)}
    assert len(draws) > 1  # redrawn each step


def test_sample_anchors_with_no_supervised_token():
    ab = M.sample_anchors(torch.zeros(2, 10, dtype=torch.uint8), 8)
    assert ab.anchors.shape == (2, 1) and not ab.keep.any()


def test_same_position_labels_and_decay_weights():
    ids = torch.arange(10, 30).view(1, 20)
    lm = torch.ones(1, 20, dtype=torch.uint8)
    lm[0, :3] = 0
    ab = M.AnchorBatch(torch.tensor([[5, 17]]), torch.tensor([[True, True]]))
    blk, pos, labels, w = M.block_inputs_and_labels(ids, lm, ab, B, mask_token_id=99, gamma=4.0)
    assert blk[0, :B].tolist() == [15, 99, 99, 99]
    assert pos[0, :B].tolist() == [5, 6, 7, 8]
    assert labels[0, :B].tolist() == [15, 16, 17, 18]  # slot k predicts input_ids[p+k]
    assert (
        w[0, 0] == 0
        and math.isclose(float(w[0, 1]), 1.0)
        and math.isclose(float(w[0, 2]), math.exp(-1 / 4), rel_tol=1e-6)
    )
    # block at 17: slots at 18, 19 valid, 20 is past the end
    assert w[0, B:].gt(0).tolist() == [False, True, True, False]


def test_loss_without_supervised_slots_still_backprops(tiny):
    target, drafter = tiny
    h = torch.randn(1, 2 * B, 32, requires_grad=True)
    loss, stats = M.decayed_cross_entropy(
        h, target.lm_head.weight, torch.zeros(1, 2 * B, dtype=torch.long), torch.zeros(1, 2 * B)
    )
    loss.backward()
    assert float(loss) == 0.0 and stats["num_slots"] == 0 and h.grad is not None


def test_chunked_loss_equals_unchunked(tiny):
    target, _ = tiny
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 24, 32, generator=g)
    y = torch.randint(0, 96, (2, 24), generator=g)
    w = torch.rand(2, 24, generator=g) * (torch.rand(2, 24, generator=g) > 0.3)
    a, _ = M.decayed_cross_entropy(h, target.lm_head.weight, y, w, chunk_tokens=5)
    b, _ = M.decayed_cross_entropy(h, target.lm_head.weight, y, w, chunk_tokens=10_000)
    logits = h.reshape(-1, 32) @ target.lm_head.weight.T
    ref = (torch.nn.functional.cross_entropy(logits, y.reshape(-1), reduction="none") * w.reshape(-1)).sum() / w.sum()
    assert torch.allclose(a, b, atol=1e-6) and torch.allclose(a, ref, atol=1e-5)


def test_training_forward_matches_inference_loop(tiny):
    """The logits of a block in the training forward equal the inference draft for the same context."""
    target, drafter = tiny
    g = torch.Generator().manual_seed(3)
    S = 18
    ids = torch.randint(0, 90, (1, S), generator=g)
    feats, _ = target_features(target, ids, None, drafter.target_layer_ids)
    anchors = M.AnchorBatch(torch.tensor([[0, 6, 7, 11]]), torch.ones(1, 4, dtype=torch.bool))
    blk, pos, _, _ = M.block_inputs_and_labels(ids, torch.ones_like(ids), anchors, B, drafter.mask_token_id, None)
    mask = M.build_block_mask(anchors.anchors, S, B)
    with torch.no_grad():
        hidden = drafter(target.model.embed_tokens(blk), feats, torch.arange(S).view(1, -1), pos, attn_mask=mask)
        train_logits = target.lm_head(hidden).view(1, 4, B, -1)
        for n, p in enumerate([0, 6, 7, 11]):
            cache = M.DraftContextCache(len(drafter.layers))
            inf = drafter.draft_block(target.model.embed_tokens, target.lm_head, ids[:, p], feats[:, :p], p, cache)
            assert torch.allclose(train_logits[0, n], inf[0], atol=1e-5), p


def test_incremental_draft_cache_matches_fresh(tiny):
    target, drafter = tiny
    ids = torch.randint(0, 90, (1, 14), generator=torch.Generator().manual_seed(4))
    feats, _ = target_features(target, ids, None, drafter.target_layer_ids)
    emb, head = target.model.embed_tokens, target.lm_head
    cache = M.DraftContextCache(len(drafter.layers))
    drafter.draft_block(emb, head, ids[:, 6], feats[:, :6], 6, cache)
    step2 = drafter.draft_block(emb, head, ids[:, 10], feats[:, 6:10], 10, cache)
    fresh = drafter.draft_block(emb, head, ids[:, 10], feats[:, :10], 10, M.DraftContextCache(len(drafter.layers)))
    assert cache.length == 10 and torch.allclose(step2, fresh, atol=1e-5)


def test_speculative_loop_is_lossless_and_random_drafter_tau_near_one(tiny):
    target, drafter = tiny
    prompt = [5, 17, 33, 2, 8]
    res = speculative_generate(target, drafter, prompt, block_size=B, max_new_tokens=20)
    ref = target.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt) :].tolist()
    assert res.output_ids == ref[: len(res.output_ids)] and len(res.output_ids) == 20
    stats = acceptance_stats([res.accept_lengths], B)
    assert 1.0 <= stats["tau"] < 1.5


def test_oracle_drafter_reaches_block_size(tiny):
    """A drafter that drafts the target's own greedy continuation is always fully accepted: τ = B."""
    target, drafter = tiny
    prompt = [5, 17, 33, 2, 8]
    greedy = target.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False)[0, len(prompt) :].tolist()

    class Oracle(torch.nn.Module):
        block_size, target_layer_ids, layers = B, drafter.target_layer_ids, drafter.layers

        def __init__(self):
            super().__init__()
            self.dummy = torch.nn.Parameter(torch.zeros(1))

        def draft_block(self, embed, head, bonus, new_context, start, cache, block_size):
            done = start - len(prompt) + 1  # generated tokens committed through the bonus token
            logits = torch.full((1, block_size, 96), -1e9)
            for k, t in enumerate(greedy[done : done + block_size - 1], start=1):
                logits[0, k, t] = 0.0
            return logits

    res = speculative_generate(target, Oracle(), prompt, block_size=B, max_new_tokens=33)
    assert res.output_ids == greedy[:33]
    assert acceptance_stats([res.accept_lengths], B)["tau"] == B


def test_acceptance_stats_hand_made():
    stats = acceptance_stats([[1, 1, 4], [2], []], 4)
    assert math.isclose(stats["tau"], (2.0 + 2.0) / 2)  # empty response left out of the mean
    assert stats["histogram"] == {"1": 2, "2": 1, "3": 0, "4": 1}
    assert stats["per_position_acceptance"] == [0.5, 0.25, 0.25]
    assert stats["num_steps"] == 4 and stats["num_responses"] == 3


def test_export_roundtrip_served_format(tiny, tmp_path):
    _, drafter = tiny
    M.save_drafter(drafter, tmp_path, dtype=torch.float32)
    import json

    from safetensors import safe_open

    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == B
    assert cfg["dflash_config"] == {"mask_token_id": 95, "target_layer_ids": [1, 3]}
    assert cfg["num_target_layers"] == 6 and cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").shape == (32, 2 * 32)
    assert {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.1.self_attn.q_proj.weight",
        "layers.0.mlp.down_proj.weight",
    } <= names
    assert not any("embed" in n or "lm_head" in n or "rotary" in n for n in names)
    again = DB.load_drafter(tmp_path)
    for (k, v), (k2, v2) in zip(drafter.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)


def test_gamma_table():
    assert M.loss_decay_gamma(16) == 7.0 and M.loss_decay_gamma(10) == 5.0 and M.loss_decay_gamma(8) == 4.0
    assert M.expected_acceptance_length([0.0, 1.0, 1.0, 1.0]) == 4.0
    assert M.expected_acceptance_length([0.0, 0.5, 0.5]) == 1.75


@pytest.fixture(scope="module")
def tiny_sliding(tiny):
    target, _ = tiny
    torch.manual_seed(1)
    dcfg = M.drafter_config_from_target(
        target.config,
        block_size=B,
        num_draft_layers=2,
        target_layer_ids=[1, 3],
        mask_token_id=95,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=5,
    )
    return target, M.DFlashDrafter(dcfg).eval()


def test_sliding_mask_window_and_causal_block():
    anchors = torch.tensor([[9, 10]])
    mask = M.build_block_mask(anchors, 14, B, sliding_window=5)[0, 0]
    for q in range(2 * B):
        n, k = divmod(q, B)
        a = int(anchors[0, n])
        visible_ctx = mask[q, :14].nonzero().flatten().tolist()
        assert visible_ctx == [j for j in range(14) if j < a and (a + k) - j < 5]
        blk = mask[q, 14:].view(2, B)
        assert blk[n].tolist() == [i <= k for i in range(B)] and not blk[1 - n].any()


def test_sliding_drafter_training_matches_inference(tiny_sliding):
    target, drafter = tiny_sliding
    S = 16
    ids = torch.randint(0, 90, (1, S), generator=torch.Generator().manual_seed(7))
    feats, _ = target_features(target, ids, None, drafter.target_layer_ids)
    anchors = M.AnchorBatch(torch.tensor([[2, 8, 9]]), torch.ones(1, 3, dtype=torch.bool))
    blk, pos, _, _ = M.block_inputs_and_labels(ids, torch.ones_like(ids), anchors, B, drafter.mask_token_id, None)
    masks = M.build_training_masks(drafter, anchors.anchors, S)
    assert set(masks) == {"full_attention", "sliding_attention"}
    with torch.no_grad():
        hidden = drafter(target.model.embed_tokens(blk), feats, torch.arange(S).view(1, -1), pos, attn_mask=masks)
        train_logits = target.lm_head(hidden).view(1, 3, B, -1)
        for n, p in enumerate([2, 8, 9]):
            inf = drafter.draft_block(
                target.model.embed_tokens,
                target.lm_head,
                ids[:, p],
                feats[:, :p],
                p,
                M.DraftContextCache(len(drafter.layers)),
            )
            assert torch.allclose(train_logits[0, n], inf[0], atol=1e-5), p


def test_flex_attention_mask_matches_dense(tiny_sliding):
    """The FlexAttention BlockMask path gives the dense-mask path's outputs (eager flex on CPU)."""
    target, drafter = tiny_sliding
    S = 20
    ids = torch.randint(0, 90, (2, S), generator=torch.Generator().manual_seed(8))
    feats, _ = target_features(target, ids, None, drafter.target_layer_ids)
    anchors = M.AnchorBatch(torch.tensor([[0, 5, 6, 12], [3, 3, 9, 15]]), torch.ones(2, 4, dtype=torch.bool))
    blk, pos, _, _ = M.block_inputs_and_labels(ids, torch.ones_like(ids), anchors, B, drafter.mask_token_id, None)
    ctx_pos = torch.arange(S).expand(2, -1)
    emb = target.model.embed_tokens(blk)
    with torch.no_grad():
        dense = drafter(emb, feats, ctx_pos, pos, attn_mask=M.build_training_masks(drafter, anchors.anchors, S, "sdpa"))
        flex = drafter(emb, feats, ctx_pos, pos, attn_mask=M.build_training_masks(drafter, anchors.anchors, S, "flex"))
    assert torch.allclose(dense, flex, atol=1e-5)


def test_sliding_layers_need_a_window(tiny):
    target, _ = tiny
    with pytest.raises(ValueError, match="sliding_window"):
        M.drafter_config_from_target(
            target.config,
            block_size=B,
            num_draft_layers=1,
            target_layer_ids=[1],
            mask_token_id=95,
            layer_types=["sliding_attention"],
        )


def test_batch_without_supervised_token_gives_every_parameter_a_gradient(tiny):
    """With no anchor candidate the step still runs forward/backward through every drafter parameter,
    so DDP's gradient all-reduce never waits on a rank that skipped (no hang)."""
    from dflash_pipeline.train.run import StepContext, training_step

    target, drafter = tiny
    drafter = M.DFlashDrafter(drafter.config).train()
    batch = {
        "input_ids": torch.randint(0, 90, (2, 12)),
        "loss_mask": torch.zeros(2, 12, dtype=torch.uint8),
        "attention_mask": torch.ones(2, 12, dtype=torch.long),
    }
    batch["loss_mask"][0, 3] = 1  # a lone supervised token: still no (p, p+1) pair
    probe = {"drafter": {"target_layer_ids": drafter.target_layer_ids, "mask_token_id": 95}}
    ctx = StepContext(
        drafter=drafter,
        target=target,
        probe=probe,
        num_anchors=4,
        block_size=B,
        gamma=4.0,
        generator=torch.Generator().manual_seed(0),
    )
    loss, stats = training_step(ctx, batch)
    loss.backward()
    assert stats["num_slots"] == 0 and float(loss) == 0.0
    assert all(p.grad is not None for p in drafter.parameters())


def test_auto_attention_backend_is_flex_on_cuda_only_for_heads_its_kernel_takes():
    """`auto`: FlexAttention on CUDA, dense sdpa on CPU (no flex backward there) and for heads under 16 wide,
    which FlexAttention's compiled kernel refuses (seen on an H200: head_dim 8); an explicit choice stays."""
    from dflash_pipeline.drafter.attention_masks import FLEX_MIN_HEAD_DIM
    from dflash_pipeline.drafter.attention_masks import training_attention_backend as pick

    assert pick("auto", "cuda", 128) == pick("auto", "cuda", None) == pick("auto", "cuda", FLEX_MIN_HEAD_DIM) == "flex"
    assert pick("auto", "cuda", 8) == pick("auto", "cpu", 128) == "sdpa"
    assert pick("flex", "cpu", 8) == "flex" and pick("sdpa", "cuda", 128) == "sdpa"
