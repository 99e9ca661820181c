"""Exact resume: a run SIGKILLed at an arbitrary step and resumed from its last ``state/`` ends with the fp32
weights of an uninterrupted run, bit for bit (CPU), whether the resumed step is an epoch boundary or the
middle of an epoch: plain, packed, from feature shards, streamed from a feature server
(``target_features: stream``: a real hf ``features serve`` subprocess, which outlives the killed trainers), on
2 gloo ranks (DDP), under FSDP2 (with the Muon optimizer and gradient checkpointing) and with Muon alone.

Each setting trains 2 epochs of 6 optimizer steps, saving state every 2 steps. The killed run pauses after
step 7 and is SIGKILLed (its whole process group); the rerun resumes at step 6 (an epoch boundary), pauses
after step 9 and is SIGKILLed; the last rerun resumes at step 8 (mid-epoch) and finishes. Its final
``state/`` weights must equal those of one uninterrupted run. (Before exact resume, epoch 1 after a resume
replayed epoch 0's order, the batches skipped were those of another permutation and the anchor generator
restarted from its seed.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import FAST_FLEET, FeatureServer, counting_train_setup

from dflash_pipeline.core.procs import free_port
from dflash_pipeline.train.checkpoint import file_digest
from dflash_pipeline.workflow.policy import accelerate_launch_args

CFG = {
    "num_processes": 1,
    "epochs": 2,
    "batch_size": 4,
    "learning_rate": 5e-3,
    "warmup_ratio": 0.1,
    "num_anchors": 4,
    "seed": 3,
    "save_every_steps": 2,
    "log_every_steps": 1,
    "validation_fraction": 0.0,
    "trackers": [],
}
#: The steps after which the two killed runs stop: the first resumes at 6 (epoch boundary), the second at 8.
PAUSES = (7, 9)
STEPS_PER_EPOCH = 6

#: The training CLI, which stops (pauses) after optimizer step $RESUME_TEST_PAUSE_AT, once that step's
#: state save (if any) is done, and says so in ``<out>/paused.<rank>`` (its pid); the test then SIGKILLs it.
PAUSING_TRAIN = r"""
import os, signal, sys
from dflash_pipeline.train import loop as L

pause_at = int(os.environ.get("RESUME_TEST_PAUSE_AT", "0"))
after_step = L._after_step

def pausing_after_step(run, step, *args, **kwargs):
    window = after_step(run, step, *args, **kwargs)
    if step == pause_at:
        (run.out_dir / f"paused.{run.accelerator.process_index}").write_text(str(os.getpid()))
        signal.pause()  # until the test's SIGKILL
    return window

L._after_step = pausing_after_step
from dflash_pipeline.train.run import main

main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The counting target and token shard (23 trainable records: 6 steps per epoch at 4 per step), its
    feature shard, and the pausing training script."""
    from dflash_pipeline.features.extract import extract_shard

    root, probe = counting_train_setup(
        tmp_path_factory.mktemp("resume"), min_len=20, max_position_embeddings=128, unsupervised_record=5
    )
    probe = {**probe, "hidden_size": 32, "num_hidden_layers": 4, "tie_word_embeddings": False}
    (root / "probe.json").write_text(json.dumps(probe))
    extract_shard(
        root / "tokens.parquet",
        root / "features.safetensors",
        target_dir=root / "target",
        target_layer_ids=probe["drafter"]["target_layer_ids"],
        hidden_size=32,
        num_hidden_layers=4,
        backend="hf",
        dtype="bfloat16",
        last_hidden=False,
        chunk_tokens=256,
    )
    (root / "pausing_train.py").write_text(PAUSING_TRAIN)
    return root


@pytest.fixture(scope="module")
def feature_server(setup):
    """One hf feature server on the setup's target, serving the probe's layers, for the stream setting (only
    it asks for this fixture); killed at the module's end."""
    layers = json.loads((setup / "probe.json").read_text())["drafter"]["target_layer_ids"]
    server = FeatureServer(setup / "target", setup / "scratch", layers=layers, num_hidden_layers=4)
    yield server
    server.kill()


def _stream(server: FeatureServer) -> dict:
    """The stream settings of a run fed by ``server`` (path transport into its scratch directory)."""
    return {"endpoints": [{"base_url": server.url}], "scratch_dir": str(server.scratch), "fleet": FAST_FLEET}


def _env(pause_at: int = 0) -> dict:
    return {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "OMP_NUM_THREADS": "1",
        "RESUME_TEST_PAUSE_AT": str(pause_at),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def _command(root: Path, out: Path, cfg: dict, port: int, stream: dict | None = None) -> list[str]:
    args = [
        str(root / "pausing_train.py"),
        "--probe",
        str(root / "probe.json"),
        "--target",
        str(root / "target"),
        "--out-dir",
        str(out),
        "--train-config",
        json.dumps(cfg),
        "--device",
        "cpu",
    ]
    if cfg.get("target_features") == "shards":
        args += ["--feature-shard", str(root / "features.safetensors")]
    if stream is not None:
        args += ["--stream-config", json.dumps(stream)]
    args.append(str(root / "tokens.parquet"))
    if cfg["num_processes"] == 1:
        return [sys.executable, *args]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *accelerate_launch_args(cfg["num_processes"]),
        "--main_process_port",
        str(port),
        *args,
    ]


