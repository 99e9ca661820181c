"""The export's config.json against speculators' Open Spec Config DFlash schema (vendored in
tests/data/open_spec_config/ with its licence): everything validates except ``architectures``, where the schema
wants ``DflashDraftModel`` (one item) and vLLM's and SGLang's registries load ``DFlashDraftModel`` — we keep the
engines' name (docs/how-to/add-a-drafter-family.md)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from test_families import tiny

from dflash_pipeline.drafter import families as FR
from dflash_pipeline.drafter import model as M

SCHEMA = json.loads(
    (Path(__file__).resolve().parents[2] / "data" / "open_spec_config" / "dflash.schema.json").read_text()
)


def _errors(cfg: dict) -> list[jsonschema.ValidationError]:
    validator = jsonschema.Draft202012Validator(SCHEMA)
    validator.check_schema(SCHEMA)
    return sorted(validator.iter_errors(cfg), key=lambda e: list(e.absolute_path))


def _export(tmp_path, family: str, **kw) -> dict:
    _, d = tiny(family, **kw)
    M.save_drafter(d, tmp_path, dtype=torch.bfloat16)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("family", ["dflash", "dflash2"])
def test_export_validates_but_for_the_engines_architecture(tmp_path, family):
    cfg = _export(tmp_path, family, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    errors = _errors(cfg)
    assert [list(e.absolute_path) for e in errors] == [["architectures", 0]], [e.message for e in errors]
    assert cfg["architectures"] == [FR.get(family).architecture]  # what the engines' registries dispatch on
    assert _errors({**cfg, "architectures": ["DflashDraftModel"]}) == []
    spec = cfg["speculative_config"]
    assert spec["method"] == "dflash" and spec["speculative_tokens"] == 3  # B − 1 drafts of a block of 4
    assert spec["target_layer_ids"] == cfg["dflash_config"]["target_layer_ids"] and spec["target_layer_start_idx"] == 0
    assert spec["mask_token_id"] == cfg["dflash_config"]["mask_token_id"] and spec["sample_from_anchor"] is False
    assert spec["sliding_window_non_causal"] is (family == "dflash2")  # DFlash2's sliding layers see the whole block


def test_dspark_says_its_own_method_and_drafts_from_the_anchor(tmp_path):
    """The DFlash schema is DFlash's alone (method const ``dflash``): a DSpark export names ``dspark``, B drafts
    and ``sample_from_anchor``, and the schema refuses exactly those two facts and the architecture."""
    cfg = _export(tmp_path, "dspark")
    spec = cfg["speculative_config"]
    assert (spec["method"], spec["speculative_tokens"], spec["sample_from_anchor"]) == ("dspark", 4, True)
    assert {tuple(e.absolute_path)[:2] for e in _errors(cfg)} == {
        ("architectures", 0),
        ("speculative_config", "method"),
    }


def test_the_derived_fields_are_not_read_back(tmp_path):
    """A re-export writes the fields from the config, not from what the file said (they cannot go stale)."""
    cfg = _export(tmp_path, "dflash")
    cfg["speculative_config"]["speculative_tokens"] = 99
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    back = FR.load_config(tmp_path)
    assert not hasattr(back, "speculative_config") and not hasattr(back, "open_spec_config_version")
    back.save(tmp_path / "again", dtype="bfloat16")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["speculative_config"]["speculative_tokens"] == 3
