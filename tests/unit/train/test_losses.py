"""Training objectives (losses.py) and the per-block acceptance simulator (validation.py), each pinned on a
hand-computed example. Logits are made by hand: lm_head = identity (V = H), so hidden == logits."""

import math

import pytest
import torch

from dflash_pipeline.drafter import model as M
from dflash_pipeline.train import losses as L
from dflash_pipeline.train.heldout import AcceptanceCounts, block_acceptance, heldout_mask

BIG = 30.0  # a logit margin that makes a softmax one-hot to ~1e-13


def _ce_logits(kind: str, label: int, v: int = 4) -> list[float]:
    """Logits whose CE for ``label`` is ln2 ("ln2": label tied with one other), ln4 ("ln4": uniform over 4)
    or ~0 ("zero": label alone on top)."""
    z = [-BIG] * v
    if kind == "ln4":
        return [0.0] * v
    z[label] = BIG
    if kind == "ln2":
        z[(label + 1) % v] = BIG
    return z


def test_ce_decay_is_the_weighted_mean_of_slot_ce_with_its_normaliser():
    # two supervised slots: CE ln2 (w = 1) and ln4 (w = e^{-1/4}); slot 0 (w = 0) ignored
    hidden = torch.tensor([[[0.0] * 4, _ce_logits("ln2", 1), _ce_logits("ln4", 2)]])
    labels = torch.tensor([[0, 1, 2]])
    w = torch.tensor([[0.0, 1.0, math.exp(-0.25)]])
    out = L.ce_decay(hidden, torch.eye(4), labels, w)
    expected_total = 1.0 * math.log(2) + math.exp(-0.25) * math.log(4)
    assert math.isclose(float(out.total), expected_total, rel_tol=1e-5)
    assert math.isclose(float(out.normalizer), 1.0 + math.exp(-0.25), rel_tol=1e-6)
    # the same number model.decayed_cross_entropy reports (ce_decay wraps it)
    ref, _ = M.decayed_cross_entropy(hidden, torch.eye(4), labels, w)
    assert math.isclose(float(out.local()), float(ref), rel_tol=1e-6)


def test_dpace_weights_and_loss_hand_computed():
    """One block of B = 4, slots 1..3 with CE ln2, ln4, 0:
    q = 1/2, 1/4, 1 → q̃ = (1−½)q + ½ = 0.75, 0.625, 1 → P = 0.75, 0.46875, 0.46875
    → w = (P1+P2+P3, P2+P3, P3) = 1.6875, 0.9375, 0.46875; loss = Σ w·CE / batch (1)."""
    hidden = torch.tensor([[[0.0] * 4, _ce_logits("ln2", 1), _ce_logits("ln4", 2), _ce_logits("zero", 3)]])
    labels = torch.tensor([[0, 1, 2, 3]])
    weights = torch.tensor([[0.0, 1.0, 0.8, 0.6]])  # decayed weights: only > 0 matters for D-PACE
    out = L.dpace(hidden, torch.eye(4), labels, weights, block_size=4)
    expected = 1.6875 * math.log(2) + 0.9375 * math.log(4) + 0.46875 * 0.0
    assert math.isclose(float(out.total), expected, rel_tol=1e-5)
    assert float(out.normalizer) == 1.0  # sequences, not Σ weights
    ce = torch.tensor([[0.0, math.log(2), math.log(4), 0.0]])
    w = L.dpace_weights(ce, torch.tensor([[False, True, True, True]]))
    assert torch.allclose(w, torch.tensor([[0.0, 1.6875, 0.9375, 0.46875]]), atol=1e-6)


def test_dpace_invalid_slot_is_skipped_and_blocks_are_independent():
    # block 0: slot 2 invalid (factor 1, no term); block 1: only slot 1 valid
    ce = torch.tensor([[[0.0, math.log(2), 5.0, math.log(4)], [0.0, math.log(4), 1.0, 1.0]]])
    valid = torch.tensor([[[False, True, False, True], [False, True, False, False]]])
    w = L.dpace_weights(ce, valid)
    # block 0: q̃ = 0.75, (1), 0.625 → P = 0.75, -, 0.46875 → w1 = 1.21875, w3 = 0.46875
    assert torch.allclose(w[0, 0], torch.tensor([0.0, 1.21875, 0.0, 0.46875]), atol=1e-6)
    assert torch.allclose(w[0, 1], torch.tensor([0.0, 0.625, 0.0, 0.0]), atol=1e-6)


def test_dpace_gradient_flows_only_through_ce_and_batch_normaliser():
    hidden = torch.randn(2, 8, 4, requires_grad=True)
    labels = torch.randint(0, 4, (2, 8))
    weights = torch.ones(2, 8)
    weights[:, ::4] = 0
    out = L.dpace(hidden, torch.eye(4), labels, weights, block_size=4)
    out.local().backward()
    assert float(out.normalizer) == 2.0 and hidden.grad.abs().sum() > 0
    assert hidden.grad[:, ::4].abs().sum() == 0  # slot 0 carries no loss


