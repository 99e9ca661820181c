#!/usr/bin/env python3
"""``ssh_status.py JOB_ID`` prints running, success or failed (Snakemake cluster-generic status command).

The job's ``.rc`` file (written by the remote side on the shared filesystem) decides. Without one, the
remote pid is checked over ssh at most every 30 s: a job whose process is gone and left no exit code (host
rebooted, OOM-killed shell) is failed, and so is one whose host stayed unreachable for 10 minutes.
"""

from __future__ import annotations

import sys
import time

import ssh_common as C

CHECK_EVERY_S = 30
UNREACHABLE_FAIL_S = 600


def status(job_id: str) -> str:
    code = C.exit_code(job_id)
    if code is not None:
        return "success" if code == 0 else "failed"
    try:
        rec = C.read_record(job_id)
    except FileNotFoundError:
        return "failed"
    if "pid" not in rec or C.now() - rec.get("checked", 0) < CHECK_EVERY_S:
        return "running"
    spec = C.load_hosts()
    out = C.run_ssh(spec, rec["dest"], f"kill -0 {int(rec['pid'])}", timeout=30)
    if out.returncode == 0:
        rec.update(checked=C.now(), unreachable_since=None)
    elif out.returncode == 255:  # ssh itself failed
        rec.setdefault("unreachable_since", None)
        rec["unreachable_since"] = rec["unreachable_since"] or C.now()
        rec["checked"] = C.now()
        if C.now() - rec["unreachable_since"] > UNREACHABLE_FAIL_S:
            C.finish(job_id, 255)
            return "failed"
    else:  # the process is gone; give the shared filesystem a moment to show its rc file
        time.sleep(5)
        if C.exit_code(job_id) is None:
            C.finish(job_id, 254)
            print(f"[ssh_status] {job_id}: process {rec['pid']} on {rec['dest']} is gone without an exit code",
                  file=sys.stderr)
        return status(job_id)
    C.write_record(rec)
    return "running"


if __name__ == "__main__":
    print(status(sys.argv[1]))
