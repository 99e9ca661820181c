"""bench/bench_stream.py at its tiny size (``--smoke``: one hf feature server, 40 records): it runs, and prints
its table and the stream/shards tokens/s ratio (the figures themselves depend on the machine and its load)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REPO

NUM = r"[\d,]+(?:\.\d+)?"


def test_bench_stream_smoke():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_stream.py"), "--smoke"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for pat in (
        rf"^shards\s+1x\s+{NUM}\s+-",
        rf"^stream\s+1x\s+{NUM}\s+\d+%\s+{NUM}\s+{NUM}$",
        rf"^ratio stream/shards tokens/s at 1x: {NUM}$",
    ):
        assert re.search(pat, proc.stdout, re.MULTILINE), (pat, proc.stdout[-3000:])
