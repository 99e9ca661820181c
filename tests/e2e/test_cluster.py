"""The reduced workflow end to end through a real SLURM cluster: every rule that does work a SLURM job on the
one-node CI cluster (services, config and overlay: tests/e2e/cluster_run.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from cluster_run import (
    CI_SLURM_OVERLAY,
    REPO,
    SLURM_RULES,
    check_outputs,
    ok,
    run,
    service_env,
    unavailable,
    workdir,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def slurm_python() -> Path:
    env = service_env()
    if "SLURM_CONF" not in env or not ok(["sinfo", "-h"], env):
        unavailable("no SLURM controller answers (SLURM_CONF unset or slurmctld down)")
    python = Path(env.get("DFLASH_SLURM_PYTHON", REPO / ".venv-slurm" / "bin" / "python"))
    if not python.exists() or not ok([str(python), "-c", "import snakemake_executor_plugin_slurm"], env):
        unavailable(f"no Python with snakemake-executor-plugin-slurm at {python} (DFLASH_SLURM_PYTHON)")
    return python


def test_reduced_workflow_through_slurm(slurm_python, demo_target, tmp_path):
    """The reduced workflow, every rule a SLURM job on the one-node CI cluster.

    Slow: one whole workflow through sbatch and the plugin's status polling, about 4 min: while a job runs the
    plugin waits 10 s longer before each next check (1, 11, 21 s), so each of the five dependent levels (probe,
    completions, tokens, train, eval) is seen done after ~33 s. Mostly waiting: xdist runs other modules beside it."""
    env, python = service_env(), slurm_python
    wd = workdir(tmp_path, "ci-slurm", CI_SLURM_OVERLAY, demo_target)
    started = time.monotonic()
    text = run(
        [
            str(python),
            "-m",
            "snakemake",
            "--profile",
            "profiles/slurm",
            "--profile",
            "ci-slurm",
            "--configfile",
            "reduced.yaml",
        ],
        wd,
        env,
    )
    check_outputs(wd)
    # every rule ran as a SLURM job: the plugin keeps one log per job under .snakemake/slurm_logs/rule_*
    logs = wd / ".snakemake" / "slurm_logs"
    ran = {p.name.removeprefix("rule_") for p in logs.glob("rule_*")} if logs.is_dir() else set()
    assert SLURM_RULES <= ran, f"rules without a SLURM job log: {SLURM_RULES - ran}\n{text[-4000:]}"
    assert "sbatch" in text or "SLURM" in text
    print(f"slurm end-to-end: {time.monotonic() - started:.0f} s")
