"""`snakemake -n` on the Kimi K2.6 recipe (train.target_features: stream) with a K2.6-shaped target
directory (Kimi-K2.5's config.json from the model corpus: hidden 7168, 61 layers, MLA; no weights): the
plan states the stream (servers, trainer ranks, window against free disk) and one training step's device memory
per rank, plans no feature extraction, and refuses a window the scratch filesystem cannot hold or a step over
train.device_memory_gb."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from conftest import REPO, planned_jobs, snakemake


def _kimi_config(tmp_path: Path, real_models_dir: Path, **stream) -> Path:
    target = tmp_path / "Kimi-K2.6"
    target.mkdir(exist_ok=True)
    shutil.copy(real_models_dir / "Kimi-K2.5" / "config.json", target / "config.json")
    if not (target / "tokenizer.json").is_file():  # the tokens stage's tokenizer check (a tiny stand-in)
        from dflash_pipeline.testing import zoo

        template = (real_models_dir / "Kimi-K2-Thinking" / "chat_template.jinja").read_text()
        zoo.family_tokenizer(template, REPO / "data/gsm8k/train.jsonl").save_pretrained(target)
    cfg = yaml.safe_load((REPO / "config/examples/kimi-k2.6.yaml").read_text())
    cfg["target"]["path"] = str(target)
    cfg["datasets"] = {"gsm8k": {"path": str(REPO / "data/gsm8k/train.jsonl"), "max_prompts": 4}}
    for s in cfg["eval"]["sets"].values():
        s["path"] = str(REPO / s["path"])
    cfg["eval"]["engine_base_url"] = "http://kimi-eval:8000/v1"  # a served drafter, not a local vLLM env
    cfg["features"]["stream"].update(scratch_dir=str(tmp_path / "scratch"), **stream)
    path = tmp_path / "kimi.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _plan(tmp_path: Path, conf: Path):
    """`snakemake -n` of the recipe's final checkpoint (the eval and feature servers' keys from the
    environment, as users set them)."""
    import os

    return snakemake(
        tmp_path,
        "-n",
        "results/checkpoints/kimi-k2.6-b16/final",
        configfile=conf,
        env={**os.environ, "KIMI_API_KEY": "test-key", "VLLM_API_KEY": "test-key"},
    )


def test_kimi_recipe_plans_the_stream_not_the_dataset(tmp_path, real_models_dir):

    conf = _kimi_config(tmp_path, real_models_dir)
    proc = _plan(tmp_path, conf)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    line = next(x for x in out.splitlines() if x.startswith("[plan] stream:"))
    # 4 batches x 4 x 8192 tokens x 5 x 7168 x 2 B = 9.4 GB, capped by max_inflight_bytes: 4 GiB = 4.3 GB
    assert "2 remote endpoint(s)" in line and "8 trainer rank(s)" in line, line
    assert "window 4.3 GB per rank" in line and "cap 4.3 GB" in line and "no feature shards" in line, line
    assert "in feature shards" not in out  # the shards path's 172 TB line is not printed
    mem = next(x for x in out.splitlines() if x.startswith("[plan] device memory:"))
    assert "peak per trainer rank" in mem and "512 anchors x block 16, 5 draft layers" in mem, mem
    assert "gradient checkpointing on (saves" in mem and "muon" in mem, mem
    jobs = planned_jobs(proc)
    assert "extract_features" not in jobs and jobs.get("train_drafter") == 1


def test_plan_refuses_a_step_over_the_device_memory_and_names_the_knobs(tmp_path, real_models_dir):
    conf = _kimi_config(tmp_path, real_models_dir)
    cfg = yaml.safe_load(conf.read_text())
    cfg["train"].update(device_memory_gb=40, gradient_checkpointing=False)
    conf.write_text(yaml.safe_dump(cfg))
    proc = _plan(tmp_path, conf)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "train.device_memory_gb: one training step needs" in out and "above the 40 GB set" in out, out[-3000:]
    assert "train.gradient_checkpointing: true" in out and "train.num_anchors" in out and "train.fsdp" in out


def test_plan_refuses_a_window_the_scratch_cannot_hold(tmp_path, real_models_dir):

    conf = _kimi_config(tmp_path, real_models_dir, prefetch_batches=10**9, max_inflight_bytes=2**62)
    proc = _plan(tmp_path, conf)
    assert proc.returncode != 0
    assert "features.stream: the window needs" in proc.stdout + proc.stderr


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_plan_refuses_a_scratch_dir_servers_cannot_write(tmp_path, real_models_dir, where):
    """A scratch_dir with a file in the way, or on /proc (no disk), is refused at planning by name (it was
    planned, then failed the train job with a bare NotADirectoryError, or was reported as 0 B free)."""

    (tmp_path / "afile").write_text("x")
    scratch = {"under_a_file": tmp_path / "afile" / "scratch", "proc": Path("/proc/dflash-scratch")}[where]
    conf = _kimi_config(tmp_path, real_models_dir)
    cfg = yaml.safe_load(conf.read_text())
    cfg["features"]["stream"]["scratch_dir"] = str(scratch)
    conf.write_text(yaml.safe_dump(cfg))
    proc = _plan(tmp_path, conf)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    want = {
        "under_a_file": f"{tmp_path / 'afile'} is a file, not a directory",
        "proc": "/proc is not a writable directory",
    }
    assert f"features.stream.scratch_dir: {want[where]}" in out, out[-3000:]


def test_bytes_transport_plans_no_scratch_window(tmp_path, real_models_dir):
    """Remote servers that send the features in the answer body (transport: bytes) need no shared scratch: the
    plan neither checks nor prints a scratch filesystem, even for a window no disk holds."""

    conf = _kimi_config(tmp_path, real_models_dir, prefetch_batches=10**9, max_inflight_bytes=2**62)
    cfg = yaml.safe_load(conf.read_text())
    for e in cfg["features"]["stream"]["endpoints"]:
        e["transport"] = "bytes"
    conf.write_text(yaml.safe_dump(cfg))
    proc = _plan(tmp_path, conf)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    line = next(x for x in out.splitlines() if x.startswith("[plan] stream:"))
    assert "transport bytes: no shared scratch" in line and "scratch filesystem" not in line, line


def test_train_job_names_a_scratch_dir_it_cannot_create(tmp_path):
    """At run time (a scratch_dir the plan did not see, e.g. given through the job's stream config) the error
    names features.stream.scratch_dir and the reason, not a bare NotADirectoryError."""
    from dflash_pipeline.train.stream import check_scratch

    (tmp_path / "afile").write_text("x")
    with pytest.raises(OSError, match=r"features.stream.scratch_dir .*afile/s: cannot be created \(Not a directory\)"):
        check_scratch(tmp_path / "afile" / "s", 1)
    assert check_scratch(tmp_path / "ok" / "s", 1) > 0 and (tmp_path / "ok" / "s").is_dir()


def test_kl_plans_with_the_last_layer_and_the_default_cache_stays_out_of_the_params(tmp_path, real_models_dir):
    """train.loss: kl is planned with stream (no refusal): the servers are asked for the last layer too
    (6 x 7168 x 2 B per token on the wire instead of 5 x); with features.stream.cache at its default the
    trainer's --stream-config carries no cache key (existing stream runs keep their params)."""
    import os

    conf = _kimi_config(tmp_path, real_models_dir)
    cfg = yaml.safe_load(conf.read_text())
    cfg["train"]["loss"] = "kl"
    conf.write_text(yaml.safe_dump(cfg))
    proc = snakemake(
        tmp_path,
        "-n",
        "-p",
        "results/checkpoints/kimi-k2.6-b16/final",
        configfile=conf,
        env={**os.environ, "KIMI_API_KEY": "test-key", "VLLM_API_KEY": "test-key"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    line = next(x for x in out.splitlines() if x.startswith("[plan] stream:"))
    assert f"x {6 * 7168 * 2:,} B" in line, line
    assert '"last_hidden": true' in out and '"cache"' not in out
