"""The features stage on CPU: feature shard format, hf extraction = the online features, resume after
kill -9, embedding / LM-head lookup, and training from feature shards without the target."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_pipeline.core.contracts import TOKEN_SCHEMA
from dflash_pipeline.core.shards import table_from_records, write_parquet
from dflash_pipeline.features import FeatureLayout, FeatureShard, FeatureShardError, FeatureShardWriter, bytes_per_token
from dflash_pipeline.features.extract import extract_shard, read_token_arrays
from dflash_pipeline.features.weights import find_embed_and_head_keys, load_embed_and_head

LAYERS = [1, 2]
FEATURES_CFG = {"backend": "hf", "dtype": "bfloat16", "last_hidden": True, "chunk_tokens": 64}
TRAIN_CFG = {
    "num_processes": 1,
    "epochs": 2,
    "batch_size": 4,
    "learning_rate": 2e-3,
    "warmup_ratio": 0.1,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "num_anchors": 8,
    "loss_gamma": None,
    "mixed_precision": "no",
    "seed": 0,
    "save_every_steps": 1000,
    "log_every_steps": 1,
    "trace_batches": False,
}


def token_shard(path: Path, n: int, seed: int, lo: int = 20, hi: int = 40) -> Path:
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        k = int(rng.integers(lo, hi))
        start = int(rng.integers(0, 78))
        ids = [(start + j) % 78 for j in range(k)]
        mask = [0] * (k // 2) + [1] * (k - k // 2)
        if i == 3:
            mask = [0] * k  # no supervised token: kept in the feature shard, skipped by the trainer
        recs.append(
            {
                "prompt_id": f"p{seed}-{i}",
                "input_ids": ids,
                "loss_mask": mask,
                "num_tokens": k,
                "num_loss_tokens": sum(mask),
                "truncated": False,
                "turn": 0,
            }
        )
    write_parquet(path, table_from_records(recs, TOKEN_SCHEMA))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("features")
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=80,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    target = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        target.lm_head.weight.mul_(40.0)
    target.save_pretrained(root / "target")
    token_shard(root / "a.parquet", 24, 0)
    token_shard(root / "b.parquet", 10, 1)
    probe = {
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "tie_word_embeddings": False,
        "drafter": {"block_size": 4, "num_draft_layers": 1, "target_layer_ids": LAYERS, "mask_token_id": 79},
    }
    (root / "probe.json").write_text(json.dumps(probe))
    return root, probe, target


def extract(root, token, out, **kw):
    args = dict(
        target_dir=root / "target",
        target_layer_ids=LAYERS,
        hidden_size=32,
        num_hidden_layers=4,
        backend="hf",
        dtype="bfloat16",
        last_hidden=True,
        chunk_tokens=64,
    )
    args.update(kw)
    return extract_shard(token, out, **args)


def test_bytes_per_token_kimi():
    assert bytes_per_token(5, 7168, "bfloat16") == 5 * 7168 * 2 + 5  # ≈ 72 KB (issue 15)
    assert bytes_per_token(5, 7168, "float8_e4m3") == 5 * 7168 + 4 * 5 + 5  # a scale per token per layer


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 1 / 128), ("float8_e4m3", 1 / 8)])
def test_format_roundtrip_and_safetensors_compatible(tmp_path, dtype, tol):
    lengths = np.array([3, 0, 5])
    ids = np.arange(8, dtype=np.int32)
    mask = np.array([0, 1, 1, 1, 1, 0, 1, 1], np.uint8)
    lay = FeatureLayout(lengths, 2, 4, dtype, True, {"schema_version": 1, "dtype": dtype})
    w = FeatureShardWriter(tmp_path / "f.safetensors", lay, ids, mask)
    xs = [torch.randn(int(n), 8) * 10 for n in lengths]
    ls = [torch.randn(int(n), 4) for n in lengths]
    for r in (0, 2):
        w.write(r, xs[r], ls[r])
    w.commit(3)
    w.finish()
    fs = FeatureShard(tmp_path / "f.safetensors")
    assert list(fs.offsets) == [0, 3, 3, 8] and list(fs.num_loss_tokens) == [2, 0, 4]
    for r in (0, 2):
        rel = ((fs.features(r).float() - xs[r]).abs().amax(-1) / xs[r].abs().amax(-1)).max()
        assert rel <= tol, rel
    assert fs.features(1).shape == (0, 8)
    np.testing.assert_array_equal(fs.tokens(2)[0], ids[3:])
    with safe_open(str(tmp_path / "f.safetensors"), "pt") as fh:  # any safetensors reader opens it
        assert fh.get_tensor("features").shape == (8, 8)
        assert json.loads(fh.metadata()["dflash"])["dtype"] == dtype


def test_hf_features_equal_online_features(setup, tmp_path):
    """The stored features are the online path's ``target_features`` (train.py), rounded to bf16."""
    from dflash_pipeline.target.hidden import target_features

    root, probe, target = setup
    extract(root, root / "a.parquet", tmp_path / "a.safetensors")
    fs = FeatureShard(tmp_path / "a.safetensors")
    fs.check_tokens(root / "a.parquet")
    ids, _, lengths = read_token_arrays(root / "a.parquet")
    worst = 0.0
    for r in range(len(fs)):
        x = torch.from_numpy(fs.tokens(r)[0].astype(np.int64))[None]
        with torch.no_grad():
            online, out = target_features(target, x, None, LAYERS)
        ref = online[0].to(torch.bfloat16).float()
        worst = max(worst, (fs.features(r).float() - ref).abs().max().item())
        with torch.no_grad():  # last_hidden is the last layer's output before the final norm
            normed = target.model.norm(fs.last_hidden(r).float())
        assert torch.allclose(normed, out.hidden_states[-1][0], atol=0.05, rtol=0.02)
    print(f"hf feature shard vs online target_features: max abs diff {worst:.3g}")
    assert worst <= 1e-2


