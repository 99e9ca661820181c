"""Shared pieces of the ssh profile's submit/status/cancel commands (Snakemake cluster-generic executor).

A job is a record ``.snakemake/ssh_jobs/<id>.json`` (host, GPU ids, CPU slots, remote pid) in the working
directory, which the hosts share at the same absolute path. The remote side writes ``<id>.rc`` when the
job ends; a record without ``.rc`` holds its host's slots and GPUs. Placement happens under a file lock on
the submit host, so GPU ids are never handed out twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import subprocess
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
JOBS_DIR = Path(".snakemake") / "ssh_jobs"
#: Variables a job needs from the submitting shell (same paths everywhere, so PATH carries over).
FORWARD_ENV = ["PATH", "VIRTUAL_ENV", "PYTHONPATH", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
               "TOKENIZERS_PARALLELISM", "SGLANG_API_KEY", "OPENAI_API_KEY"]


def hosts_file() -> Path:
    return Path(os.environ.get("DFLASH_SSH_HOSTS") or HERE.parent / "profiles" / "ssh" / "hosts.yaml")


def load_hosts() -> dict:
    import yaml

    path = hosts_file()
    spec = yaml.safe_load(path.read_text()) or {}
    hosts = spec.get("hosts") or []
    if not hosts:
        raise SystemExit(f"{path}: no hosts listed (hosts: [{{name, ssh, slots, gpus}}])")
    for h in hosts:
        h.setdefault("ssh", h["name"])
        h.setdefault("slots", 1)
        h["gpus"] = [str(g) for g in (h.get("gpus") or [])]
    spec["hosts"] = hosts
    spec["ssh_config"] = os.environ.get("DFLASH_SSH_CONFIG") or spec.get("ssh_config")
    extra = os.environ.get("DFLASH_SSH_FORWARD_ENV", "").replace(",", " ").split()
    spec["forward_env"] = FORWARD_ENV + list(spec.get("forward_env") or []) + extra
    return spec


def ssh_cmd(spec: dict, dest: str, remote: str) -> list[str]:
    cmd = ["ssh", "-o", "BatchMode=yes"]
    if spec.get("ssh_config"):
        cmd += ["-F", str(spec["ssh_config"])]
    return cmd + [dest, remote]


def run_ssh(spec: dict, dest: str, remote: str, timeout: float = 60, script: str | None = None
            ) -> subprocess.CompletedProcess:
    """Run ``remote`` on ``dest``; ``script``: text for its standard input (how secrets travel: never argv)."""
    if script is None:
        return subprocess.run(ssh_cmd(spec, dest, remote), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    return subprocess.run(ssh_cmd(spec, dest, remote), capture_output=True, text=True, timeout=timeout,
                          input=script)


@contextlib.contextmanager
def locked():
    JOBS_DIR.mkdir(parents=True, exist_ok=True)
    with open(JOBS_DIR / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def record_path(job_id: str) -> Path:
    return JOBS_DIR / f"{job_id}.json"


def rc_path(job_id: str) -> Path:
    return JOBS_DIR / f"{job_id}.rc"


def read_record(job_id: str) -> dict:
    return json.loads(record_path(job_id).read_text())


def write_record(rec: dict) -> None:
    tmp = record_path(rec["id"]).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(rec))
    tmp.replace(record_path(rec["id"]))


def finish(job_id: str, code: int) -> None:
    """Mark a job ended from the submit side (lost, cancelled, failed to start): frees its host share."""
    tmp = rc_path(job_id).with_suffix(".rc.tmp")
    tmp.write_text(f"{code}\n")
    tmp.replace(rc_path(job_id))


def exit_code(job_id: str):
    try:
        return int(rc_path(job_id).read_text().strip() or "255")
    except FileNotFoundError:
        return None


def active_records() -> list[dict]:
    out = []
    for p in JOBS_DIR.glob("*.json"):
        job_id = p.stem
        if exit_code(job_id) is None:
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                out.append(json.loads(p.read_text()))
    return out


def now() -> float:
    return time.time()


def export_env(spec: dict, extra: dict) -> str:
    """``export K=V`` lines of the forwarded variables and ``extra``, for a script fed to the remote shell on
    its standard input: the values (API keys among them) appear on no command line, here (ssh's argv) or
    there (the remote shell's), so ``ps`` shows none of them."""
    pairs = {k: os.environ[k] for k in spec["forward_env"] if k in os.environ}
    pairs.update(extra)
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in pairs.items())


#: The remote command of a submission: a shell reading its script from standard input (no rc files, so a
#: ~/.bashrc cannot put other pythons first on the forwarded PATH).
REMOTE_SHELL = "bash --norc --noprofile -s"
