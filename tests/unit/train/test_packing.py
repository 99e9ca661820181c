"""Sequence packing (packing.py): rows of several records where anchors, labels and attention never cross
a record, proven by the train/inference logit equality of tests/unit/drafter/test_model.py on packed batches."""

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_pipeline.drafter import model as M
from dflash_pipeline.target.hidden import target_features
from dflash_pipeline.train import packing as P
from dflash_pipeline.train.heldout import heldout_acceptance

B = 4


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    tcfg = Qwen3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    target = Qwen3ForCausalLM(tcfg).eval().requires_grad_(False)
    dcfg = M.drafter_config_from_target(
        tcfg, block_size=B, num_draft_layers=2, target_layer_ids=[1, 3], mask_token_id=95
    )
    drafter = M.DFlashDrafter(dcfg).eval()
    torch.manual_seed(1)
    scfg = M.drafter_config_from_target(
        tcfg,
        block_size=B,
        num_draft_layers=2,
        target_layer_ids=[1, 3],
        mask_token_id=95,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=5,
    )
    return target, drafter, M.DFlashDrafter(scfg).eval()


def _records(lengths, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(0, 90, n).astype(np.int32)
        mask = np.ones(n, dtype=np.uint8)
        mask[: n // 3] = 0  # a prompt part
        out.append((ids, mask))
    return out


def test_pack_records_first_fit_decreasing():
    bins = P.pack_records([5, 9, 3, 7, 2, 12], max_tokens=12)
    assert sorted(i for b in bins for i in b) == list(range(6))  # every record exactly once
    assert all(sum([5, 9, 3, 7, 2, 12][i] for i in b) <= 12 for b in bins)
    assert bins == [[5], [1, 2], [0, 3], [4]]  # 12 | 9+3 | 7+5 | 2 (FFD, index order in a bin)
    assert P.pack_records([20, 3], max_tokens=10) == [[0], [1]]  # too long: alone, never cut
    with pytest.raises(ValueError, match="pack_max_tokens"):
        P.pack_records([1], 0)


def test_collate_packed_positions_and_segments():
    recs = _records([3, 2])
    batch = P.collate_packed([[recs[0], recs[1]], [recs[1]]])
    assert batch["input_ids"].shape == (2, 5)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]
    assert batch["segment_ids"].tolist() == [[0, 0, 0, 1, 1], [0, 0, -1, -1, -1]]
    assert batch["attention_mask"].tolist() == [[1] * 5, [1, 1, 0, 0, 0]]
    assert batch["num_records"].tolist() == [2, 1]


def test_anchors_and_labels_never_cross_a_record():
    lm = torch.ones(1, 10, dtype=torch.uint8)
    seg = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, -1]])
    cand = P.anchor_candidates(lm, seg)
    assert cand[0].tolist() == [True, True, True, False, True, True, True, True, False, False]
    g = torch.Generator().manual_seed(0)
    draws = set()
    for _ in range(8):
        ab = P.sample_packed_anchors(lm, seg, 2, generator=g)  # up to 2 per record
        kept = ab.anchors[0][ab.keep[0]]
        assert cand[0, kept].all() and kept.tolist() == sorted(kept.tolist()) and len(kept) == 4
        assert (seg[0, kept] == 0).sum() == 2 and (seg[0, kept] == 1).sum() == 2
        draws.add(tuple(kept.tolist()))
    assert len(draws) > 1  # redrawn each call
    every = P.sample_packed_anchors(lm, seg, 64, generator=g)
    assert every.anchors[0][every.keep[0]].tolist() == cand[0].nonzero().flatten().tolist()
    ab = M.AnchorBatch(torch.tensor([[2, 4]]), torch.tensor([[True, True]]))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0]])
    blk = P.packed_block_inputs_and_labels(torch.arange(10).view(1, -1), lm, pos, seg, ab, B, 99, None)
    assert blk.pos[0].tolist() == [2, 3, 4, 5, 0, 1, 2, 3]  # record-relative
    assert blk.rows[0].tolist() == [2, 3, 4, 5, 4, 5, 6, 7]
    assert blk.weights[0].gt(0).tolist() == [False, True, False, False, False, True, True, True]  # 4, 5 are record 1


def test_packed_mask_context_is_the_anchors_record_before_it():
    seg = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, -1]])
    anchors = torch.tensor([[2, 4, 7]])
    mask = P.build_packed_block_mask(anchors, seg, B)[0, 0]
    ctx = mask[:, :10]
    assert ctx[0].nonzero().flatten().tolist() == [0, 1]
    assert not ctx[B].any()  # anchor at a record start sees no context (and still its own block)
    assert ctx[2 * B].nonzero().flatten().tolist() == [4, 5, 6]
    assert mask.any(-1).all()


