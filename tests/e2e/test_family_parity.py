"""Engine parity for every zoo family and rope variant, against vLLM's own DFlash drafter code (CPU, fp32).

One vLLM-environment process for the session (:mod:`dflash_pipeline.testing.vllm_replay`) runs every case:
* per zoo family (every ``config.json`` of the model corpus, plus the twins built from transformers' own
  config classes, :data:`dflash_pipeline.testing.zoo.EXTRA_FAMILIES`): the drafter the pipeline builds for
  that twin, exported, loaded by ``DFlashQwen3ForCausalLM`` with the target checkpoint's raw embedding and
  LM head (what vLLM shares), three draft steps on one growing context; our side is the eval loop's
  ``draft_block`` with the embedding :func:`dflash_pipeline.target.loading.input_embeddings` gives. A new
  zoo family is covered by default (the parametrisation is the zoo's list).
* per real ``config.json``: the drafter rotary (:mod:`dflash_pipeline.drafter.rope`) against ``get_rope``
  at positions up to 30,000 (default, yarn with and without mscale, llama3, partial rotary of
  Qwen3.5/3.6/Qwen3-Next/MiniMax, M-RoPE of Qwen3-VL/Qwen3.5, NoPE layers of SmolLM3).

Tolerance: tests/e2e/test_engine_parity.py's ``ATOL`` (2e-4), not loosened. Negative controls: rotating
the whole head on a partial-rotary family (the bug this caught), Gemma's scaled embedding module, and
context positions off by one must each miss by more than ``CONTROL_MIN_DIFF``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import models_dir

from dflash_pipeline.testing import engine_parity as EP
from dflash_pipeline.testing import zoo
from dflash_pipeline.testing.zoo_extra import EXTRA_FAMILIES

REPO = Path(__file__).resolve().parents[2]
GSM8K_TRAIN = REPO / "data" / "gsm8k" / "train.jsonl"
pytestmark = pytest.mark.vllm

MODELS = models_dir()
FAMILIES = zoo.all_families(MODELS) if MODELS is not None else []
#: Families whose negative controls are checked (one per kind of mistake, plus the generic one on all).
CONTROLS = {
    "Qwen3.5-27B": ("full_rotary", "ctx_pos_off_by_one"),
    "MiniMax-M2.7": ("full_rotary",),
    "gemma-4-26B-A4B": ("scaled_embedding",),
    "Qwen3-8B": ("ctx_pos_off_by_one",),
}


@pytest.fixture(scope="session")
def parity(tmp_path_factory, vllm_python, real_models_dir):
    """Every family's case and every rope case, run through one vLLM process."""
    from dflash_pipeline.drafter import model as M
    from dflash_pipeline.target.loading import load_target_config, text_config

    root = tmp_path_factory.mktemp("family-parity")
    from dflash_pipeline.core.errors import ProbeError

    built, refused = {}, {}
    for fam in FAMILIES:
        twin = zoo.build_any_twin(real_models_dir, fam, root / "twins" / fam, corpus_file=GSM8K_TRAIN)
        try:  # the probe refuses (with the reason) a family whose drafter vLLM cannot serve
            built[fam] = EP.family_case(
                twin, root / "cases" / fam, name=f"family-{fam}", mistakes=CONTROLS.get(fam, ())
            )
        except ProbeError as exc:
            refused[fam] = str(exc)
    ropes = {}
    for cfg_file in sorted(real_models_dir.glob("*/config.json")) + zoo.extra_config_files(root / "extra-configs"):
        tc = text_config(load_target_config(cfg_file.parent))
        dc = M.drafter_config_from_target(tc, block_size=4, num_draft_layers=1, target_layer_ids=[0], mask_token_id=0)
        ropes[cfg_file.parent.name] = EP.rope_case(f"rope-{cfg_file.parent.name}", dc, root / "ropes")
    res = EP.run_vllm(
        vllm_python, root / "vllm", cases=[c["case"] for c in built.values()], ropes=[r["case"] for r in ropes.values()]
    )
    return {"root": root / "vllm", "built": built, "refused": refused, "ropes": ropes, "res": res}


#: Families the probe refuses (with the reason): LongCat-Flash's num_hidden_layers counts attention
#: sublayers, not the decoder layers whose hidden states the drafter taps.
REFUSED: dict[str, str] = {"LongCat-Flash-twin": "counts sublayers"}


def test_refused_families_are_the_known_ones(parity):
    assert parity["refused"].keys() == REFUSED.keys(), parity["refused"]
    assert all(REFUSED[f] in reason for f, reason in parity["refused"].items()), parity["refused"]


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in REFUSED])
def test_family_drafter_logits_match_vllm(parity, family):
    case = parity["built"][family]
    meta = parity["res"][case["case"]["name"]]
    assert meta["ok"], meta.get("traceback", meta)
    theirs = EP.vllm_tensors(parity["root"], case["case"]["name"])
    ok, summary = EP.compare(case["ours"], theirs)
    print(f"{family}: {summary}; vLLM rope {meta['rope']} rotary_dim {meta['rotary_dim']}, ours {case['facts']}")
    assert meta["rotary_dim"] == case["facts"]["rotary_dim"]
    assert max(float(theirs[f"s{j}.logits"].abs().max()) for j in range(len(case["ours"]))) > 1.0
    assert ok, f"{family}: {summary}"


@pytest.mark.parametrize(("family", "mistake"), [(f, m) for f, ms in CONTROLS.items() for m in ms])
def test_parity_catches_a_deliberate_mistake(parity, family, mistake):
    case = parity["built"][family]
    theirs = EP.vllm_tensors(parity["root"], case["case"]["name"])
    miss = EP.max_logit_diff(case["controls"][mistake], theirs)
    print(f"{family} {mistake}: max |Δlogit| {miss:.2e}")
    assert miss > EP.CONTROL_MIN_DIFF


@pytest.mark.parametrize("name", (zoo.families(MODELS) if MODELS is not None else []) + sorted(EXTRA_FAMILIES))
def test_drafter_rotary_is_vllms(parity, name):
    r = parity["ropes"][name]
    meta = parity["res"][r["case"]["name"]]
    assert meta["ok"], meta.get("traceback", meta)
    theirs = EP.vllm_tensors(parity["root"], r["case"]["name"])
    assert meta["rotary_dim"] == r["rotary_dim"], (meta, r["case"]["rope_parameters"])
    for key in ("q", "k"):
        diff = float((r["ours"][key] - theirs[key]).abs().max())
        assert diff < 1e-4, f"{name} {key}: max |Δ| {diff:.2e} ({meta['class']}, {r['case']['rope_parameters']})"


def test_partial_rotary_families_rotate_what_vllm_rotates(parity):
    """Qwen3.5/3.6/Qwen3-Next rotate 64 of 256 channels, MiniMax-M2 64 of 128: in training as served."""
    want = {"Qwen3.5-27B": 64, "Qwen3.5-35B-A3B": 64, "Qwen3-Next-80B-A3B-Thinking": 64, "MiniMax-M2.7": 64}
    got = {n: parity["ropes"][n]["rotary_dim"] for n in want if n in parity["ropes"]}
    assert got == {n: v for n, v in want.items() if n in got} and got, got
    assert all(
        not {"mrope_section", "mrope_interleaved"} & set(r["case"]["rope_parameters"]) for r in parity["ropes"].values()
    )
