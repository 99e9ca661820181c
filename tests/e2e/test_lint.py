"""`snakemake --lint` reports no findings (every rule: log, conda env, no hard-coded input prefixes…)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_snakemake_lint_is_clean(tmp_path):
    # configfile/data paths are relative to the working directory: lint from a scratch dir that links
    # the workflow, so the test never touches (or waits on the lock of) the repo's own .snakemake/.
    for name in ("Snakefile", "rules", "scripts", "envs", "config", "data"):
        (tmp_path / name).symlink_to(REPO / name)
    out = subprocess.run(
        [sys.executable, "-m", "snakemake", "--lint"], cwd=tmp_path, capture_output=True, text=True, timeout=180
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "Lints for" not in text, text[-6000:]
    assert "Congratulations" in text