def test_mismatched_token_shard_is_named(setup, tmp_path):
    root, _, _ = setup
    extract(root, root / "b.parquet", tmp_path / "b.safetensors")
    fs = FeatureShard(tmp_path / "b.safetensors")
    with pytest.raises(FeatureShardError, match=r"b\.safetensors: 10 records, token shard .*a\.parquet has 24"):
        fs.check_tokens(root / "a.parquet")


def test_kill9_mid_shard_resumes(setup, tmp_path):
    """kill -9 of an extraction mid-shard: the finished shard is untouched, the rerun continues after the
    last committed record and writes the same bytes as an uninterrupted run."""
    root, _, _ = setup
    big = token_shard(tmp_path / "big.parquet", 160, 7, lo=200, hi=400)
    done = tmp_path / "done.safetensors"
    extract(root, root / "b.parquet", done)
    before = (done.stat().st_mtime_ns, done.read_bytes())
    out = tmp_path / "big.safetensors"
    cmd = [
        sys.executable,
        "-m",
        "dflash_pipeline.features",
        "extract",
        "--probe",
        str(root / "probe.json"),
        "--target",
        str(root / "target"),
        "--token-shard",
        str(big),
        "--out",
        str(out),
        "--features-config",
        json.dumps(dict(FEATURES_CFG, chunk_tokens=300)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    progress = out.with_name(f".{out.name}.progress")
    deadline = time.monotonic() + 120
    committed = 0
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            committed = json.loads(progress.read_text())["records_done"]
        except (OSError, ValueError, KeyError):
            committed = 0
        if committed >= 5:
            break
        time.sleep(0.01)  # polling a condition, not a sync
    assert proc.poll() is None, "extraction finished before it could be killed: " + proc.stdout.read().decode()[-2000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists() and progress.exists()
    stats = extract(root, big, out, chunk_tokens=300)
    assert 5 <= stats["resumed_from"] < 160
    assert (done.stat().st_mtime_ns, done.read_bytes()) == before
    clean = tmp_path / "clean.safetensors"
    extract(root, big, clean, chunk_tokens=300)
    assert out.read_bytes() == clean.read_bytes()
    assert not progress.exists()


@pytest.mark.parametrize(
    "prefix,tied", [("model.", False), ("model.language_model.", False), ("language_model.model.", True)]
)
def test_embed_and_head_keys_with_prefixes(tmp_path, prefix, tied):
    emb = torch.randn(50, 8)
    tensors = {
        f"{prefix}embed_tokens.weight": emb,
        f"{prefix}layers.0.mlp.weight": torch.randn(2, 2),
        "model.visual.patch_embed.weight": torch.randn(3, 3),
        "mtp.embed_tokens.weight": torch.randn(50, 8),
    }
    head_key = (
        prefix.replace("model.", "", 1) + "lm_head.weight"
        if prefix.startswith("model.")
        else prefix.replace("model.", "") + "lm_head.weight"
    )
    if not tied:
        tensors[head_key] = torch.randn(50, 8)
    save_file(tensors, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "model-00001-of-00001.safetensors" for k in tensors}})
    )
    e, h = find_embed_and_head_keys(tmp_path)
    assert e == f"{prefix}embed_tokens.weight" and h == (None if tied else head_key)
    embed, lm_head = load_embed_and_head(tmp_path, dtype=torch.float32)
    assert torch.equal(embed.weight, emb)
    assert torch.equal(lm_head.weight, emb if tied else tensors[head_key])
    assert not embed.weight.requires_grad and not lm_head.weight.requires_grad


