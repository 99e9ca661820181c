#!/usr/bin/env python3
"""Submit one Snakemake job to an SSH host: ``ssh_submit.py JOBSCRIPT`` prints the job id.

Picks a host from hosts.yaml with enough free CPU slots (the job's threads) and GPU ids (its ``gpu``
resource), waiting while none has room; starts the jobscript there detached (``setsid nohup``) with
``CUDA_VISIBLE_DEVICES`` set to the job's GPU ids (empty for CPU jobs on GPU hosts), and returns at once.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
import time
import uuid
from pathlib import Path

import ssh_common as C


def job_properties(jobscript: Path) -> dict:
    m = re.search(r"^# properties = (.*)$", jobscript.read_text(), flags=re.M)
    return json.loads(m.group(1)) if m else {}


def place(spec: dict, threads: int, gpus: int):
    """(host, gpu ids) with room for the job, or None. CPU jobs prefer hosts without GPUs."""
    active = C.active_records()
    best = None
    for h in spec["hosts"]:
        mine = [r for r in active if r["host"] == h["name"]]
        used_slots = sum(r["threads"] for r in mine)
        used_gpus = {g for r in mine for g in r["gpus"]}
        free_gpus = [g for g in h["gpus"] if g not in used_gpus]
        need = min(threads, h["slots"])  # a job wider than a host gets the whole host
        if gpus > len(h["gpus"]) or len(free_gpus) < gpus or used_slots + need > h["slots"]:
            continue
        key = (bool(h["gpus"]) if gpus == 0 else 0, used_slots / h["slots"])
        if best is None or key < best[0]:
            best = (key, h, free_gpus[:gpus], need)
    return None if best is None else best[1:]


def main() -> int:
    jobscript = Path(sys.argv[-1]).resolve()
    props = job_properties(jobscript)
    threads = int(props.get("threads") or 1)
    gpus = int((props.get("resources") or {}).get("gpu") or 0)
    spec = C.load_hosts()
    if gpus > max(len(h["gpus"]) for h in spec["hosts"]):
        print(f"job {props.get('rule')} asks for {gpus} GPUs; no host in {C.hosts_file()} has that many",
              file=sys.stderr)
        return 1
    job_id = f"{props.get('rule', 'job')}-{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:8]}"
    waited = 0.0
    while True:
        with C.locked():
            placed = place(spec, threads, gpus)
            if placed is not None:
                host, gpu_ids, slots = placed
                rec = {"id": job_id, "host": host["name"], "dest": host["ssh"], "gpus": gpu_ids,
                       "threads": slots, "rule": props.get("rule"), "submitted": C.now()}
                C.write_record(rec)
                break
        if waited == 0:
            print(f"[ssh_submit] {job_id}: waiting for a host with {threads} slots and {gpus} GPUs",
                  file=sys.stderr)
        time.sleep(2)
        waited += 2
    # Snakemake may clean its tmp dir before the job starts: keep a copy beside the record.
    script = (C.JOBS_DIR / f"{job_id}.sh").resolve()
    shutil.copy(jobscript, script)
    log, rc = (C.JOBS_DIR / f"{job_id}.log").resolve(), C.rc_path(job_id).resolve()
    env = {"DFLASH_SSH_JOB_ID": job_id}
    if host["gpus"] or gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    inner = f"bash {shlex.quote(str(script))} > {shlex.quote(str(log))} 2>&1; " \
            f"echo $? > {shlex.quote(str(rc))}.tmp && mv {shlex.quote(str(rc))}.tmp {shlex.quote(str(rc))}"
    # bash started under sshd reads ~/.bashrc (which may put other pythons first on PATH) whenever it
    # sees SSH_CLIENT: drop those variables so the forwarded PATH holds inside the job.
    # The variables (API keys among them) go in the script on ssh's standard input, never on a command line.
    script = (f"cd {shlex.quote(str(Path.cwd()))} || exit 1\nunset SSH_CLIENT SSH2_CLIENT SSH_CONNECTION\n"
              f"{C.export_env(spec, env)}"
              f"setsid nohup bash --norc --noprofile -c {shlex.quote(inner)} > /dev/null 2>&1 < /dev/null & echo $!\n")
    out = C.run_ssh(spec, host["ssh"], C.REMOTE_SHELL, script=script)
    pid = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if out.returncode != 0 or not pid.isdigit():
        C.finish(job_id, 255)
        print(f"[ssh_submit] could not start {job_id} on {host['ssh']}: rc={out.returncode} {out.stderr.strip()}",
              file=sys.stderr)
        return 1
    rec.update(pid=int(pid), checked=C.now())
    C.write_record(rec)
    print(job_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
