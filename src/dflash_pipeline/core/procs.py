"""Processes: children that end with their parent, and ports for the servers and ranks they start.

A ``kill -9`` of a job (by Snakemake, SLURM, a user) reaches only the processes it names. Children started in
a session of their own (torchrun starts every training rank that way) or by ``multiprocessing`` would live on:
training ranks kept writing ``state/`` and ``final/`` under the next run, client processes kept sending
requests. :func:`die_with_parent` ends such a child when its parent goes.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time


def die_with_parent(ppid: int, *, poll_s: float = 0.5) -> None:
    """End this process as soon as its parent ``ppid`` is gone: ``PR_SET_PDEATHSIG`` (SIGKILL, Linux), and a
    daemon thread polling ``os.getppid()`` every ``poll_s`` seconds where the prctl is missing or failed.

    Exits at once (status 1) when the parent died before the call. Call it first thing in the child: the
    signal is delivered when the thread that started the child ends, which for every launcher we use is the
    launcher's main thread.
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except Exception:  # the watchdog still covers it
            pass
    if os.getppid() != ppid:  # the parent died before the prctl
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != ppid:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it): for a server or a rendezvous this process
    starts, so two runs on one host (two jobs, two test workers) never meet on a fixed port."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def end_process_group(proc, grace_s: float = 5.0) -> None:
    """End the process group `proc` (a `subprocess.Popen` started with `start_new_session=True`) leads: SIGTERM,
    SIGKILL to whatever of the group is left after `grace_s` seconds (children that share the group, such as an
    engine's core process, included), and reap `proc`. A group already gone is no error."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace_s)
    except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: the group is killed below either way
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
