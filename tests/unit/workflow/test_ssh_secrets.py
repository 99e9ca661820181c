"""The ssh profile forwards API keys to its jobs through the remote shell's standard input, never a command
line: a stand-in ``ssh`` on PATH records its argv and runs the remote command here, and a job checks what
it received (the key) while no argv (ssh's, the remote shell's, the job's) carries it."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

FAKE_SSH = """#!/bin/bash
# stand-in ssh: record argv, then run the remote command (the last argument) here, stdin passed through
printf '%s\\n' "$@" > "$FAKE_SSH_ARGV"
remote="${@: -1}"
exec bash -c "$remote"
"""


def test_forwarded_keys_travel_on_stdin_not_argv(tmp_path):
    key = "sk-planted-" + secrets.token_hex(12)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("hosts:\n  - {name: h1, ssh: h1, slots: 2, gpus: []}\n")
    seen = tmp_path / "seen.json"
    probe = tmp_path / "probe.py"  # what the job saw: the key, and its own and its shell's argv
    probe.write_text(
        "import json, os, sys\n"
        "argv = [open(f'/proc/{p}/cmdline', 'rb').read().decode(errors='replace') for p in (os.getpid(), os.getppid())]\n"
        "json.dump({'key': os.environ.get('OPENAI_API_KEY'), 'argv': argv}, open(sys.argv[1], 'w'))\n"
    )
    job = tmp_path / "job.sh"
    props = json.dumps({"rule": "r", "threads": 1, "resources": {}})
    job.write_text(f"#!/bin/bash\n# properties = {props}\npython3 {probe} {seen}\n")
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "OPENAI_API_KEY": key,
        "DFLASH_SSH_HOSTS": str(hosts),
        "FAKE_SSH_ARGV": str(tmp_path / "argv.txt"),
    }
    p = subprocess.run(
        [sys.executable, str(REPO / "cluster" / "ssh_submit.py"), str(job)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    job_id = p.stdout.strip()
    rc = tmp_path / ".snakemake" / "ssh_jobs" / f"{job_id}.rc"
    deadline = time.monotonic() + 30
    while not rc.exists():  # the job runs detached; its rc file is the only signal it ended
        assert time.monotonic() < deadline, "the job did not end"
        time.sleep(0.05)
    assert rc.read_text().strip() == "0"
    got = json.loads(seen.read_text())
    assert got["key"] == key  # forwarded
    argv = (tmp_path / "argv.txt").read_text()
    assert key not in argv and "OPENAI_API_KEY" not in argv  # not on ssh's command line
    assert all(key not in a for a in got["argv"])  # nor the job's or its shell's
    assert key not in p.stdout + p.stderr
