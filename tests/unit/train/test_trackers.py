"""Trackers (trackers.py) and FSDP sizing/config (fsdp.py): pure parts. The trainer runs with both in
tests/unit/train/test_train_scale.py."""

import pytest

from dflash_pipeline.train import fsdp
from dflash_pipeline.train.trackers import flat_hparams, resolve_trackers, scalars


def test_tensorboard_used_when_installed_else_a_note():
    use, notes = resolve_trackers(["tensorboard"], env={}, installed=lambda m: m == "tensorboard")
    assert use == ["tensorboard"] and notes == []
    use, notes = resolve_trackers(["tensorboard"], env={}, installed=lambda m: False)
    assert use == [] and "not installed" in notes[0] and ".[trackers]" in notes[0]


def test_wandb_only_when_installed_and_configured():
    yes = lambda m: True  # noqa: E731
    assert resolve_trackers(["wandb"], env={}, installed=yes)[0] == []  # no key, no offline mode
    assert resolve_trackers(["wandb"], env={"WANDB_API_KEY": "k"}, installed=yes)[0] == ["wandb"]
    assert resolve_trackers(["wandb"], env={"WANDB_MODE": "offline"}, installed=yes)[0] == ["wandb"]
    assert resolve_trackers(["wandb"], env={"WANDB_API_KEY": "k", "WANDB_MODE": "disabled"}, installed=yes)[0] == []
    assert resolve_trackers(["wandb"], env={"WANDB_API_KEY": "k"}, installed=lambda m: False)[0] == []
    assert resolve_trackers(["trackio"], env={}, installed=yes)[0] == ["trackio"]
    with pytest.raises(ValueError, match="unknown tracker 'mlflow'"):
        resolve_trackers(["mlflow"], env={})


def test_flat_hparams_and_scalars():
    flat = flat_hparams({"loss": "kl", "kl": {"temperature": 2.0}, "loss_gamma": None, "ids": [1, 2], "packing": True})
    assert flat == {"loss": "kl", "kl.temperature": 2.0, "loss_gamma": "null", "ids": "[1, 2]", "packing": True}
    s = scalars(
        {"step": 5, "tau": 2.5, "per_position_acceptance": [0.5, 0.25], "slot_acc": [0.0, 0.7], "ok": True}, "val"
    )
    assert s == {
        "val/tau": 2.5,
        "val/per_position_acceptance/1": 0.5,
        "val/per_position_acceptance/2": 0.25,
        "val/slot_acc/0": 0.0,
        "val/slot_acc/1": 0.7,
    }


def test_fsdp_sizing_and_plugin():
    # a ~3.25B-parameter drafter: 52 GB of fp32 weights + grads + Adam under DDP, 6.5 GB per rank over 8
    assert fsdp.training_bytes(3_250_000_000) == 52_000_000_000
    assert fsdp.training_bytes(3_250_000_000, num_shards=8) == 6_500_000_000
    p = fsdp.fsdp_plugin(reshard_after_forward=False)
    assert p.fsdp_version == 2 and p.transformer_cls_names_to_wrap == ["DFlashDecoderLayer"]  # FSDP2: DFlash only
    assert p.reshard_after_forward is False and "SHARDED" in str(p.state_dict_type)
