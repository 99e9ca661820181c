"""DFlash2 and DSpark drafters (drafter.family): the arithmetic the engine parity test cannot reach on one
inference block (block boundaries, training blocks, objectives), the export vLLM loads, the families'
verify rules in our loop, and the planning refusals. Engine parity: tests/e2e/test_drafter_family_parity.py."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_target_and_drafter

from dflash_pipeline.drafter import build as DB
from dflash_pipeline.drafter import dflash2_model as D2
from dflash_pipeline.drafter import dspark_model as DS
from dflash_pipeline.drafter import families as FR
from dflash_pipeline.drafter import model as M

DFLASH2 = {
    "conv_kernel_size": 2,
    "conv_group_size": 8,
    "selector_rank": 4,
    "selector_top_k": 5,
    "output_multiplier": 1.0,
    "final_logit_softcapping": None,
}
DSPARK = {
    "markov_rank": 4,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
}


def tiny(family: str, block_size: int = 4, layers: int = 2, **kw):
    """``(target, drafter)``: the random tiny target of tests/conftest.py and a ``family`` drafter on it."""
    target, dflash = tiny_target_and_drafter(
        num_hidden_layers=6, num_draft_layers=layers, target_layer_ids=[1, 4], block_size=block_size
    )
    if family == "dflash":
        return target, dflash
    cfg = M.drafter_config_from_target(
        target.config, block_size=block_size, num_draft_layers=layers, target_layer_ids=[1, 4], mask_token_id=95, **kw
    )
    fam = FR.get(family)
    cfg = fam.make_config(cfg, DFLASH2 if family == "dflash2" else DSPARK)
    torch.manual_seed(0)
    return target, fam.build(cfg).eval()


def test_grouped_conv_never_reaches_across_a_block_boundary():
    """Two blocks convolved together equal each block convolved alone (zeroed taps at offset < t), and
    the arithmetic is out[r] = Σ_t (base[t] + delta[r, t, g]) · x[r − t] inside the block."""
    g = torch.Generator().manual_seed(0)
    b, bs, h, gs, taps = 1, 4, 16, 8, 2
    x = torch.randn(b, 2 * bs, h, generator=g)
    delta = torch.randn(b, 2 * bs, taps, h // gs, generator=g)
    base = torch.randn(taps, h, generator=g)
    both = D2.grouped_conv(x, delta, base, bs, gs)
    alone = torch.cat([D2.grouped_conv(x[:, i : i + bs], delta[:, i : i + bs], base, bs, gs) for i in (0, bs)], dim=1)
    torch.testing.assert_close(both, alone)
    coef = base.unsqueeze(0) + delta[0].repeat_interleave(gs, dim=-1)  # [Q, taps, H]
    r = 5  # offset 1 in block 1: both taps
    torch.testing.assert_close(both[0, r], coef[r, 0] * x[0, r] + coef[r, 1] * x[0, r - 1])
    torch.testing.assert_close(both[0, bs], coef[bs, 0] * x[0, bs])  # offset 0: no tap into block 0


def test_untrained_dflash2_is_dflash():
    """Identity-initialised convolutions: with DFlash's weights an untrained DFlash2 backbone computes DFlash's
    hidden states (so DFlash2 starts where DFlash does, speculators #1006)."""
    _, dflash = tiny("dflash")
    _, d2 = tiny("dflash2")
    missing, unexpected = d2.load_state_dict(dflash.state_dict(), strict=False)
    assert not unexpected and all("_conv." in m or "candidate_selector" in m for m in missing)
    g = torch.Generator().manual_seed(1)
    args = (
        torch.randn(1, 8, 32, generator=g),
        torch.randn(1, 10, 64, generator=g),
        torch.arange(10).unsqueeze(0),
        torch.arange(10, 18).unsqueeze(0),
    )
    with torch.no_grad():
        torch.testing.assert_close(d2(*args), dflash(*args))
        d2.layers[0].mlp_conv.base_kernel[1, 1] += 0.5  # a trained tap changes it
        assert not torch.allclose(d2(*args), dflash(*args))


def test_selector_scores_and_walk_by_hand():
    sel = D2.CandidateSelector(hidden_size=3, vocab_size=6, rank=2, top_k=2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in sel.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    hidden = torch.randn(1, 2, 3, generator=g)
    cand = torch.tensor([[[1, 2], [3, 4]]])
    unary = torch.tensor([[[0.5, 0.1], [0.0, 0.2]]])
    scores = sel.scores(hidden, cand, unary, torch.tensor([5]))
    hp = sel.hidden_projection(hidden[0])  # [2, r]
    for step, prevs in ((0, [5, 5]), (1, [1, 2])):
        for i, p in enumerate(prevs):
            for j in range(2):
                want = (
                    unary[0, step, j]
                    + (sel.predecessor_codebook[p] * hp[step] * sel.successor_codebook[cand[0, step, j]]).sum()
                )
                torch.testing.assert_close(scores[0, step, i, j], want)
    table = torch.tensor(
        [[[[0.0, 1.0], [5.0, 0.0]], [[2.0, 0.0], [0.0, 3.0]]]]
    )  # step 0 row 0 → j=1; step 1 row 1 → j=1
    assert D2.walk(table, cand).tolist() == [[2, 4]]


def test_dspark_blocks_draft_from_the_anchor():
    from dflash_pipeline.drafter import blocks as BL

    ids = torch.arange(10, 20).unsqueeze(0)
    lm = torch.ones(1, 10, dtype=torch.uint8)
    lm[0, 8] = 0
    anchors = BL.AnchorBatch(torch.tensor([[2, 6]]), torch.tensor([[True, True]]))
    blk = DS.dspark_blocks(ids, lm, anchors, 4, 99, gamma=2.0)
    assert blk.ids.tolist() == [[12, 99, 99, 99, 16, 99, 99, 99]]
    assert blk.pos.tolist() == [[2, 3, 4, 5, 6, 7, 8, 9]]
    assert blk.labels[0, :4].tolist() == [13, 14, 15, 16]  # slot k predicts p+k+1
    assert blk.prev[0, :4].tolist() == [12, 13, 14, 15]  # the Markov head's input: the gold token at p+k
    assert blk.rows[0, :4].tolist() == [3, 4, 5, 6]
    w = blk.weights[0].tolist()

    def e(x):
        return torch.exp(torch.tensor(x)).item()

    assert w[:4] == pytest.approx([1.0, e(-0.5), e(-1.0), e(-1.5)])  # exp(−k/γ) from the first prediction
    assert w[4:] == pytest.approx([1.0, 0.0, e(-1.0), 0.0])  # p+k+1 = 8 unsupervised, 10 out of range


def test_selector_gold_insert_and_drop():
    """A gold token outside the top-K: ``insert`` trains the selector on it (it covers every slot), ``drop``
    leaves those slots out; a gold token inside the top-K counts for both."""

    _, d = tiny("dflash2")
    head = torch.nn.Linear(32, 96, bias=False)
    hidden = torch.randn(1, 8, 32)
    logits = head(hidden[0])
    top = logits.topk(5, dim=-1).indices
    out = logits.argmin(dim=-1)  # never in the top-5
    labels = torch.where(torch.arange(8) % 2 == 0, top[:, 0], out).unsqueeze(0)
    weights = torch.tensor([[0.0, 1, 1, 1, 0, 1, 1, 1]])
    _, cov_insert, st_insert = D2.selector_term(d, hidden, head.weight, labels, weights, 4, gold="insert")
    _, cov_drop, st_drop = D2.selector_term(d, hidden, head.weight, labels, weights, 4, gold="drop")
    assert st_insert["gold_in_top_k"] == st_drop["gold_in_top_k"] == 2  # slots 2 and 6
    assert float(cov_insert) == 6.0 and float(cov_drop) == 2.0
    with pytest.raises(ValueError, match="selector_gold"):
        D2.selector_term(d, hidden, head.weight, labels, weights, 4, gold="keep")


def test_dspark_tv_is_zero_when_the_drafter_is_the_target():
    """TV(p_target, p_draft) vanishes when the drafter's logits are the target's (no Markov bias), and the
    CE part alone is then 0.1 · CE."""

    _, d = tiny("dspark")
    d.confidence_head = None
    head = torch.nn.Linear(32, 96, bias=False)
    hidden = torch.randn(1, 4, 32)
    blk = DS.DSparkBlocks(
        ids=None,
        pos=None,
        labels=torch.tensor([[3, 4, 5, 6]]),
        prev=torch.tensor([[2, 3, 4, 5]]),
        rows=None,
        weights=torch.ones(1, 4),
    )
    tv = DS.dspark_objective(d, hidden, head.weight, blk, loss="dspark_tv", teacher_hidden=hidden)
    ce = DS.dspark_objective(d, hidden, head.weight, blk, loss="ce_decay")
    torch.testing.assert_close(tv.total, 0.1 * ce.total)
    other = DS.dspark_objective(d, hidden, head.weight, blk, loss="dspark_tv", teacher_hidden=torch.randn(1, 4, 32))
    assert float(other.total.detach()) > float(tv.total.detach())


@pytest.mark.parametrize("family", ["dflash2", "dspark"])
def test_export_is_what_vllm_loads(tmp_path, family):
    """config.json carries the family's architecture and keys where vLLM reads them, the weights the names its
    loader maps (model. prefix added by vLLM), and the export loads back as the same family."""
    from safetensors.torch import load_file

    _, d = tiny(family)
    M.save_drafter(d, tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    names = set(load_file(str(tmp_path / "model.safetensors")))
    if family == "dflash2":
        assert cfg["architectures"] == ["DFlash2DraftModel"]
        assert {k: cfg["dflash_config"][k] for k in DFLASH2} == DFLASH2 and cfg["dflash_config"]["causal"] is False
        assert {
            "layers.0.attention_conv.base_kernel",
            "layers.1.mlp_conv.kernel_projection.weight",
            "candidate_selector.predecessor_codebook",
            "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight",
        } <= names
    else:
        assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["sample_from_anchor"] is True
        assert {k: cfg[k] for k in DSPARK} == DSPARK
        assert {
            "markov_head.markov_w1.weight",
            "markov_head.markov_w2.weight",
            "confidence_head.proj.weight",
            "confidence_head.proj.bias",
        } <= names
    back = DB.load_drafter(tmp_path)
    assert type(back) is type(d)
    for k, v in d.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v)


def test_dspark_oracle_reaches_block_size_plus_one():
    """A DSpark drafter that drafts the target's greedy continuation gets all B drafts accepted: B + 1 tokens
    per verify step (DFlash's maximum is B). A confidence threshold cuts the verified prefix."""
    from dflash_pipeline.evaluate.speculative import speculative_generate

    target, d = tiny("dspark")
    prompt = [5, 17, 33, 2, 8]
    greedy = target.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False)[0, len(prompt) :].tolist()

    def propose(embed, head, bonus, new_context, start, cache, block_size=None):
        done = start - len(prompt) + 1
        return torch.tensor([greedy[done : done + 4]]), torch.tensor([[0.9, 0.9, 0.5, 0.9]])

    d.propose = propose
    res = speculative_generate(target, d, prompt, block_size=4, max_new_tokens=30)
    assert res.output_ids == greedy[:30] and res.accept_lengths[:5] == [5] * 5
    gated = speculative_generate(target, d, prompt, block_size=4, max_new_tokens=30, confidence_threshold=0.6)
    assert gated.output_ids == greedy[:30] and gated.accept_lengths[:5] == [3] * 5  # 0.9·0.9 ≥ 0.6 > 0.405


def test_verify_length():
    conf = torch.tensor([[0.9, 0.8, 0.5, 0.99]])
    assert DS.verify_length(conf, 0.0, 4) == 4
    assert DS.verify_length(conf, 0.7, 4) == 2  # 0.9, 0.72 | 0.36
    assert DS.verify_length(conf, 0.95, 4) == 1  # at least one draft
    assert DS.verify_length(None, 0.7, 4) == 4


def _cfg(**over):
    from dflash_pipeline.core.config import deep_merge, validate_config

    base = {"target": {"path": "demo"}, "datasets": {"x": {"path": "data/gsm8k/train.jsonl"}}}
    return validate_config(deep_merge(base, over))


@pytest.mark.parametrize(
    "over,needle",
    [
        ({"drafter": {"family": "dspark"}, "train": {"loss": "dpace"}}, "cannot train drafter.family dspark"),
        ({"drafter": {"family": "dflash"}, "train": {"loss": "dspark_tv"}}, "cannot train drafter.family dflash"),
        (
            {"drafter": {"family": "dspark"}, "train": {"loss": "dspark_tv", "target_features": "shards"}},
            "dspark_tv compares",
        ),
        (
            {"drafter": {"family": "dspark"}, "train": {"packing": True}},
            "packing is not supported with drafter.family: dspark",
        ),
        ({"drafter": {"family": "dflash2"}, "eval": {"confidence_threshold": 0.5}}, "no confidence head"),
        ({"drafter": {"family": "dflash2"}, "train": {"fsdp": True, "num_processes": 2}}, "train.fsdp"),
    ],
)
def test_family_combinations_refused_at_planning(over, needle):
    found = FR.config_problems(_cfg(**over))
    assert any(needle in p for p in found), found


def test_default_family_keeps_every_param():
    """A config without the family keys plans exactly what it planned before they existed."""
    cfg = _cfg()
    assert "family" not in FR.probe_params(cfg["drafter"])
    assert FR.arch_params(cfg["drafter"]) == {"layer_types": None, "sliding_window": None}
    assert not set(FR.family_train_keys()) & set(FR.train_params(cfg["train"], "dflash"))
    assert FR.config_problems(cfg) == []


@pytest.mark.parametrize("family", ["dflash", "dflash2", "dspark"])
def test_untrained_floor_drafter_is_of_the_exports_family(tmp_path, family):
    """eval's untrained floor (evaluate.acceptance.family_build_args, read through DFlashConfig) builds a drafter
    of the export's family with its settings and layer types; DFlash gives no keywords (the floor it always had)."""
    from dflash_pipeline.evaluate.acceptance import family_build_args

    _, d = tiny(family, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    M.save_drafter(d, tmp_path, dtype=torch.float32)
    args = family_build_args(tmp_path)
    if family == "dflash":
        assert args == {}
        return
    assert args == {
        "family": family,
        "family_settings": DFLASH2 if family == "dflash2" else DSPARK,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8,
    }
    assert family_build_args(None) == {}


def test_two_families_claiming_one_architecture_are_refused_at_lookup():
    """Registration checks names only (reading an architecture imports the config class); the lookup the engines'
    dispatch goes through refuses two families with one architecture."""
    from dflash_pipeline.drafter import families as FR
    from dflash_pipeline.drafter.dflash import DFlashFamily

    @FR.register
    class Twin(DFlashFamily):  # inherits DFlash's config class, so its architecture
        name = "twin-architecture"

    try:
        with pytest.raises(ValueError, match="both claim architecture 'DFlashDraftModel'"):
            FR.find_by_architectures(["DFlashDraftModel"])
    finally:
        FR.unregister("twin-architecture")
    assert FR.find_by_architectures(["DFlashDraftModel"]) is FR.default()
