"""The same config on two CPUs: the default demo in two fresh clones, one on this machine's own kernels and one
told to use AVX2 kernels, and how far each stage's outputs drift apart.

torch picks its CPU kernels by the machine (AVX-512 here, AVX2 on many laptops and CI boxes); other kernels
round floats differently. ``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2`` make
an AVX-512 box compute as an AVX2 one does, so one machine stands in for another. Both runs use ``--cores 1``.

Each variant is a ``git clone`` of this checkout's HEAD (committed work only) under ``--work``, built with
``snakemake --profile local --cores 1`` (a finished clone is reused). Printed:

* τ of the trained drafter per eval set in both runs and the relative difference (the figure that must stay
  within 5 %), and the largest one;
* per stage, where the drift starts: the target's digest (the shipped demo target: equal), completions with
  equal output ids, token records equal, the final training loss of each run, whether the drafters' weights
  are equal.

    python bench/bench_repro.py --work /tmp/repro            # the default demo, ~2 x 15 min on an idle box
    python bench/bench_repro.py --smoke --work /tmp/repro    # a tiny config (the suite's smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

#: The AVX2 stand-in: torch's ATen dispatch, MKL and oneDNN all limited to AVX2.
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

#: ``--smoke``: the shipped target, a handful of prompts, one short eval set.
SMOKE_CONFIG = {
    "run": "repro",
    "target": {"path": "demo"},
    "drafter": {"block_size": 4, "num_draft_layers": 1, "num_target_features": 2},
    "datasets": {"gsm8k": {"path": "data/gsm8k/train.jsonl", "max_prompts": 8}},
    "prompts": {"shard_size": 8},
    "generation": {"backend": "transformers", "max_tokens": 16, "batch_size": 8},
    "tokens": {"max_length": 160},
    "train": {"epochs": 1, "batch_size": 4, "num_anchors": 8, "save_every_steps": 1000},
    "eval": {
        "max_new_tokens": 8,
        "baselines": [],
        "checkpoint_samples": 0,
        "sets": {"gsm8k": {"path": "data/gsm8k/test.jsonl", "num_samples": 2}},
    },
}


def run_variant(clone: Path, *, avx2: bool, config: dict | None, cores: int = 1) -> float:
    """Clone this checkout's HEAD into ``clone`` (unless there) and build it; returns the seconds it took (0 when
    the clone was already built). Raises RuntimeError with the log's tail when Snakemake fails."""
    if not clone.exists():
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    env = {**os.environ, "PYTHONPATH": str(clone / "src"), **(AVX2_ENV if avx2 else {})}
    for k in () if avx2 else AVX2_ENV:
        env.pop(k, None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [sys.executable, "-m", "snakemake", "--profile", "local", "--cores", str(cores)]
    if config is not None:
        (clone / "repro.yaml").write_text(yaml.safe_dump(config))
        cmd += ["--configfile", "repro.yaml", "--replace-workflow-config"]
    if (clone / "repro-done").exists():
        return 0.0
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=clone, env=env, capture_output=True, text=True)
    (clone / "repro-run.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{clone}: snakemake exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    (clone / "repro-done").write_text("")
    return time.perf_counter() - t0


def _parquet_rows(paths, value) -> dict[str, object]:
    """``{dataset/prompt_id/turn: value(record)}`` over the shards ``paths``."""
    import pyarrow.parquet as pq

    rows = {}
    for p in sorted(paths):
        for r in pq.read_table(p).to_pylist():
            rows[f"{p.parent.name}/{r.get('prompt_id')}/{r.get('turn')}"] = value(r)
    return rows


#: What must be equal per record: the target's output ids of every turn; the token ids and loss mask.
_STAGE_VALUE = {
    "completions": lambda r: [t.get("output_token_ids") for t in r.get("turns") or []] + [r.get("status")],
    "tokens": lambda r: [r.get("input_ids"), r.get("loss_mask")],
}


def stage_drift(a: Path, b: Path, run: str) -> dict:
    """Where two builds of one config part: the target digest, completions and token records that are equal,
    the final training loss of each, and whether the exported drafter weights are equal."""
    ea = json.loads((a / f"results/eval/{run}/acceptance.json").read_text())
    eb = json.loads((b / f"results/eval/{run}/acceptance.json").read_text())
    da = ((ea.get("provenance") or {}).get("target") or {}).get("digest") or {}
    db = ((eb.get("provenance") or {}).get("target") or {}).get("digest") or {}
    out = {"target_digest_equal": bool(da) and da == db}
    for stage, value in _STAGE_VALUE.items():
        ra = _parquet_rows((a / "results" / stage).glob("*/*.parquet"), value)
        rb = _parquet_rows((b / "results" / stage).glob("*/*.parquet"), value)
        out[stage] = {"records": len(set(ra) | set(rb)), "equal": sum(1 for k in set(ra) & set(rb) if ra[k] == rb[k])}
    for name, d in (("a", a), ("b", b)):
        log = [json.loads(x) for x in (d / f"results/checkpoints/{run}/train_log.jsonl").read_text().splitlines() if x]
        losses = [r["loss"] for r in log if "loss" in r]
        out[f"final_loss_{name}"] = losses[-1] if losses else None
    wa = (a / f"results/checkpoints/{run}/final/model.safetensors").read_bytes()
    wb = (b / f"results/checkpoints/{run}/final/model.safetensors").read_bytes()
    out["drafter_weights_equal"] = wa == wb
    out["cpu_capability"] = [
        (ea.get("provenance") or {}).get("cpu_capability"),
        (eb.get("provenance") or {}).get("cpu_capability"),
    ]
    return out


def tau_table(a: Path, b: Path, run: str) -> list[dict]:
    """τ of the trained drafter per eval set in both builds, and the difference relative to the first."""
    ta = json.loads((a / f"results/eval/{run}/acceptance.json").read_text())["tau"]["trained"]
    tb = json.loads((b / f"results/eval/{run}/acceptance.json").read_text())["tau"]["trained"]
    return [{"set": s, "native": ta[s], "avx2": tb[s], "diff_pct": 100.0 * (tb[s] - ta[s]) / ta[s]} for s in ta]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a tiny config instead of the default demo")
    p.add_argument("--work", help="where the two clones go (default: a temp dir)")
    p.add_argument("--limit-pct", type=float, default=5.0, help="the largest τ difference allowed, in %%")
    a = p.parse_args(argv)
    work = Path(a.work or tempfile.mkdtemp(prefix="bench-repro-"))
    work.mkdir(parents=True, exist_ok=True)
    config = SMOKE_CONFIG if a.smoke else None
    run = SMOKE_CONFIG["run"] if a.smoke else "demo"
    native, avx2 = work / "native", work / "avx2"
    # the two builds at once, one core each (--cores 1): neither waits for the other
    with ThreadPoolExecutor(2) as pool:
        futs = {
            n: pool.submit(run_variant, d, avx2=(n == "avx2"), config=config)
            for n, d in (("native", native), ("avx2", avx2))
        }
        secs = {n: f.result() for n, f in futs.items()}
    rows = tau_table(native, avx2, run)
    drift = stage_drift(native, avx2, run)
    print(f"clones under {work}; build seconds: native {secs['native']:.0f}, avx2 {secs['avx2']:.0f} (0: reused)")
    print(f"kernels: native {drift['cpu_capability'][0]}, avx2 run {drift['cpu_capability'][1]}")
    print("| eval set | τ native | τ AVX2 | difference |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['set']} | {r['native']:.3f} | {r['avx2']:.3f} | {r['diff_pct']:+.1f} % |")
    worst = max(abs(r["diff_pct"]) for r in rows)
    print(
        f"largest τ difference: {worst:.1f} % (limit {a.limit_pct:.0f} %): {'within' if worst <= a.limit_pct else 'OVER'}"
    )
    c, t = drift["completions"], drift["tokens"]
    print(
        f"stages: target digest {'equal' if drift['target_digest_equal'] else 'DIFFERENT'}; completions "
        f"{c['equal']}/{c['records']} equal; token records {t['equal']}/{t['records']} equal; final train loss "
        f"{drift['final_loss_a']:.4f} vs {drift['final_loss_b']:.4f}; drafter weights "
        f"{'equal' if drift['drafter_weights_equal'] else 'differ'}"
    )
    (work / "repro.json").write_text(json.dumps({"tau": rows, "drift": drift, "seconds": secs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
