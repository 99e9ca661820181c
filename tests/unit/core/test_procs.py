"""Process helpers (dflash_pipeline.core.procs): ending a whole process group, the children that share it
included, also when they ignore SIGTERM."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from dflash_pipeline.core.procs import end_process_group

#: A leader that ignores SIGTERM and starts a child that ignores it too, in its group; prints the child's pid.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"],
    stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(60)
"""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _dead(pid: int, within_s: float = 10.0) -> bool:
    """Whether `pid` has exited (gone, or a zombie its new parent has not reaped yet) within `within_s`: SIGKILL is
    delivered at once, the exit a moment later."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.01)
    return False


def test_end_process_group_kills_children_that_ignore_sigterm():
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(proc.stdout.readline())
    assert _group_alive(proc.pid) and os.getpgid(child) == proc.pid
    end_process_group(proc, grace_s=0.2)
    assert proc.returncode == -9  # SIGTERM ignored: killed after the grace period
    proc.stdout.close()
    assert _dead(child)  # the child that shared the group, and ignored SIGTERM too, was killed with it


def test_end_process_group_of_a_finished_process_is_no_error():
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    end_process_group(proc, grace_s=0.1)
    assert proc.returncode == 0
