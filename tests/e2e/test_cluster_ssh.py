"""The reduced workflow end to end through real SSH hosts: every job a remote shell on the loopback sshd
(services, config and overlay: tests/e2e/cluster_run.py)."""

from __future__ import annotations

import sys
import time

import pytest
import yaml
from cluster_run import CI_SSH_OVERLAY, SLURM_RULES, check_outputs, ok, run, service_env, unavailable, workdir

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def ssh_ready() -> None:
    env = service_env()
    if "DFLASH_SSH_CONFIG" not in env or not ok(
        ["ssh", "-F", env["DFLASH_SSH_CONFIG"], env.get("DFLASH_SSH_HOST", "dflash-ci"), "true"], env
    ):
        unavailable("no sshd answers (DFLASH_SSH_CONFIG unset or sshd down)")
    if not ok([sys.executable, "-c", "import snakemake_executor_plugin_cluster_generic"], env):
        unavailable("snakemake-executor-plugin-cluster-generic is not installed (pip install -e '.[ssh]')")


def test_reduced_workflow_through_ssh_hosts(ssh_ready, demo_target, tmp_path):
    """The reduced workflow, every job over ssh on the loopback host.

    Slow: one whole workflow, each job a remote shell (about 2.5 min on 2 cores)."""
    env = service_env()
    wd = workdir(tmp_path, "ci-ssh", CI_SSH_OVERLAY, demo_target)
    hosts = {"hosts": [{"name": "loopback", "ssh": env.get("DFLASH_SSH_HOST", "dflash-ci"), "slots": 2, "gpus": []}]}
    (wd / "hosts.yaml").write_text(yaml.safe_dump(hosts))
    env["DFLASH_SSH_HOSTS"] = str(wd / "hosts.yaml")
    started = time.monotonic()
    text = run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "--profile",
            "profiles/ssh",
            "--profile",
            "ci-ssh",
            "--configfile",
            "reduced.yaml",
        ],
        wd,
        env,
    )
    check_outputs(wd)
    jobs = wd / ".snakemake" / "ssh_jobs"
    records = {p.stem: yaml.safe_load(p.read_text()) for p in jobs.glob("*.json")}
    assert {r["rule"] for r in records.values()} >= SLURM_RULES, text[-4000:]
    for job_id, rec in records.items():
        assert (jobs / f"{job_id}.rc").read_text().strip() == "0", (jobs / f"{job_id}.log").read_text()[-3000:]
        assert rec["host"] == "loopback" and rec["threads"] <= 2
    print(f"ssh end-to-end: {time.monotonic() - started:.0f} s")