def _packed_train_logits(target, drafter, batch, anchors, backend="sdpa"):
    ids, lm, pos, seg = batch["input_ids"], batch["loss_mask"], batch["position_ids"], batch["segment_ids"]
    feats, _ = P.packed_target_features(target, ids, pos, drafter.target_layer_ids)
    blk = P.packed_block_inputs_and_labels(ids, lm, pos, seg, anchors, B, drafter.mask_token_id, None)
    mask = P.build_packed_training_masks(drafter, anchors.anchors, seg, backend)
    hidden = drafter(target.model.embed_tokens(blk.ids), feats, pos, blk.pos, attn_mask=mask)
    return target.lm_head(hidden).view(ids.shape[0], anchors.anchors.shape[1], B, -1)


@pytest.mark.parametrize("which", ["full", "sliding"])
def test_packed_training_forward_matches_inference_per_record(tiny, which):
    """Three records in two packed rows: every block's training logits equal the inference draft of that
    block on its record alone — including a block at a record start and one running past its record."""
    target, full, sliding = tiny
    drafter = full if which == "full" else sliding
    recs = _records([9, 7, 12], seed=2)
    batch = P.collate_packed([[recs[0], recs[1]], [recs[2]]])
    # row 0: record 0 at 0..8, record 1 at 9..15; row 1: record 2 at 0..11
    starts = {0: (0, 0), 1: (0, 9), 2: (1, 0)}
    per_row = [[(0, 3), (0, 7), (1, 0), (1, 4)], [(2, 0), (2, 6), (2, 10), (2, 10)]]
    anchors = M.AnchorBatch(
        torch.tensor([[starts[r][1] + p for r, p in row] for row in per_row]), torch.ones(2, 4, dtype=torch.bool)
    )
    with torch.no_grad():
        logits = _packed_train_logits(target, drafter, batch, anchors)
        for row, items in enumerate(per_row):
            for n, (r, p) in enumerate(items):
                ids = torch.from_numpy(recs[r][0].astype(np.int64)).view(1, -1)
                feats, _ = target_features(target, ids, None, drafter.target_layer_ids)
                cache = M.DraftContextCache(len(drafter.layers))
                inf = drafter.draft_block(target.model.embed_tokens, target.lm_head, ids[:, p], feats[:, :p], p, cache)
                assert torch.allclose(logits[row, n], inf[0], atol=1e-5), (which, r, p)


def test_packed_flex_mask_matches_dense(tiny):
    target, _, sliding = tiny
    recs = _records([9, 7, 12], seed=3)
    batch = P.collate_packed([[recs[0], recs[1]], [recs[2]]])
    anchors = M.AnchorBatch(torch.tensor([[3, 9, 12], [0, 5, 10]]), torch.ones(2, 3, dtype=torch.bool))
    with torch.no_grad():
        dense = _packed_train_logits(target, sliding, batch, anchors, "sdpa")
        flex = _packed_train_logits(target, sliding, batch, anchors, "flex")
    assert torch.allclose(dense, flex, atol=1e-5)


def test_target_packing_check(tiny):
    target = tiny[0]
    P.check_target_isolates_records(target, [1, 3])  # Qwen3 under sdpa: records kept apart

    class Leaky(torch.nn.Module):  # a recurrent-style layer: each state sums all tokens before it, any record
        config = target.config

        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(96, 4)

        def forward(self, input_ids, attention_mask=None, output_hidden_states=True, **kw):
            h = self.emb(input_ids).cumsum(1)
            return type("Out", (), {"hidden_states": (h,) * 7})()

    with pytest.raises(ValueError, match="train.packing: false"):
        P.check_target_isolates_records(Leaky(), [1, 3])


def test_heldout_acceptance_packed_equals_padded(tiny):
    """The validation simulator gives the same counts whether the held-out records come packed or padded
    (anchors are chosen per record: 3 evenly spaced ones each)."""
    target, drafter, _ = tiny
    from dflash_pipeline.train.run import collate

    recs = _records([9, 7, 12, 6], seed=4)
    kw = dict(target_layer_ids=drafter.target_layer_ids, mask_token_id=95, num_anchors=3)
    emb, head = target.model.embed_tokens, target.lm_head
    padded = heldout_acceptance(drafter, target, emb, head, [collate(recs[:2]), collate(recs[2:])], **kw)
    packed = heldout_acceptance(
        drafter, target, emb, head, [P.collate_packed([[recs[0], recs[1], recs[3]], [recs[2]]])], **kw
    )
    assert padded["num_blocks"] == packed["num_blocks"] == 3 * len(recs)
    assert abs(padded["tau"] - packed["tau"]) < 1e-9 and padded["slot_acc"] == packed["slot_acc"]
    assert 1.0 <= padded["tau"] <= B
