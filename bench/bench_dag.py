"""Planning cost of the workflow at scale: `snakemake -n` over N prompt shards (default 10,000) with our
Snakefile, next to a trivial Snakefile with the same job count (2 rules per shard + 1 aggregate) measured
in the same run. Prints seconds and the ratio (our rules' overhead).

The target is real, as planning requires (config.problems refuses a directory without tokenizer or
weights): the demo target's files, built untrained (0 steps, a small corpus) into the temp dir, or
`--target DIR` (e.g. `resources/demo-target` after a demo run). The prompt shards are empty files listed in
a manifest the prompts checkpoint would have written, so everything below the checkpoint is planned.

    python bench/bench_dag.py [--shards 10000] [--target DIR]
    python bench/bench_dag.py --smoke          # 20 shards: seconds (tests/bench/test_benches.py)
"""

from __future__ import annotations

import argparse
import json
import os
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

#: Conversations the untrained target's tokenizer is fitted on (GSM8K-style lines; `demo.load_corpus`).
CORPUS = [{"question": f"What is {i} plus {i + 1}?", "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}"}
          for i in range(64)]


def timed(cmd, cwd, env=None) -> float:
    """Wall seconds of ``cmd`` in ``cwd``; exits with its output tail when it fails."""
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
    return time.perf_counter() - t


def untrained_demo_target(out: Path) -> Path:
    """The demo target's files (config, tokenizer, chat template, random weights) built without training, in
    a child process (torch stays out of this one)."""
    corpus = out.parent / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
    code = ("import sys; from dflash_pipeline.demo import build_demo_target; "
            "build_demo_target(sys.argv[1], [sys.argv[2]], train_steps=0, vocab_size=300, log=None)")
    timed([sys.executable, "-c", code, str(out), str(corpus)], out.parent, env=src_env())
    return out


def src_env() -> dict:
    """The environment with this checkout's src first on PYTHONPATH (the Snakefile imports the package)."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), path]))}


def our_workdir(work: Path, n: int, target: Path) -> Path:
    """A results dir whose prompts checkpoint is done: ``n`` (empty) shards of one dataset in its manifest.
    Returns the config file."""
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
    cfg = {"target": {"path": str(target)}, "datasets": {"big": {"path": str(src)}}, "eval": {"sets": {}}}
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    return work / "config.yaml"


def measure(n: int, target: Path | None, tmp: Path) -> tuple[float, float]:
    """(our seconds, trivial seconds) of one dry run each over ``n`` shards."""
    work = tmp / "ours"
    work.mkdir(parents=True)
    target = target or untrained_demo_target(tmp / "target")
    config = our_workdir(work, n, target.resolve())
    ours = timed([sys.executable, "-m", "snakemake", "-n", "--quiet", "-s", str(REPO / "Snakefile"), "-d", str(work),
                  "--configfile", str(config), "--cores", "2"], work, env=src_env())
    triv = tmp / "trivial"
    (triv / "prompts").mkdir(parents=True)
    for i in range(n):
        (triv / "prompts" / f"{i:05d}.txt").touch()
    (triv / "Snakefile").write_text(TRIVIAL)
    base = timed([sys.executable, "-m", "snakemake", "-n", "--quiet", "--cores", "2", "--config", f"nshards={n}"], triv)
    return ours, base


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, default=10_000)
    p.add_argument("--target", type=Path, help="a target directory (default: the demo target's files, untrained)")
    p.add_argument("--smoke", action="store_true", help="tiny size (20 shards), for the suite's smoke test")
    a = p.parse_args(argv)
    n = 20 if a.smoke else a.shards
    with tempfile.TemporaryDirectory() as tmp:
        ours, base = measure(n, a.target, Path(tmp))
    print(f"dry run over {n:,} shards (2 jobs each, {2 * n:,} in all): ours {ours:.1f} s, trivial Snakefile {base:.1f} s, "
          f"ratio {ours / base:.2f}x")


if __name__ == "__main__":
    main()
