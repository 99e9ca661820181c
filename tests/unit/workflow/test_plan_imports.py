"""A plan stays light: Snakemake reads the workflow on every call (each `snakemake -n`, each run, and on a cluster
each job), and once the device-memory plan and the probe's plan-time gate of a config are cached, reading it
imports neither torch nor transformers (the drafter families' modules name their model code lazily:
drafter/families.py `LazyClass`; the cache: core/plan_cache.py)."""

from __future__ import annotations

import os
import re
import sys

import yaml
from conftest import REPO, SNAKEMAKE_CORES

HEAVY = ("torch", "transformers")


def _imported_top_level(stderr: str) -> set[str]:
    """Top-level packages named in `python -X importtime`'s report (`import time: self | cumulative | name`)."""
    names = set()
    for line in stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+\d+ \|\s+(\S+)", line.strip())
        if m:
            names.add(m.group(1).split(".")[0])
    return names


def test_a_cached_plan_imports_neither_torch_nor_transformers(tmp_path):
    import shutil
    import subprocess

    cfg = yaml.safe_load((REPO / "tests" / "e2e" / "e2e_config.yaml").read_text())
    # a target of the user's (not `demo`) with no probe record yet: the gate checks it on every plan
    cfg["target"] = {"path": str(shutil.copytree(REPO / "data" / "demo-target", tmp_path / "target"))}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    env = {
        **os.environ,
        "DFLASH_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    cmd = [
        sys.executable,
        "-X",
        "importtime",
        "-m",
        "snakemake",
        "-n",
        "-s",
        str(REPO / "Snakefile"),
        "-d",
        str(tmp_path),
        "--cores",
        str(SNAKEMAKE_CORES),
        "--configfile",
        str(tmp_path / "config.yaml"),
    ]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "[plan] device memory:" in first.stderr and "train_drafter" in first.stdout + first.stderr
    # the first plan computed the memory plan on fake tensors: torch was needed (the check below can fail)
    assert "torch" in _imported_top_level(first.stderr)

    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0, second.stderr[-4000:]
    line = next(x for x in second.stderr.splitlines() if x.startswith("[plan] device memory:"))
    assert line in first.stderr  # the cached plan, word for word
    heavy = _imported_top_level(second.stderr) & set(HEAVY)
    assert not heavy, f"a cached plan imported {sorted(heavy)}"
