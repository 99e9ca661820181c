"""bench/bench_stream.py at its tiny size (``--smoke``: one hf feature server, 40 records): it runs, and prints
its table and the stream/shards tokens/s ratio (the figures themselves depend on the machine and its load);
``--smoke --faults`` (80 records): each fault (a server SIGKILLed mid-epoch, a server that hangs, the trainer
SIGKILLed after a state save and rerun) happened, and its run trained exactly the reference's records, each
once, to the reference's final weights bit for bit."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REPO

NUM = r"[\d,]+(?:\.\d+)?"


def _bench(*args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_stream.py"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def test_bench_stream_smoke():
    proc = _bench("--smoke")
    for pat in (
        rf"^shards\s+1x\s+{NUM}\s+-",
        rf"^stream\s+1x\s+{NUM}\s+\d+%\s+{NUM}\s+{NUM}$",
        rf"^ratio stream/shards tokens/s at 1x: {NUM}$",
    ):
        assert re.search(pat, proc.stdout, re.MULTILINE), (pat, proc.stdout[-3000:])


def test_bench_stream_faults_smoke():
    proc = _bench("--smoke", "--faults")
    assert re.search(r"^fault\s+ran\s+lost\s+duplicated\s+final weights", proc.stdout, re.MULTILINE), proc.stdout
    for fault in ("server SIGKILLed mid-epoch", "server hangs", "trainer SIGKILLed, rerun"):
        pat = rf"^{re.escape(fault)}\s+yes\s+0\s+0\s+equal\s"
        assert re.search(pat, proc.stdout, re.MULTILINE), (fault, proc.stdout[-3000:])