def _run(cmd: list[str], out: Path, pause_at: int = 0) -> str:
    """Run the training command in its own process group; with ``pause_at``, SIGKILL the group once every
    rank has paused after that step, and each rank's own (torch's launcher starts every rank in a session
    of its own). Returns its output."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"segment-{pause_at}.log"
    ranks = json.loads(cmd[cmd.index("--train-config") + 1])["num_processes"]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(pause_at), start_new_session=True)
        try:
            markers = [out / f"paused.{r}" for r in range(ranks)]
            while pause_at and not all(m.is_file() for m in markers):  # poll the files the ranks write
                assert proc.poll() is None, (
                    f"the run ended before pausing at step {pause_at}:\n{log.read_text()[-3000:]}"
                )
                time.sleep(0.05)
            if pause_at:
                groups = {os.getpgid(pid) for pid in [proc.pid] + [int(m.read_text()) for m in markers]}
                for group in groups:
                    os.killpg(group, signal.SIGKILL)
            rc = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    for m in out.glob("paused.*"):
        m.unlink()
    assert rc == (-signal.SIGKILL if pause_at else 0), text[-3000:]
    return text


def _weights(state: Path) -> dict[str, torch.Tensor]:
    """The fp32 drafter weights in a ``state/`` dir: ``model.safetensors``, or FSDP2's sharded checkpoint."""
    if (state / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(state / "model.safetensors")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    (sharded,) = [p for p in state.iterdir() if p.name.startswith("pytorch_model_fsdp")]
    dcp_to_torch_save(sharded, state / "full.pt")
    full = torch.load(state / "full.pt", weights_only=True)
    return full.get("model", full)


SETTINGS = {
    "plain": {},
    "packing": {"packing": True, "pack_max_tokens": 64, "batch_size": 1, "gradient_accumulation_steps": 2},  # 11 rows
    "shards": {"target_features": "shards"},
    "stream": {"target_features": "stream"},
    "ddp_2_ranks": {"num_processes": 2, "batch_size": 2},
    # FSDP2 with Muon's sharded momentum (AdamW's under FSDP2: tests/unit/train/test_train_scale.py) and the draft
    # layers recomputed in backward: one 2-rank setting for both, the slowest kind here
    "fsdp2_2_ranks_muon": {
        "num_processes": 2,
        "batch_size": 2,
        "fsdp": True,
        "optimizer": "muon",
        "gradient_checkpointing": True,
    },
    "muon": {"optimizer": "muon"},  # Muon's momentum (and AdamW's moments of the rest) in state/
}


def _in_process(root: Path, out: Path, cfg: dict, stream: dict | None = None) -> dict:
    """The run in this process on one thread, as the subprocesses run (``OMP_NUM_THREADS=1``: the same kernels,
    the same bits); a single-process run then needs no interpreter start for its uninterrupted and last runs."""
    from dflash_pipeline.train.run import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        shards = [root / "features.safetensors"] if cfg.get("target_features") == "shards" else []
        return train(
            token_shards=[root / "tokens.parquet"],
            probe=json.loads((root / "probe.json").read_text()),
            target_dir=root / "target",
            out_dir=out,
            cfg=cfg,
            device="cpu",
            feature_shards=shards,
            stream=stream,
        )
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_killed_and_resumed_run_ends_bit_identical(setup, tmp_path, capsys, request, setting):
    root = setup
    cfg = {**CFG, **SETTINGS[setting]}
    stream = _stream(request.getfixturevalue("feature_server")) if setting == "stream" else None
    port = free_port()
    one = cfg["num_processes"] == 1
    if one:
        _in_process(root, tmp_path / "whole", cfg, stream)
    else:
        _run(_command(root, tmp_path / "whole", cfg, port, stream), tmp_path / "whole")
    summary = json.loads((tmp_path / "whole" / "train_summary.json").read_text())
    assert summary["steps"] == 2 * STEPS_PER_EPOCH, summary
    killed = tmp_path / "killed"
    resumed_at = []
    for pause_at in (*PAUSES, 0):
        if one and not pause_at:  # the last, unkilled run
            capsys.readouterr()
            _in_process(root, killed, cfg, stream)
            text = capsys.readouterr().out
        else:
            text = _run(_command(root, killed, cfg, port, stream), killed, pause_at)
        m = re.search(r"resumed from .* at step (\d+)/", text)
        resumed_at.append(int(m.group(1)) if m else 0)
    assert resumed_at == [0, STEPS_PER_EPOCH, STEPS_PER_EPOCH + 2]  # an epoch boundary, then mid-epoch
    whole, ends = _weights(tmp_path / "whole" / "state"), _weights(killed / "state")
    assert whole.keys() == ends.keys() and whole
    differ = [k for k in whole if not torch.equal(whole[k], ends[k])]
    assert not differ, f"{len(differ)}/{len(whole)} tensors differ, e.g. {differ[:3]}"
    assert (tmp_path / "whole" / "final" / "model.safetensors").read_bytes() == (
        killed / "final" / "model.safetensors"
    ).read_bytes()


def _train_in_process(root: Path, out: Path, **over) -> dict:
    return _in_process(root, out, {**CFG, "save_every_steps": 1000, **over})


def test_state_saved_before_exact_resume_still_resumes_with_a_warning(setup, tmp_path, capsys):
    """A version 1 ``state/`` (what the trainer wrote before: no anchor streams, no ``version``) resumes at its
    step and says that the rest of the run is not the uninterrupted one; a newer version is refused."""
    root = setup
    _train_in_process(root, tmp_path, epochs=1)
    state = tmp_path / "state"
    streams = [p for p in state.glob("custom_checkpoint_*.pkl") if "world_size" in torch.load(p, weights_only=False)]
    meta = json.loads((state / "step.json").read_text())
    assert len(streams) == 1 and meta["step"] == 6 and meta["version"] == 2 and meta["run"]["train"]["epochs"] == 1
    streams[0].unlink()
    (state / "step.json").write_text(json.dumps({"step": 6}))
    capsys.readouterr()
    _train_in_process(root, tmp_path, epochs=2)
    out = capsys.readouterr().out
    assert "is a version 1 state" in out and "resumed from" in out and "at step 6/12" in out
    assert "saved by another run" not in out  # a version 1 state has no identity to compare
    steps = [json.loads(x)["step"] for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))
    meta = json.loads((state / "step.json").read_text())
    assert meta["step"] == 12 and meta["version"] == 2 and meta["world_size"] == 1  # saved in the new format
    (state / "step.json").write_text(json.dumps({"step": 12, "version": 99}))
    with pytest.raises(ValueError, match="state version 99 is newer"):
        _train_in_process(root, tmp_path, epochs=2)


