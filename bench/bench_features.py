"""Feature shards: trainer peak RSS as the dataset grows, and feature extraction tokens/s per backend.

1. RSS. Token + feature shards at 1x, 10x, 100x the base token count (synthetic, written with the feature
   shard writer). Each size runs in a fresh process:
   - ``shards``: ``train()`` with ``train.target_features: shards`` for a fixed number of steps (the target
     is never loaded), and a full pass of the DataLoader over every record (features included);
   - baseline, same run: the old ``train.load_token_shards`` (every record as Python/numpy objects), the
     token loading a rank paid before this stage.
   Peak RSS (``VmHWM``) per size and the 100x / 1x ratio of each.
2. Extraction tokens/s of the ``hf`` backend (in-process) and the ``vllm`` backend (the vLLM venv, one engine
   start) on the same token shard and tiny target; engine start-up is excluded (``extract_seconds``).

    python bench/bench_features.py                  # both parts (vLLM part skipped without a vLLM venv)
    python bench/bench_features.py --skip-vllm --base-records 200 --seq 256
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def make_target(root: Path, hidden: int, head_dim: int | None = None) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=4,
        num_attention_heads=hidden // (head_dim or hidden // 4),
        num_key_value_heads=2,
        head_dim=head_dim or hidden // 4,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(root / "target")
    return root / "target"


def make_shards(
    root: Path, records: int, seq: int, hidden: int, layers=(1, 2), per_shard: int = 10000
) -> tuple[list, list]:
    """Token shards + matching feature shards with random features (what extraction would write)."""
    import torch

    from dflash_pipeline.core.contracts import FEATURE_SCHEMA_VERSION, TOKEN_SCHEMA
    from dflash_pipeline.features.extract import read_token_arrays
    from dflash_pipeline.features.format import FeatureLayout, FeatureShardWriter, sha256_file
    from dflash_pipeline.core.shards import write_parquet

    import pyarrow as pa

    rng = np.random.default_rng(0)
    toks, feats = [], []
    for s in range(0, records, per_shard):
        n = min(per_shard, records - s)
        lengths = rng.integers(seq // 2, seq, n)
        off = np.r_[0, np.cumsum(lengths)].astype(np.int32)
        flat_ids = rng.integers(0, 500, int(off[-1])).astype(np.int32)
        pos = np.arange(int(off[-1])) - np.repeat(off[:-1], lengths)
        flat_mask = (pos >= np.repeat(lengths // 2, lengths)).astype(np.uint8)
        nl = (lengths - lengths // 2).astype(np.int32)
        table = pa.table(
            {
                "prompt_id": pa.array([f"{s + i}" for i in range(n)]),
                "input_ids": pa.ListArray.from_arrays(pa.array(off), pa.array(flat_ids)),
                "loss_mask": pa.ListArray.from_arrays(pa.array(off), pa.array(flat_mask)),
                "num_tokens": pa.array(lengths.astype(np.int32)),
                "num_loss_tokens": pa.array(nl),
                "truncated": pa.array(np.zeros(n, bool)),
                "turn": pa.array(np.zeros(n, np.int32)),
            }
        ).cast(TOKEN_SCHEMA)
        tp = root / f"tokens-{s:07d}.parquet"
        write_parquet(tp, table)
        ids, mask, lengths = read_token_arrays(tp)
        meta = {
            "schema_version": FEATURE_SCHEMA_VERSION,
            "token_shard": tp.name,
            "token_shard_sha256": sha256_file(tp),
            "target_layer_ids": list(layers),
            "hidden_size": hidden,
            "dtype": "bfloat16",
        }
        fp = root / f"features-{s:07d}.safetensors"
        w = FeatureShardWriter(fp, FeatureLayout(lengths, len(layers), hidden, "bfloat16", False, meta), ids, mask)
        g = torch.Generator().manual_seed(s)
        noise = torch.randn(seq, len(layers) * hidden, generator=g)  # rows reused: the bytes, not their values, matter
        for r, t in enumerate(lengths):
            w.write(r, noise[: int(t)])
        w.commit(len(lengths))
        w.finish()
        toks.append(str(tp))
        feats.append(str(fp))
    return toks, feats


def peak_rss_mib() -> float:
    """This process's peak resident set (``VmHWM``, MiB). Not ``ru_maxrss``: Linux carries that across
    ``execve``, so a child would report its parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(mode: str, spec: dict) -> None:
    """One measurement in this (fresh) process; prints a JSON line with peak RSS in MiB."""
    out = {"mode": mode}
    if mode == "baseline":
        from dflash_pipeline.train.run import load_token_shards

        recs = load_token_shards(spec["tokens"])
        out["records"] = len(recs)
    elif mode == "scan":
        import torch

        from dflash_pipeline.train.data import MappedRecords, collate

        ds = MappedRecords(spec["features"], features=True)
        n = 0
        for batch in torch.utils.data.DataLoader(ds, batch_size=8, collate_fn=collate):
            n += int(batch["attention_mask"].sum())
        out["tokens_read"] = n
    else:
        from dflash_pipeline.train.run import train

        s = train(
            token_shards=spec["tokens"],
            feature_shards=spec["features"],
            probe=spec["probe"],
            target_dir=spec["target"],
            out_dir=spec["out"],
            cfg=spec["cfg"],
        )
        out["records"] = s["records"]
    out["peak_rss_mib"] = peak_rss_mib()
    print("RESULT " + json.dumps(out), flush=True)


def run_child(mode: str, spec: dict) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(spec, fh)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, __file__, "--child", mode, fh.name], capture_output=True, text=True, env=env)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode or not line:
        raise RuntimeError(f"{mode} child failed:\n{(p.stdout + p.stderr)[-3000:]}")
    return json.loads(line[-1][7:])


