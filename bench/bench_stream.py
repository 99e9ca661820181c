"""Streaming vs shards: trainer tokens/s on the same data and machine, the stream's wait fraction, and its
peak scratch and RSS as the dataset grows (``train.target_features: stream``).

A tiny Qwen3 target, synthetic token shards, their hf feature shards; then, each in a fresh process:
``shards`` (train from the feature shards) and ``stream`` (train against ``--servers`` hf feature servers,
``python -m dflash_pipeline.features serve``, or one vLLM CPU server with ``--vllm``), at 1x and 10x the base
record count. Prints one table and the ratios: stream/shards tokens/s, 10x/1x peak RSS and peak scratch.

    python bench/bench_stream.py --smoke            # seconds: 1x only, 40 records
    python bench/bench_stream.py --records 400 --servers 2
    python bench/bench_stream.py --vllm             # a vLLM CPU server ($DFLASH_VLLM_PYTHON)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
LAYERS = [1, 2]
TRAIN = {
    "num_processes": 1,
    "epochs": 1,
    "batch_size": 4,
    "learning_rate": 1e-3,
    "num_anchors": 16,
    "mixed_precision": "no",
    "seed": 0,
    "save_every_steps": 10**6,
    "log_every_steps": 5,
}


def make_data(root: Path, records: int, seq: int, hidden: int) -> tuple[Path, list[Path], list[Path], dict]:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_pipeline.core.contracts import TOKEN_SCHEMA
    from dflash_pipeline.core.shards import table_from_records, write_parquet
    from dflash_pipeline.features.extract import extract_shard

    target = root / "target"
    if not target.is_dir():
        torch.manual_seed(0)
        Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=512,
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=hidden // 4,
                max_position_embeddings=4096,
                tie_word_embeddings=False,
            )
        ).save_pretrained(target)
    rng = np.random.default_rng(records)
    recs = []
    for i in range(records):
        n = int(rng.integers(seq // 2, seq))
        ids = rng.integers(0, 500, n).tolist()
        mask = [0] * (n // 3) + [1] * (n - n // 3)
        recs.append(
            {
                "prompt_id": f"p{i}",
                "input_ids": ids,
                "loss_mask": mask,
                "num_tokens": n,
                "num_loss_tokens": sum(mask),
                "truncated": False,
                "turn": 0,
            }
        )
    tok = root / f"tokens-{records}.parquet"
    write_parquet(tok, table_from_records(recs, TOKEN_SCHEMA))
    feats = root / f"features-{records}.safetensors"
    extract_shard(
        tok,
        feats,
        target_dir=target,
        target_layer_ids=LAYERS,
        hidden_size=hidden,
        num_hidden_layers=4,
        backend="hf",
    )
    probe = {
        "hidden_size": hidden,
        "num_hidden_layers": 4,
        "tie_word_embeddings": False,
        "drafter": {
            "block_size": 4,
            "num_draft_layers": 1,
            "target_layer_ids": LAYERS,
            "mask_token_id": 511,
        },
    }
    return target, [tok], [feats], probe


def child(spec_path: str) -> None:
    """One training run (``--child SPEC``): prints a JSON line with tokens/s, wait fraction, peak RSS/scratch."""
    from dflash_pipeline.train import train

    spec = json.loads(Path(spec_path).read_text())
    s = train(
        token_shards=spec["tokens"],
        feature_shards=spec["features"] if spec["mode"] == "shards" else (),
        probe=spec["probe"],
        target_dir=spec["target"],
        out_dir=spec["out"],
        cfg=dict(TRAIN, target_features=spec["mode"]),
        stream=spec.get("stream"),
    )
    log = [json.loads(x) for x in (Path(spec["out"]) / "train_log.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_s"] for r in log[1:]] or [log[0]["tokens_per_s"]]  # the first window pays the warm-up
    st = s.get("stream") or {}
    print(
        "RESULT "
        + json.dumps(
            {
                "tokens_per_s": float(np.median(tps)),
                "wait_fraction": st.get("wait_fraction"),
                "peak_scratch_bytes": st.get("peak_scratch_bytes"),
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        ),
        flush=True,
    )


def start_servers(target: Path, root: Path, n: int, vllm: bool, hidden: int) -> tuple[list, list[dict]]:
    from dflash_pipeline.features.colocate import start_servers as start

    probe = {
        "drafter": {"target_layer_ids": LAYERS},
        "num_hidden_layers": 4,
        "hidden_size": hidden,
    }
    stream = {
        "servers": n,
        "backend": "vllm" if vllm else "hf",
        "scratch_dir": str(root / "scratch"),
        "max_len": 1024,
        "vllm": {
            "python": os.environ.get("DFLASH_VLLM_PYTHON", str(REPO / ".venv-vllm/bin/python")),
            "engine_args": {},
        },
    }
    return start(stream, probe=probe, target=str(target), timeout_s=1800)


def run(mode: str, root: Path, target, tokens, feats, probe, stream=None) -> dict:
    out = root / f"run-{mode}-{tokens[0].stem}"
    spec = root / f"{out.name}.json"
    spec.write_text(
        json.dumps(
            {
                "mode": mode,
                "tokens": list(map(str, tokens)),
                "features": list(map(str, feats)),
                "probe": probe,
                "target": str(target),
                "out": str(out),
                "stream": stream,
            }
        )
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(spec)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"{mode} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line[7:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=200, help="base record count (1x)")
    p.add_argument("--seq", type=int, default=256, help="longest record (tokens)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--vllm", action="store_true", help="one vLLM CPU server instead of hf servers")
    p.add_argument("--smoke", action="store_true", help="tiny: 40 records of <= 64 tokens, 1x only")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(a.child)
        return 0
    if a.smoke:
        a.records, a.seq = 40, 64
    scales = (1,) if a.smoke else (1, 10)
    from dflash_pipeline.features.colocate import stop

    with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
        root = Path(tmp)
        rows = {}
        data = {s: make_data(root, a.records * s, a.seq, a.hidden) for s in scales}
        target = data[1][0]
        procs, eps = start_servers(target, root, 1 if a.vllm else a.servers, a.vllm, a.hidden)
        try:
            for s in scales:
                _, tokens, feats, probe = data[s]
                rows[("shards", s)] = run("shards", root, target, tokens, feats, probe)
                rows[("stream", s)] = run(
                    "stream",
                    root,
                    target,
                    tokens,
                    feats,
                    probe,
                    {"endpoints": eps, "scratch_dir": str(root / "scratch")},
                )
        finally:
            stop(procs)
    server = "1 vLLM CPU server" if a.vllm else f"{a.servers} hf server(s)"
    print(f"\nstream vs shards, {a.records} records x <= {a.seq} tokens (1x), hidden {a.hidden}, {server}")
    print(f"{'mode':8} {'scale':>5} {'tokens/s':>10} {'wait':>6} {'peak RSS MB':>12} {'peak scratch B':>15}")
    for (mode, s), r in rows.items():
        wait = f"{100 * r['wait_fraction']:.0f}%" if r["wait_fraction"] is not None else "-"
        print(
            f"{mode:8} {s:>4}x {r['tokens_per_s']:>10.0f} {wait:>6} {r['peak_rss_mb']:>12.0f} "
            f"{r['peak_scratch_bytes'] if r['peak_scratch_bytes'] is not None else '-':>15}"
        )
    for s in scales:
        ratio = rows[("stream", s)]["tokens_per_s"] / rows[("shards", s)]["tokens_per_s"]
        print(f"ratio stream/shards tokens/s at {s}x: {ratio:.2f}")
    if 10 in scales:
        st1, st10 = rows[("stream", 1)], rows[("stream", 10)]
        print(
            f"ratio 10x/1x stream peak RSS: {st10['peak_rss_mb'] / st1['peak_rss_mb']:.2f}; peak scratch: "
            f"{st10['peak_scratch_bytes'] / max(1, st1['peak_scratch_bytes']):.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
