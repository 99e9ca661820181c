"""A target the probe refuses stops ``snakemake`` before any job runs: the refusal is found while the workflow is
planned (from config.json alone, or with the config class while no probe record has accepted the target), so
no prompt shard is written and no completion is requested."""

from __future__ import annotations

import pytest
import torch
import transformers
import yaml
from conftest import GSM8K_TRAIN, snakemake

from dflash_pipeline.testing import zoo

pytestmark = pytest.mark.e2e


def _mamba(root, models_dir):
    """A complete attention-free model directory: weights, and a tokenizer with a chat template."""
    target = root / "mamba"
    cfg = transformers.MambaConfig(vocab_size=512, hidden_size=32, state_size=4, num_hidden_layers=4)
    torch.manual_seed(0)
    transformers.MambaForCausalLM(cfg).save_pretrained(target)
    template = zoo.family_template(models_dir, "Qwen3-8B").read_text(encoding="utf-8")
    zoo.family_tokenizer(template, GSM8K_TRAIN).save_pretrained(target)
    return target


def _longcat(root, models_dir):
    """LongCat-Flash's tiny twin: its sublayer count shows only through its config class."""
    return zoo.build_any_twin(models_dir, "LongCat-Flash-twin", root / "longcat", corpus_file=GSM8K_TRAIN)


@pytest.mark.parametrize(
    "build, expected",
    [
        (_mamba, "target.path: the probe refuses this target (attention-free)"),
        (_longcat, "target.path: the probe refuses this target (sublayer count)"),
    ],
    ids=["config.json", "config-class"],
)
def test_refused_target_fails_before_any_completion(tmp_path, real_models_dir, build, expected):
    target = build(tmp_path, real_models_dir)
    work = tmp_path / "work"
    work.mkdir()
    config = {
        "target": {"path": str(target)},
        # 5 target layers cannot be placed in the 4-layer twins either: the architecture's refusal comes first
        "drafter": {"block_size": 4, "num_draft_layers": 5, "num_target_features": 5},
        "datasets": {"gsm8k": {"path": str(GSM8K_TRAIN), "max_prompts": 4}},
        "generation": {"backend": "transformers", "max_tokens": 8},
    }
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    proc = snakemake(work, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert expected in out, out[-3000:]
    assert not (work / "results").exists()  # not even the prompts checkpoint ran
