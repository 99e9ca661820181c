"""Scale knobs of the trainer: gradient checkpointing of the draft layers (the same losses and weights, bit for
bit, in fp32 on CPU) and the Muon optimizer (Muon on the 2-D matrices, AdamW on the rest, one optimizer).
Muon's exact resume, DDP and FSDP2 runs are settings of tests/unit/train/test_resume.py."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import counting_train_setup

from dflash_pipeline.drafter import build as DB
from dflash_pipeline.train import optim as OPT
from dflash_pipeline.train.run import train

CFG = {
    "num_processes": 1,
    "epochs": 1,
    "batch_size": 4,
    "learning_rate": 2e-3,
    "num_anchors": 8,
    "seed": 0,
    "save_every_steps": 1000,
    "log_every_steps": 1,
    "validation_fraction": 0.0,
    "trackers": [],
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return counting_train_setup(
        tmp_path_factory.mktemp("knobs"), min_len=20, max_position_embeddings=128, unsupervised_record=5
    )


def _train(setup, out, **over) -> list[float]:
    root, probe = setup
    train(
        token_shards=[root / "tokens.parquet"],
        probe=probe,
        target_dir=root / "target",
        out_dir=out,
        cfg={**CFG, **over},
        device="cpu",
    )
    return [json.loads(x)["loss"] for x in (out / "train_log.jsonl").read_text().splitlines()]


def test_gradient_checkpointing_gives_bit_identical_losses_and_weights(setup, tmp_path):
    plain = _train(setup, tmp_path / "plain")
    ckpt = _train(setup, tmp_path / "ckpt", gradient_checkpointing=True)
    assert len(plain) == 6 and plain == ckpt  # floats compared exactly
    assert (tmp_path / "plain" / "final" / "model.safetensors").read_bytes() == (
        tmp_path / "ckpt" / "final" / "model.safetensors"
    ).read_bytes()


def test_gradient_checkpointing_recomputes_the_layers_in_backward(setup):
    """Each draft layer runs twice per training step with checkpointing (forward, then recompute), once without."""
    root, probe = setup
    from transformers import AutoConfig

    from dflash_pipeline.train.data import ConfigOnly

    drafter = DB.build_drafter(ConfigOnly(AutoConfig.from_pretrained(root / "target")), probe)
    calls = []
    drafter.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    b, q, h = 1, drafter.block_size, drafter.config.hidden_size
    k = len(drafter.target_layer_ids)
    args = (torch.randn(b, q, h), torch.randn(b, 5, k * h), torch.arange(5)[None], torch.arange(5, 5 + q)[None])
    for on, runs in ((False, 1), (True, 2)):
        calls.clear()
        drafter.gradient_checkpointing = on
        drafter(*args).sum().backward()
        assert len(calls) == runs
    calls.clear()
    drafter.eval()
    with torch.no_grad():  # inference never checkpoints
        drafter(*args)
    assert len(calls) == 1


def test_muon_trains_the_matrices_and_adamw_the_rest(setup, tmp_path):
    losses = _train(setup, tmp_path, optimizer="muon", epochs=2)
    assert len(losses) == 12 and losses[-1] < losses[0]
    root, probe = setup
    from accelerate.utils import set_seed  # noqa: F401 - the state is Accelerate's

    saved = torch.load(tmp_path / "state" / "optimizer.bin", weights_only=False)
    groups = saved["param_groups"]
    assert [g["use_muon"] for g in groups] == [True, False]
    n_muon = len(groups[0]["params"])
    assert n_muon and all("momentum_buffer" in saved["state"][i] for i in groups[0]["params"])
    assert all("exp_avg" in saved["state"][i] for i in groups[1]["params"])
    drafter = DB.load_drafter(tmp_path / "final")
    matrices, rest = OPT.muon_parameters(drafter)
    assert len(matrices) == n_muon and all(p.ndim == 2 for p in matrices) and all(p.ndim == 1 for p in rest)


def test_muon_state_round_trips_through_state_dict():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 2))
    opt = OPT.make_optimizer(net, "muon", lr=1e-2, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    x = torch.randn(3, 4)

    def step():
        net(x).square().sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()

    step()
    twin = OPT.make_optimizer(net, "muon", lr=1e-2, weight_decay=0.0)
    twin.load_state_dict(opt.state_dict())
    assert twin._muon.state is twin.state and twin._muon.param_groups[0] is twin.param_groups[0]
    assert [g["lr"] for g in twin.param_groups] == [5e-3, 5e-3]  # the scheduler's lr travels with the groups
    with pytest.raises(ValueError, match="muon needs 2-D"):
        OPT.make_optimizer(torch.nn.LayerNorm(3), "muon", lr=1e-2, weight_decay=0.0)


def test_new_keys_at_their_default_rerun_and_restart_nothing():
    """The train rule's params leave the new keys out at their default (an upgraded results directory reruns no
    training), and a state saved before the keys existed is this run's state (a killed run resumes)."""
    from dflash_pipeline.core.config import schema_defaults
    from dflash_pipeline.train.checkpoint import NOT_RUN_IDENTITY, _changed_parts
    from dflash_pipeline.workflow.policy import without_new_defaults

    train = schema_defaults("train")
    new = ("optimizer", "gradient_checkpointing", "loss_chunk_tokens")
    assert not set(new) & set(without_new_defaults("train", train))
    assert without_new_defaults("train", {**train, "optimizer": "muon"})["optimizer"] == "muon"
    assert {"gradient_checkpointing", "loss_chunk_tokens", "device_memory_gb"} <= NOT_RUN_IDENTITY
    old = {"train": {"epochs": 6}}
    assert _changed_parts(old, {"train": {"epochs": 6, "optimizer": "adamw"}}) == []
    assert _changed_parts(old, {"train": {"epochs": 6, "optimizer": "muon"}}) == ["train.optimizer"]
