"""What the upgrade modules share: the earlier mains, the reruns this code may cause in the last main's results,
the config every main builds, and a workdir built by a main from git. The two modules (tests/e2e/test_upgrade.py:
the last main; tests/e2e/test_upgrade_previous.py: an older one) each build theirs, side by side under xdist."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile

import yaml
from conftest import REPO, snakemake

#: An older main, from before the features/engine/trainer keys (override: $DFLASH_PREVIOUS_MAIN).
PREVIOUS_MAIN = os.environ.get("DFLASH_PREVIOUS_MAIN", "77e52f4")
#: The main this code was branched from (override: $DFLASH_LAST_MAIN, a commit or ref).
LAST_MAIN = os.environ.get("DFLASH_LAST_MAIN", "a2580b8")
#: Rules this code reruns in a results directory of LAST_MAIN, with the reason ({} for a pure refactor).
#: Earlier releases' reruns are in CHANGELOG.md ("Reruns on upgrade").
_TOKENS_RERUN = "its inputs, the token shards, are rewritten (tokenize_completions)"
LAST_MAIN_RERUNS: dict[str, str] = {
    "tokenize_completions": "TOKENIZATION_REVISION 3b1f0c9e5a7d2e48: markup in answer text without output ids is "
    "refused (markup_without_ids), tool calls render with tools",
    "summarize_tokens": _TOKENS_RERUN,
    "plot_data_lengths": _TOKENS_RERUN,
    "train_drafter": _TOKENS_RERUN,
    "evaluate_acceptance": _TOKENS_RERUN,
    "plot_training": _TOKENS_RERUN,
    "summarize_run": _TOKENS_RERUN,
    "all": _TOKENS_RERUN,
}


def upgrade_config() -> dict:
    """The e2e config with fewer prompts and eval samples (every stage and a baseline run). Data paths stay
    relative: the workdir links ``data/`` to this repo's, so both trees resolve them the same."""
    cfg = yaml.safe_load((REPO / "tests" / "e2e" / "e2e_config.yaml").read_text())
    cfg["run"] = "upgrade"
    # the shipped demo target as a plain model directory (through the workdir's data/ link): every main loads
    # it as it loads a user's target, and none builds a demo target of its own
    cfg["target"] = {"path": "data/demo-target"}
    cfg["datasets"]["gsm8k"]["max_prompts"] = 4
    cfg["datasets"]["mt_bench"]["max_prompts"] = 2
    cfg["prompts"]["shard_size"] = 4
    cfg["eval"]["max_new_tokens"] = 4
    for s in cfg["eval"]["sets"].values():
        s["num_samples"] = 1
    return cfg


def built_by(ref: str, tmp_path_factory):
    """A workdir fully built by the main at ``ref`` (its Snakefile, profile and src on PYTHONPATH)."""

    def archive_of(ref):
        return subprocess.run(
            ["git", "-C", str(REPO), "archive", "--format=tar", ref], capture_output=True, timeout=120
        )

    archive = archive_of(ref)
    if archive.returncode != 0:  # a shallow clone: deepen it from its origin, then try again
        subprocess.run(["git", "-C", str(REPO), "fetch", "--quiet", "--unshallow"], capture_output=True, timeout=300)
        archive = archive_of(ref)
    assert archive.returncode == 0, (
        f"earlier main {ref} is not in this clone (fetch it, or set "
        f"DFLASH_PREVIOUS_MAIN / DFLASH_LAST_MAIN): {archive.stderr.decode()[-500:]}"
    )
    old = tmp_path_factory.mktemp(f"main-{ref}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(old, filter="data")
    work = tmp_path_factory.mktemp(f"upgrade-from-{ref}")
    (work / "data").symlink_to(REPO / "data")  # relative data paths: the same params under both trees
    (work / "config.yaml").write_text(yaml.safe_dump(upgrade_config()))
    env = {**os.environ, "PYTHONPATH": str(old / "src")}
    proc = snakemake(work, snakefile=old / "Snakefile", profile=old / "profiles" / "local", env=env, timeout=1800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return work


def snapshot(paths):
    return {str(p): (p.stat().st_mtime_ns, p.read_bytes()) for p in paths}
