"""Architectures the model corpus has no config for, built from transformers' own config classes
(:data:`dflash_pipeline.testing.zoo_extra.EXTRA_FAMILIES`: state-space hybrids Jamba and Falcon-H1, the
short-convolution hybrid LFM2, SmolLM3's NoPE layers, DeepSeek-V3.2's sparse-attention MLA, LongCat's
double-attention layers, Mistral-3's image-text wrapper): each runs every in-process zoo stage (train fp32
and bf16, eval) or is refused at planning (the probe) with the reason, never a crash mid-run."""

from __future__ import annotations

import pytest
from conftest import GSM8K_TRAIN, REPO_ROOT, models_dir

from dflash_pipeline.testing import zoo
from dflash_pipeline.testing.zoo_extra import EXTRA_FAMILIES, extra_config

#: Extra families the probe refuses, with a piece of the reason.
REFUSED_AT_PLANNING: dict[str, str] = {"LongCat-Flash-twin": "counts sublayers of 2 decoder layers"}


@pytest.mark.parametrize("family", sorted(EXTRA_FAMILIES))
def test_extra_family_runs_every_stage_or_is_refused_at_planning(tmp_path, real_models_dir, family):
    out = zoo.run_stages(real_models_dir, family, tmp_path, GSM8K_TRAIN, REPO_ROOT / "data" / "gsm8k" / "test.jsonl")
    if family in REFUSED_AT_PLANNING:
        assert (
            out["build"] == "ok"
            and out["probe"].startswith("refused: ")
            and REFUSED_AT_PLANNING[family] in out["probe"]
        )
        return
    assert out == {s: "ok" for s in zoo.STAGES}, out


def test_extra_configs_come_from_the_config_classes():
    import transformers

    for name, (cls_name, arch, _, _) in EXTRA_FAMILIES.items():
        raw = extra_config(name)
        assert raw["architectures"] == [arch] and raw["model_type"] == getattr(transformers, cls_name).model_type
    assert zoo.all_families(models_dir())[-len(EXTRA_FAMILIES) :] == sorted(EXTRA_FAMILIES)
