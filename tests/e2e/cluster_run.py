"""What the two cluster modules share (tests/e2e/test_cluster.py: SLURM; tests/e2e/test_cluster_ssh.py: SSH
hosts): the reduced config, the CI overlays of profiles/slurm and profiles/ssh, the services' environment, a
working directory and a Snakemake run with its log. Two modules, so that pytest-xdist runs them side by side:
both wait on their executor's status polling far more than they compute.

Needs the services of `.ci/services/start` (single-node slurmctld+slurmd with munge, sshd on 127.0.0.1)
and the slurm plugin in its own venv (`.venv-slurm`, see `.ci/run`: kept out of the main venv because with
slurm-client installed and no controller up, the plugin adds ~10 s to every `snakemake` call).
CI exports DFLASH_CI_SERVICES=1, which turns every missing piece into a failure; without it these tests
skip and say what to start.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("DFLASH_CI_STATE", "/tmp/dflash-ci-services"))
EXPECTED = os.environ.get("DFLASH_CI_SERVICES") == "1"
RUN_TIMEOUT_S = 480  # the reduced workflow takes 1–2 min through the one-node CI cluster


#: The end-to-end test's reduced config (tests/e2e/e2e_config.yaml) under its own run name: each of the three
#: datasets (config/config.yaml's, merged in) one small shard, every eval set one sample, no baseline run and
#: no τ across checkpoints. Every rule that does work runs on the cluster (summaries and plots are local
#: rules), in 10 jobs. τ itself is the local end-to-end test's business.
E2E_CONFIG = yaml.safe_load((REPO / "tests" / "e2e" / "e2e_config.yaml").read_text())
REDUCED_CONFIG = {
    **E2E_CONFIG,
    "run": "cluster",
    "drafter": {**E2E_CONFIG.get("drafter", {}), "target_layer_ids": [1, 2]},
    "datasets": {
        "gsm8k": {**E2E_CONFIG["datasets"]["gsm8k"], "max_prompts": 4},
        "mt_bench": {**E2E_CONFIG["datasets"]["mt_bench"], "max_prompts": 2},
        "sharegpt": {"path": "data/sharegpt/sharegpt.json", "max_prompts": 2},
    },
    "generation": {**E2E_CONFIG["generation"], "max_tokens": 12},
    "eval": {
        **E2E_CONFIG["eval"],
        "max_new_tokens": 6,
        "baselines": [],
        "checkpoint_samples": 0,
        "sets": {
            name: {**s, "num_samples": 1} for name, s in {**E2E_CONFIG["eval"]["sets"], "sharegpt_long": {}}.items()
        },
    },
}
#: CPUs of the one CI node: every job fits it.
CI_THREADS = {
    "build_demo_target": 2,
    "generate_completions": 2,
    "tokenize_completions": 1,
    "train_drafter": 2,
    "evaluate_acceptance": 2,
}
#: The CI overlay replaces what a real cluster sets (partitions, big memory, many CPUs) and conda, which
#: cannot run here (env-modules is a no-op: no rule declares `envmodules:`). Everything else (executor,
#: plugin settings, the rules' own resources) comes from profiles/slurm.
CI_SLURM_OVERLAY = {
    "cores": 2,
    "jobs": 4,
    "latency-wait": 10,
    "retries": 0,
    "software-deployment-method": ["env-modules"],
    "slurm-status-command": "squeue",  # no slurmdbd: sacct would hang the run forever
    "slurm-no-account": True,
    "slurm-init-seconds-before-status-checks": 1,
    "slurm-keep-successful-logs": True,
    "set-threads": CI_THREADS,
    "default-resources": {"slurm_partition": "main", "mem_mb": 2000, "runtime": 10},
    "set-resources": {"train_drafter": {"mem_mb": 4000}, "evaluate_acceptance": {"mem_mb": 4000}},
}
CI_SSH_OVERLAY = {
    "cores": 2,
    "jobs": 4,
    "latency-wait": 10,
    "retries": 0,
    "seconds-between-status-checks": 1,
    "set-threads": CI_THREADS,
}


def service_env() -> dict:
    """The environment plus what `.ci/services/start` exported into $DFLASH_CI_STATE/env.sh."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env_sh = STATE / "env.sh"
    if env_sh.is_file():
        for line in env_sh.read_text().splitlines():
            if line.startswith("export ") and "=" in line:
                key, _, value = line[len("export ") :].partition("=")
                env.setdefault(key, value.strip("'\""))
    env.pop("SNAKEMAKE_PROFILE", None)
    return env


def unavailable(reason: str):
    if EXPECTED:
        pytest.fail(f"DFLASH_CI_SERVICES=1 but {reason}")
    pytest.skip(f"{reason} (run .ci/services/start; CI sets DFLASH_CI_SERVICES=1 and never skips this)")


def ok(cmd: list[str], env: dict, timeout: float = 30) -> bool:
    try:
        return subprocess.run(cmd, env=env, capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def workdir(tmp_path: Path, overlay_name: str, overlay: dict, target: Path) -> Path:
    wd = tmp_path / "wd"
    wd.mkdir()
    for name in ("Snakefile", "rules", "scripts", "envs", "config", "data", "profiles", "cluster"):
        (wd / name).symlink_to(REPO / name)
    config = {**REDUCED_CONFIG, "target": {**REDUCED_CONFIG["target"], "path": str(target)}}
    (wd / "reduced.yaml").write_text(yaml.safe_dump(config))
    (wd / overlay_name).mkdir()
    (wd / overlay_name / "config.yaml").write_text(yaml.safe_dump(overlay))
    return wd


def run(cmd: list[str], wd: Path, env: dict) -> str:
    """Run Snakemake; on timeout SIGINT it (the slurm executor ignores SIGTERM) and fail with its log."""
    with open(wd / "snakemake.out", "w") as out:
        proc = subprocess.Popen(cmd, cwd=wd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = "timeout"
    text = (wd / "snakemake.out").read_text()
    assert rc == 0, f"snakemake exited {rc}:\n{text[-8000:]}"
    return text


def check_outputs(wd: Path) -> None:
    final = wd / "results" / "checkpoints" / "cluster" / "final"
    assert (final / "config.json").is_file() and list(final.glob("*.safetensors"))
    acceptance = yaml.safe_load((wd / "results" / "eval" / "cluster" / "acceptance.json").read_text())
    assert acceptance  # τ values themselves are the local end-to-end test's business


SLURM_RULES = {
    "probe_target",
    "shard_prompts",
    "generate_completions",
    "tokenize_completions",
    "train_drafter",
    "evaluate_acceptance",
}