def test_train_from_shards_never_loads_target_and_matches_online(setup, tmp_path, monkeypatch):
    """Same data, same seed: training from feature shards ends where online training ends (bf16 features
    vs fp32), and never instantiates the target."""
    import transformers

    from dflash_pipeline.train.run import train

    root, probe, _ = setup
    fa, fb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    extract(root, root / "a.parquet", fa)
    extract(root, root / "b.parquet", fb)
    tokens = [root / "a.parquet", root / "b.parquet"]
    online = train(
        token_shards=tokens,
        probe=probe,
        target_dir=root / "target",
        out_dir=tmp_path / "online",
        cfg=dict(TRAIN_CFG, target_features="online"),
    )

    def refuse(*a, **k):
        raise AssertionError("the target was instantiated")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    shards = train(
        token_shards=tokens,
        feature_shards=[fa, fb],
        probe=probe,
        target_dir=root / "target",
        out_dir=tmp_path / "shards",
        cfg=dict(TRAIN_CFG, target_features="shards"),
    )
    assert shards["records"] == online["records"] == 32 and shards["steps"] == online["steps"]
    logs = {
        k: [json.loads(x) for x in (tmp_path / k / "train_log.jsonl").read_text().splitlines()]
        for k in ("online", "shards")
    }
    lo, ls = [r["loss"] for r in logs["online"]], [r["loss"] for r in logs["shards"]]
    print(f"final loss online {lo[-1]:.4f} shards {ls[-1]:.4f}")
    assert lo[-1] < lo[0] and ls[-1] < ls[0]
    assert abs(lo[-1] - ls[-1]) <= 0.05 * lo[-1]
    assert abs(lo[0] - ls[0]) <= 1e-2 * lo[0]


def test_online_token_index_equals_token_shards(setup, tmp_path):
    """The online path's memory-mapped token index yields exactly the token shard's records."""
    import pyarrow.parquet as pq

    from dflash_pipeline.train.data import open_training_data

    root, probe, _ = setup
    data = open_training_data(
        {"target_features": "online"},
        [root / "a.parquet", root / "b.parquet"],
        [],
        target_dir=root / "target",
        out_dir=tmp_path,
        probe=probe,
        device="cpu",
    )
    rows = []
    for p in ("a.parquet", "b.parquet"):
        t = pq.read_table(root / p)
        rows += [
            (i, m) for i, m in zip(t.column("input_ids").to_pylist(), t.column("loss_mask").to_pylist()) if sum(m) >= 2
        ]
    assert len(data.dataset) == len(rows) == 32
    for k, (i, m) in enumerate(rows):
        got_i, got_m = data.dataset[k]
        assert got_i.tolist() == i and got_m.tolist() == m


@pytest.mark.parametrize("name", ["kimi-k2.6.yaml", "qwen3.6-27b.yaml"])
def test_example_recipes_validate(name):
    import yaml

    from dflash_pipeline.core.config import schema_problems

    cfg = yaml.safe_load((Path(__file__).resolve().parents[3] / "config" / "examples" / name).read_text())
    assert schema_problems(cfg) == []
    stream = cfg["features"]["stream"]
    assert cfg["train"]["target_features"] == "stream" and cfg["generation"]["thinking"] == "save"
    if name == "kimi-k2.6.yaml":  # remote: serving nodes + an 8-GPU trainer node
        assert len(stream["endpoints"]) == 2 and cfg["train"]["num_processes"] == 8
    else:  # colocated: 2 servers x TP2 + 4 trainer GPUs in one 8-GPU job
        assert stream["backend"] == "vllm" and stream["servers"] * stream["gpus_per_server"] == 4
        assert cfg["train"]["num_processes"] == 4


def test_plan_states_bytes_and_fails_when_disk_short(tmp_path):
    from dflash_pipeline.features.plan import plan_features

    (tmp_path / "tokens" / "d").mkdir(parents=True)
    token_shard(tmp_path / "tokens" / "d" / "00000.parquet", 10, 0)
    n = int(read_token_arrays(tmp_path / "tokens" / "d" / "00000.parquet")[2].sum())
    plan = plan_features(
        num_layers=5,
        hidden_size=7168,
        dtype="bfloat16",
        last_hidden=False,
        results_dir=tmp_path,
        shards=[("d", "00000"), ("d", "00001")],
        max_length=100,
        prompt_counts={("d", "00000"): 10, ("d", "00001"): 10},
    )
    assert plan.bytes_per_token == 71_685 and plan.tokens_kind == "estimated" and plan.tokens == 2 * n
    assert "71,685 B/token" in plan.describe() and plan.shortfall(0.0) is None
    assert "only" in plan.shortfall(1.0)  # asking for the whole filesystem free cannot be met
    plan = plan_features(
        num_layers=5,
        hidden_size=7168,
        dtype="bfloat16",
        last_hidden=False,
        results_dir=tmp_path,
        shards=None,
        max_length=100,
    )
    assert plan.tokens is None and plan.shortfall(1.0) is None and "after the prompts checkpoint" in plan.describe()
