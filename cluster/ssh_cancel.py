#!/usr/bin/env python3
"""``ssh_cancel.py JOB_ID...``: stop running ssh jobs (their whole process group) and free their hosts."""

from __future__ import annotations

import sys

import ssh_common as C


def main(job_ids: list[str]) -> int:
    spec = C.load_hosts()
    for job_id in job_ids:
        try:
            rec = C.read_record(job_id)
        except FileNotFoundError:
            continue
        if C.exit_code(job_id) is None and "pid" in rec:
            C.run_ssh(spec, rec["dest"], f"kill -TERM -- -{int(rec['pid'])} 2>/dev/null || true", timeout=30)
            C.finish(job_id, 130)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
