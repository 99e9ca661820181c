"""Planning cost of the workflow at scale: `snakemake -n` over N prompt shards (default 10,000) with our
Snakefile, next to a trivial Snakefile with the same job count (2 rules per shard + 1 aggregate) measured
in the same run. Prints seconds and the ratio (our rules' overhead).

    python bench/bench_dag.py [--shards 10000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

TRIVIAL = """
SHARDS = [f"{i:05d}" for i in range(int(config["nshards"]))]
rule all:
    input: "train.done"
rule a:
    input: "prompts/{s}.txt"
    output: "completions/{s}.txt"
    shell: "cp {input} {output}"
rule b:
    input: "completions/{s}.txt"
    output: "tokens/{s}.txt"
    shell: "cp {input} {output}"
rule agg:
    input: expand("tokens/{s}.txt", s=SHARDS)
    output: "train.done"
    shell: "touch {output}"
"""


def timed(cmd, cwd) -> float:
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, default=10_000)
    a = p.parse_args()
    n = a.shards
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "ours"
        (work / "target").mkdir(parents=True)
        (work / "target" / "config.json").write_text("{}")
        src = work / "prompts.jsonl"
        src.write_text('{"prompt": "x"}\n')
        shards = []
        for i in range(n):
            f = work / "results" / "prompts" / "big" / f"{i:05d}.parquet"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.touch()
            shards.append({"name": f"{i:05d}", "path": f"big/{i:05d}.parquet", "rows": 1})
        manifest = {"datasets": {"big": {"shards": shards}}}
        (work / "results" / "prompts" / "manifest.json").write_text(json.dumps(manifest))
        cfg = {"target": {"path": str(work / "target")}, "datasets": {"big": {"path": str(src)}},
               "eval": {"sets": {}}}
        (work / "config.yaml").write_text(yaml.safe_dump(cfg))
        ours = timed([sys.executable, "-m", "snakemake", "-n", "--quiet", "-s", str(REPO / "Snakefile"), "-d", str(work),
                      "--configfile", str(work / "config.yaml"), "--cores", "2"], work)

        triv = Path(tmp) / "trivial"
        (triv / "prompts").mkdir(parents=True)
        for i in range(n):
            (triv / "prompts" / f"{i:05d}.txt").touch()
        (triv / "Snakefile").write_text(TRIVIAL)
        base = timed([sys.executable, "-m", "snakemake", "-n", "--quiet", "--cores", "2", "--config", f"nshards={n}"], triv)
    print(f"dry run over {n:,} shards ({2 * n + 4:,} jobs): ours {ours:.1f} s, trivial Snakefile {base:.1f} s, ratio {ours / base:.2f}x")


if __name__ == "__main__":
    main()