def test_kl_hand_computed_with_temperature_and_ce_mix():
    """V = 2. Teacher logits (ln3, 0), student (0, 0).
    T = 1: p_T = (¾, ¼), p_S = (½, ½): KL = ¾ ln(3/2) + ¼ ln(1/2) = 0.1308120.
    T = 2: p_T = (√3, 1)/(√3+1), p_S uniform: KL·T² = 4·(0.6339746 ln 1.2679492 + 0.3660254 ln 0.7320508).
    λ = ½ with label 0 adds ½·CE = ½ ln 2."""
    hidden = torch.zeros(1, 1, 2)
    teacher = torch.tensor([[[math.log(3), 0.0]]])
    labels = torch.tensor([[0]])
    w = torch.tensor([[1.0]])
    out = L.kl(hidden, torch.eye(2), labels, w, teacher, temperature=1.0)
    assert math.isclose(float(out.total), 0.75 * math.log(1.5) + 0.25 * math.log(0.5), rel_tol=1e-5)
    pt = math.sqrt(3) / (math.sqrt(3) + 1)
    kl_t2 = 4 * (pt * math.log(2 * pt) + (1 - pt) * math.log(2 * (1 - pt)))
    out2 = L.kl(hidden, torch.eye(2), labels, w, teacher, temperature=2.0)
    assert math.isclose(float(out2.total), kl_t2, rel_tol=1e-5) and math.isclose(kl_t2, 0.1453631, rel_tol=1e-5)
    out3 = L.kl(hidden, torch.eye(2), labels, w * 0.5, teacher, temperature=2.0, ce_weight=0.5)
    assert math.isclose(float(out3.total), 0.5 * (0.5 * kl_t2 + 0.5 * math.log(2)), rel_tol=1e-5)
    assert math.isclose(float(out3.normalizer), 0.5)


def test_kl_is_zero_when_the_drafter_matches_the_target_and_pulls_toward_it():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(1, 6, 5, generator=g)
    w = torch.ones(1, 6)
    labels = torch.zeros(1, 6, dtype=torch.long)
    assert abs(float(L.kl(t.clone(), torch.eye(5), labels, w, t, temperature=1.5).total)) < 1e-5
    s = torch.zeros(1, 6, 5, requires_grad=True)
    L.kl(s, torch.eye(5), labels, w, t).total.backward()
    # gradient of KL(p_T‖p_S) w.r.t. student logits is p_S − p_T
    assert torch.allclose(s.grad, (torch.full((1, 6, 5), 0.2) - t.softmax(-1)), atol=1e-5)


def test_teacher_hidden_is_the_state_before_each_slot():
    last = torch.arange(10.0).view(1, 10, 1)
    pos = torch.tensor([[3, 4, 5, 6]])
    assert L.teacher_slot_hidden(last, pos).view(-1).tolist() == [2.0, 3.0, 4.0, 5.0]


def test_compute_loss_dispatch_and_errors():
    h = torch.zeros(1, 4, 4)
    y = torch.zeros(1, 4, dtype=torch.long)
    w = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    for name in L.LOSSES:
        out = L.compute_loss(name, h, torch.eye(4), y, w, 4, teacher_hidden=h)
        assert out.stats["num_slots"] == 3
    with pytest.raises(ValueError, match="teacher_hidden"):
        L.compute_loss("kl", h, torch.eye(4), y, w, 4)
    with pytest.raises(ValueError, match="unknown objective"):
        L.compute_loss("mse", h, torch.eye(4), y, w, 4)
    with pytest.raises(ValueError, match="temperature"):
        L.kl(h, torch.eye(4), y, w, h, temperature=0)


def test_losses_without_supervised_slots_backprop_zero():
    for name in L.LOSSES:
        h = torch.randn(1, 4, 4, requires_grad=True)
        out = L.compute_loss(
            name, h, torch.eye(4), torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4), 4, teacher_hidden=h
        )
        out.local().backward()
        assert float(out.total) == 0.0 and h.grad is not None


def test_block_acceptance_is_the_cumulative_product_inside_each_block():
    """Blocks (B = 4, slots 1..3): hits 1,1,0 → accepted 3 tokens; 0,1,1 → 1; 1,1,1 → 4; 1,1,(invalid) → 3.
    τ = (3 + 1 + 4 + 3)/4 = 2.75; per position = (3/4, 3/4, 1/4); the marginal product says otherwise."""
    acc = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    valid = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    s = block_acceptance(acc, valid).summary()
    assert s["num_blocks"] == 4 and math.isclose(s["tau"], 2.75)
    assert s["per_position_acceptance"] == [0.75, 0.75, 0.25]
    assert s["slot_acc"] == [0.75, 1.0, 2 / 3]
    assert math.isclose(s["tau_marginal"], 1 + 0.75 + 0.75 + 0.5)
    # expected acceptance with probabilities: 1 + p1 + p1·p2
    e = block_acceptance(torch.tensor([[0.5, 0.5, 0.0]]), torch.ones(1, 3, dtype=torch.bool)).summary()
    assert math.isclose(e["tau"], 1.75)
    # counts add (batches, ranks) and survive the flat all-reduce form
    both = block_acceptance(acc, valid) + block_acceptance(acc[:1], valid[:1])
    again = AcceptanceCounts.from_tensor(both.as_tensor())
    assert again.summary()["num_blocks"] == 5 and math.isclose(again.summary()["tau"], (11 + 3) / 5)


def test_heldout_mask_keeps_prompts_whole_and_is_stable():
    pids = [f"p{i // 2}" for i in range(400)]  # two rows (turns) per prompt
    m = heldout_mask(pids, 0.1, seed=3)
    assert 0 < sum(m) < 100 and all(m[2 * i] == m[2 * i + 1] for i in range(200))
    # reordering the rows does not change which prompts are held out
    rev = heldout_mask(pids[::-1], 0.1, seed=3)
    assert {p for p, x in zip(pids, m) if x} == {p for p, x in zip(pids[::-1], rev) if x}
    capped = heldout_mask(pids, 0.1, seed=3, max_records=7)
    assert sum(capped) == 6 and all(not c or x for c, x in zip(capped, m))  # whole prompts only
    with pytest.raises(ValueError, match="fraction"):
        heldout_mask(pids, 1.0)