def bench_rss(root: Path, base_records: int, seq: int, hidden: int, steps: int, mults=(1, 10, 100)) -> None:
    target = make_target(root, hidden)
    probe = {
        "hidden_size": hidden,
        "num_hidden_layers": 4,
        "tie_word_embeddings": True,
        "drafter": {"block_size": 4, "num_draft_layers": 1, "target_layer_ids": [1, 2], "mask_token_id": 511},
    }
    rows = []
    for mult in mults:
        d = root / f"x{mult}"
        d.mkdir()
        t0 = time.time()
        toks, feats = make_shards(d, base_records * mult, seq, hidden)
        gb = sum(Path(f).stat().st_size for f in feats) / 1e9
        cfg = {
            "num_processes": 1,
            "epochs": steps * 4 / (base_records * mult),
            "batch_size": 4,
            "learning_rate": 1e-3,
            "warmup_ratio": 0.0,
            "weight_decay": 0.0,
            "max_grad_norm": 1.0,
            "num_anchors": 8,
            "loss_gamma": None,
            "mixed_precision": "no",
            "seed": 0,
            "save_every_steps": 10**9,
            "log_every_steps": 10**9,
            "trace_batches": False,
            "target_features": "shards",
        }
        spec = {
            "tokens": toks,
            "features": feats,
            "probe": probe,
            "target": str(target),
            "out": str(d / "run"),
            "cfg": cfg,
        }
        r = {"x": mult, "records": base_records * mult, "feature_GB": gb, "write_s": time.time() - t0}
        r["train_shards_MiB"] = run_child("train", spec)["peak_rss_mib"]
        r["scan_all_MiB"] = run_child("scan", spec)["peak_rss_mib"]
        r["baseline_load_token_shards_MiB"] = run_child("baseline", spec)["peak_rss_mib"]
        rows.append(r)
        print(json.dumps(r), flush=True)
    top = f"x{mults[-1]}"
    print(f"\npeak RSS (MiB)   {' / '.join(f'x{m}' for m in mults)}   ratio {top}/x{mults[0]}")
    for k in ("train_shards_MiB", "scan_all_MiB", "baseline_load_token_shards_MiB"):
        v = [r[k] for r in rows]
        print(f"  {k:34s} {' '.join(f'{x:7.0f}' for x in v)}   {v[-1] / v[0]:.2f}")
    print(f"  feature bytes at {top}: {rows[-1]['feature_GB']:.2f} GB")


def bench_extract(root: Path, records: int, seq: int, skip_vllm: bool) -> None:
    from dflash_pipeline.features.extract import extract_shard
    from dflash_pipeline.core.vllm_env import find_vllm_python

    target = make_target(root / "ex", 128, head_dim=32)  # vLLM's CPU attention wants head_dim >= 32
    toks, _ = make_shards(root / "ex", records, seq, 128, per_shard=records)
    tok = toks[0]
    cfg = {"backend": "hf", "dtype": "bfloat16", "last_hidden": False, "chunk_tokens": 32768}
    res = {
        "hf": extract_shard(
            tok,
            root / "ex/hf.safetensors",
            target_dir=target,
            target_layer_ids=[1, 2],
            hidden_size=128,
            num_hidden_layers=4,
            backend="hf",
        )
    }
    py = find_vllm_python()
    if not skip_vllm and py:
        probe = root / "ex/probe.json"
        probe.write_text(
            json.dumps({"hidden_size": 128, "num_hidden_layers": 4, "drafter": {"target_layer_ids": [1, 2]}})
        )
        stats = root / "ex/vllm.json"
        env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
        subprocess.run(
            [
                py,
                "-m",
                "dflash_pipeline.features",
                "extract",
                "--probe",
                str(probe),
                "--target",
                str(target),
                "--token-shard",
                tok,
                "--out",
                str(root / "ex/vllm.safetensors"),
                "--stats",
                str(stats),
                "--features-config",
                json.dumps(dict(cfg, backend="vllm")),
            ],
            check=True,
            env=env,
            stdout=open(root / "ex/vllm.log", "w"),
            stderr=subprocess.STDOUT,
        )
        res["vllm"] = json.loads(stats.read_text())
    print(f"\nextraction on {res['hf']['tokens']} tokens ({records} records), tiny target, CPU:")
    for k, v in res.items():
        print(
            f"  {k:5s} {v['tokens_per_s']:9.0f} tokens/s  ({v['extract_seconds']:.1f} s compute, {v['seconds']:.1f} s in all)"
        )
    if "vllm" in res:
        print(f"  ratio vllm / hf: {res['vllm']['tokens_per_s'] / res['hf']['tokens_per_s']:.2f}")


#: ``--smoke``: a few short records, the hf backend only (a vLLM engine start alone takes ~30 s;
#: tests/bench/test_benches.py).
SMOKE = {"base_records": 8, "seq": 32, "steps": 2, "extract_records": 4, "skip_vllm": True, "multipliers": "1,10"}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], json.loads(Path(sys.argv[3]).read_text()))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-records", type=int, default=2000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=8, help="target hidden size of the RSS part (K=2 layers)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--extract-records", type=int, default=64)
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--skip-rss", action="store_true")
    p.add_argument("--multipliers", default="1,10,100", help="dataset sizes of the RSS part, x the base")
    p.add_argument("--smoke", action="store_true", help=f"tiny sizes (seconds), for the suite's smoke test: {SMOKE}")
    a = p.parse_args()
    if a.smoke:
        vars(a).update(SMOKE)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if not a.skip_rss:
            bench_rss(root, a.base_records, a.seq, a.hidden, a.steps, tuple(int(m) for m in a.multipliers.split(",")))
        bench_extract(root, a.extract_records, a.seq, a.skip_vllm)


if __name__ == "__main__":
    main()