def test_streams_of_another_world_size_are_refused():
    """Per-rank anchor streams saved by 2 ranks cannot continue on 1: a clear error, not a silent reseed."""
    from dflash_pipeline.train.rng import RankStreams

    g = [torch.Generator().manual_seed(s) for s in (0, 1)]
    saved = {"world_size": 2, "ranks": [{"anchors": x.get_state()} for x in g]}
    one = RankStreams({"anchors": torch.Generator()}, rank=0, world_size=1)
    with pytest.raises(ValueError, match="saved by 2 rank"):
        one.load_state_dict(saved)
    second = RankStreams({"anchors": torch.Generator()}, rank=1, world_size=2)
    second.load_state_dict(saved)
    assert torch.equal(second.generators["anchors"].get_state(), g[1].get_state())  # rank 1 continues rank 1's stream


def test_a_state_of_another_run_is_set_aside_and_training_starts_over(setup, tmp_path, capsys):
    """A rule reruns because its settings or data changed: the state of the old run is not resumed (that would
    export the old run's weights under the new settings). It moves to ``state.previous/`` and the run is the
    one its settings give from step 0; an unchanged rerun (or one that changes only how often it logs) resumes."""
    from safetensors.torch import load_file

    root = setup
    _train_in_process(root, tmp_path / "fresh", epochs=1, learning_rate=1e-3)
    _train_in_process(root, tmp_path / "rerun", epochs=1)
    capsys.readouterr()
    _train_in_process(root, tmp_path / "rerun", epochs=1, learning_rate=1e-3)  # train.learning_rate changed
    out = capsys.readouterr().out
    assert "was saved by another run (train.learning_rate differ): starting from step 0" in out, out
    assert "resumed from" not in out
    assert json.loads((tmp_path / "rerun" / "state.previous" / "step.json").read_text())["step"] == 6
    a = load_file(tmp_path / "fresh" / "final" / "model.safetensors")
    b = load_file(tmp_path / "rerun" / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the run of the new settings, not the old weights
    steps = [json.loads(x)["step"] for x in (tmp_path / "rerun" / "train_log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))
    capsys.readouterr()
    _train_in_process(root, tmp_path / "rerun", epochs=1, learning_rate=1e-3, log_every_steps=3)
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 6/6" in out and "another run" not in out
    shard = root / "tokens.parquet"
    meta = json.loads((tmp_path / "rerun" / "state" / "step.json").read_text())
    assert meta["run"]["token_shards"] == [file_digest(shard)] and "log_every_steps" not in meta["run"]["train"]
