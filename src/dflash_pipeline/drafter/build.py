"""A drafter of any family (`drafter.families`), freshly initialised from the target
(`build_drafter`) or loaded from an export (`load_drafter`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from dflash_pipeline.drafter import families as FR
from dflash_pipeline.drafter.model import DFlashDrafter
from dflash_pipeline.target.loading import text_config


def build_drafter(
    target,
    probe: dict,
    *,
    seed: int = 0,
    layer_types=None,
    sliding_window=None,
    family: Optional[str] = None,
    family_settings: Optional[dict] = None,
) -> "DFlashDrafter":
    """Random-init float32 drafter sized from `target.config` (its text config) and the probe's drafter decisions;
    `layer_types`/`sliding_window`: optional sliding-window draft layers (config `drafter.*`).
    `family`/`family_settings`: `drafter.family` (None: the default) and its `drafter.<family>` section; `seed` seeds
    the init."""
    d = probe["drafter"]
    fam = FR.get(family)
    cfg = fam.config_class.from_target(
        text_config(target.config),
        block_size=d["block_size"],
        num_draft_layers=d["num_draft_layers"],
        target_layer_ids=d["target_layer_ids"],
        mask_token_id=d["mask_token_id"],
        layer_types=layer_types,
        sliding_window=sliding_window,
    )
    cfg = fam.make_config(cfg, family_settings)
    torch.manual_seed(seed)
    return fam.build(cfg)


def load_drafter(
    ckpt_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> DFlashDrafter:
    """Load a drafter written by `save_drafter` (or any unprefixed DFlash checkpoint) in `dtype`; its config is
    `DFlashConfig.from_checkpoint` of its family's config class.

    Raises:
        FileNotFoundError / ValueError: no or a malformed `config.json` (`DFlashConfig.from_checkpoint`);
            ValueError: tensors missing from or unexpected in `model.safetensors`.
    """
    from safetensors.torch import load_file

    ckpt = Path(ckpt_dir)
    cfg = FR.load_config(ckpt)
    drafter = FR.of_config(cfg).build(cfg)
    state = load_file(str(ckpt / "model.safetensors"))
    state = {k.removeprefix("model."): v for k, v in state.items()}
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("rotary_emb.")]
    if missing or unexpected:
        raise ValueError(f"{ckpt}/model.safetensors: missing {missing}, unexpected {unexpected}")
    return drafter.to(device=device, dtype=dtype)
