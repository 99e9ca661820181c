"""Fixtures and helpers shared by tests/unit/ and tests/e2e/.

``demo_target`` is the shipped tiny Qwen3 demo target (``data/demo-target``, the default config's).
:func:`tiny_target_and_drafter` builds a random tiny target with a DFlash drafter on it (model and eval
tests); :class:`FeatureServer` runs one ``features serve`` subprocess (stream tests); :func:`snakemake` runs the repo's workflow in a working directory with the local profile and
:func:`planned_jobs` reads a dry run's job counts (e2e tests).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite runs more busy threads than the machine has cores (two xdist workers, each a Snakemake with --cores 2,
# training ranks, engines). An OpenMP thread that waits for work spins by default, on a core another process
# needs: on 2 cores the e2e workflow took 162 s of CPU beside a running suite, and 75 s with passive waiting.
# Every subprocess inherits it (set before any test imports torch, whose OpenMP reads it when loaded); results do
# not depend on it. Users' Snakemake never oversubscribes (a job's threads are counted against --cores).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO_ROOT = Path(__file__).resolve().parents[1]
REPO = REPO_ROOT
#: Cores the e2e tests give Snakemake (the local profile uses the machine's; the suite is sized for 2).
SNAKEMAKE_CORES = 2
GSM8K_TRAIN = REPO_ROOT / "data" / "gsm8k" / "train.jsonl"
SHAREGPT = REPO_ROOT / "data" / "sharegpt" / "sharegpt.json"
#: The shipped demo target (dflash_pipeline.workflow.keyed_paths.SHIPPED_DEMO_TARGET) and the settings it was built with.
SHIPPED_DEMO_TARGET = REPO_ROOT / "data" / "demo-target"
SHIPPED_DEMO_SETTINGS = {"seed": 0, "vocab_size": 1024, "hidden_size": 128, "num_hidden_layers": 8, "train_steps": 600}


#: ``../shared/data`` beside the checkout: the model metadata corpus (``models/``: configs, tokenizers, chat
#: templates) and the original data files that the zoo, template, probe and prompt tests read.
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


def expects_shared_data(environ=os.environ) -> bool:
    """Whether this run must have ``../shared/data``: in CI (``DFLASH_CI_SERVICES=1``, or ``CI`` set to
    anything but empty/``0``/``false``, as CI systems export it), where it always exists."""
    ci = (environ.get("CI") or "").strip().lower()
    return environ.get("DFLASH_CI_SERVICES") == "1" or ci not in ("", "0", "false", "no")


def shared_data_problem(environ=os.environ, shared: Path = SHARED_DATA) -> str | None:
    """Why a run that :func:`expects_shared_data` cannot go on (None: it can, or it does not expect it):
    ``$DFLASH_MODELS_DIR`` names a missing directory, or ``../shared/data`` (``shared``, default
    :data:`SHARED_DATA`) is not there. Without them the corpus tests skip or vanish and a green run would
    cover half the suite."""
    if not expects_shared_data(environ):
        return None
    named = environ.get("DFLASH_MODELS_DIR")
    if named and not Path(named).is_dir():
        return (
            f"DFLASH_MODELS_DIR={named} is not a directory; the model metadata corpus (configs, tokenizers, chat "
            f"templates) must be there in CI, or the zoo, template and probe tests skip"
        )
    if not Path(shared).is_dir():
        return (
            f"../shared/data ({shared}) is missing: CI needs the shared data beside the checkout (the "
            f"model metadata corpus in models/ and the original datasets); without it about half the suite "
            f"(zoo, templates, probe) skips or is never collected"
        )
    return None


def pytest_configure(config):
    """Fail the run before collection when CI expects ``../shared/data`` and it is missing
    (:func:`shared_data_problem`)."""
    problem = shared_data_problem()
    if problem:
        raise pytest.UsageError(f"{problem} (DFLASH_CI_SERVICES=1 or CI is set)")


def models_dir() -> Path | None:
    """Directory of real model metadata (config.json, tokenizer_config.json, chat templates):
    ``$DFLASH_MODELS_DIR``, else ``tests/data/models`` in the repo, else ``../shared/data/models``."""
    for cand in (
        os.environ.get("DFLASH_MODELS_DIR"),
        REPO_ROOT / "tests" / "data" / "models",
        REPO_ROOT.parent / "shared" / "data" / "models",
    ):
        if cand and Path(cand).is_dir():
            return Path(cand)
    return None


@pytest.fixture(scope="session")
def demo_target() -> Path:
    """Path of the shipped demo target (tokenizer + Qwen3ForCausalLM + chat template, ``data/demo-target``): the
    default config's target, committed, so no test builds it. Read-only: a test that changes a target copies it."""
    return SHIPPED_DEMO_TARGET


@pytest.fixture(scope="session")
def real_models_dir() -> Path:
    """The real model metadata directory; skips when it is not available."""
    d = models_dir()
    if d is None:
        pytest.skip("no model metadata directory (set DFLASH_MODELS_DIR)")
    return d


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """Interpreter of the vLLM environment (``.ci/run`` builds ``.venv-vllm``). In CI
    (``DFLASH_CI_SERVICES=1``) a missing engine fails the test; locally it skips and says how to install."""
    from dflash_pipeline.core.vllm_env import VLLMNotFound, require_vllm_python

    try:
        return require_vllm_python()
    except VLLMNotFound as exc:
        if os.environ.get("DFLASH_CI_SERVICES") == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))


def tiny_target_and_drafter(
    *, num_hidden_layers: int, num_draft_layers: int, target_layer_ids: list[int], block_size: int = 4
):
    """``(target, drafter)``: a random Qwen3 target (vocab 96, hidden 32, 4 heads / 2 KV heads of dim 8,
    float32, eval mode, frozen) and an untrained DFlash drafter on it (mask token 95), seeded with
    ``torch.manual_seed(0)`` so every call gives the same weights."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_pipeline.drafter import model as M

    torch.manual_seed(0)
    tcfg = Qwen3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    target = Qwen3ForCausalLM(tcfg).eval().requires_grad_(False)
    dcfg = M.drafter_config_from_target(
        tcfg,
        block_size=block_size,
        num_draft_layers=num_draft_layers,
        target_layer_ids=target_layer_ids,
        mask_token_id=95,
    )
    return target, M.DFlashDrafter(dcfg).eval()


#: Fleet knobs small enough that a dead server is taken out, and the breaker opens, within a second.
FAST_FLEET = {
    "request_timeout_s": 30,
    "max_retries": 6,
    "endpoint_max_failures": 1,
    "endpoint_reprobe_s": 0.05,
    "retry_backoff_s": 0.01,
    "retry_backoff_max_s": 0.05,
    "circuit_breaker_failures": 3,
}


class FeatureServer:
    """One ``python -m dflash_pipeline.features serve`` subprocess (hf backend) on ``target``, serving the
    hidden states of ``layers`` (of ``num_hidden_layers``) and writing path-transport replies under
    ``scratch``; ``extra``: more CLI arguments (e.g. ``--hang-after``); ``api_key``: the key it requires. The constructor returns once the
    server printed ``[features] serving <url>`` (then ``url``; RuntimeError if it exits first); ``kill()``
    SIGKILLs it (if still running) and reaps it."""

    def __init__(
        self,
        target: Path,
        scratch: Path,
        *,
        layers,
        num_hidden_layers: int = 4,
        last_hidden: bool = False,
        extra: tuple = (),
        api_key: str | None = None,
    ):
        cmd = [
            sys.executable,
            "-m",
            "dflash_pipeline.features",
            "serve",
            "--target",
            str(target),
            "--layer-ids",
            ",".join(map(str, layers)),
            "--num-hidden-layers",
            str(num_hidden_layers),
            "--scratch-dir",
            str(scratch),
        ]
        if last_hidden:
            cmd.append("--last-hidden")
        cmd += list(extra)
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        if api_key:  # the server reads it from its environment (never its command line)
            env["DFLASH_FEATURES_API_KEY"] = api_key
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.log = []
        for line in self.proc.stdout:  # blocks until the server reports it is ready (or exits)
            self.log.append(line)
            if line.startswith("[features] serving "):
                self.url = line.split()[2]
                break
        else:
            raise RuntimeError("feature server exited before serving:\n" + "".join(self.log))
        self.scratch = scratch

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.proc.stdout.close()


def snakemake(
    workdir: Path,
    *args: str,
    configfile: Path | None = None,
    timeout: int = 900,
    env: dict | None = None,
    snakefile: Path | None = None,
    profile: Path | None = None,
) -> subprocess.CompletedProcess:
    """Run snakemake on the repo's Snakefile (or ``snakefile``) in ``workdir`` with the local profile (or
    ``profile``) on :data:`SNAKEMAKE_CORES` cores; ``args`` (targets, flags) come before
    ``--configfile``, which takes several values. Returns the finished process."""
    cmd, base = snakemake_command(workdir, *args, configfile=configfile, env=env, snakefile=snakefile, profile=profile)
    return subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=timeout, env=base)


def snakemake_command(
    workdir: Path,
    *args: str,
    configfile: Path | None = None,
    env: dict | None = None,
    snakefile: Path | None = None,
    profile: Path | None = None,
) -> tuple[list[str], dict]:
    """``(argv, environment)`` of the :func:`snakemake` call with these arguments, for tests that start it
    themselves (``subprocess.Popen``, e.g. to kill it mid-run)."""
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        *args,
        "-s",
        str(snakefile or REPO / "Snakefile"),
        "-d",
        str(workdir),
        "--profile",
        str(profile or REPO / "profiles" / "local"),
        "--cores",
        str(SNAKEMAKE_CORES),
        "--configfile",
        str(configfile or workdir / "config.yaml"),
    ]
    base = dict(os.environ if env is None else env)
    base["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}"
    return cmd, base


def planned_jobs(proc: subprocess.CompletedProcess) -> dict[str, int]:
    """Job counts per rule from a dry run's "Job stats" table ({} when there is nothing to do)."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    if "Nothing to be done" in out:
        return {}
    table = out.split("Job stats:", 1)[1]
    counts = {}
    for line in table.splitlines()[3:]:
        m = re.match(r"^(\w+)\s+(\d+)$", line.strip())
        if not m:
            break
        if m.group(1) != "total":  # the table's last row sums the others; it is not a rule
            counts[m.group(1)] = int(m.group(2))
    return counts


#: Headless Chromium flags for the report screenshot test: no sandbox (root in CI), no GPU, no network
#: side channels; each call gets its own fresh profile directory.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


@pytest.fixture(scope="session")
def chromium(tmp_path_factory):
    """``run(url, *args, timeout=...)`` -> CompletedProcess of headless Chromium (``.ci/run`` installs Debian's
    ``chromium``). In CI (``DFLASH_CI_SERVICES=1``) a missing browser fails the test; locally it skips."""
    import shutil
    import subprocess

    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        msg = "headless Chromium not found: `apt-get install -y --no-install-recommends chromium`"
        if os.environ.get("DFLASH_CI_SERVICES") == "1":
            pytest.fail(msg)
        pytest.skip(msg)

    def run(url: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
        profile = tmp_path_factory.mktemp("chromium-profile")
        return subprocess.run(
            [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, url],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


def counting_train_setup(
    root: Path, *, min_len: int, max_position_embeddings: int, unsupervised_record: int | None = None
):
    """A tiny saved Qwen3 target (vocab 80, 4 layers; LM head scaled ×40 so its logits have a trained model's
    scale) and one token shard of 24 learnable records (each token the previous + 1, the second half
    supervised; ``unsupervised_record`` gets no supervised token) under ``root``, plus the probe's drafter
    block. Returns ``(root, probe)``."""
    import json

    import numpy as np
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_pipeline.core.contracts import TOKEN_SCHEMA
    from dflash_pipeline.core.shards import table_from_records, write_parquet

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=80,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=max_position_embeddings,
    )
    target = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # a trained model's head has logits of a useful scale; random init's are ~uniform
        target.lm_head.weight.mul_(40.0)
    target.save_pretrained(root / "target")
    rng = np.random.default_rng(0)
    recs = []
    for i in range(24):
        n = int(rng.integers(min_len, 40))
        start = int(rng.integers(0, 78))
        ids = [(start + j) % 78 for j in range(n)]  # learnable: each token is the previous one + 1
        mask = [0] * n if i == unsupervised_record else [0] * (n // 2) + [1] * (n - n // 2)
        recs.append(
            {
                "prompt_id": f"p{i}",
                "input_ids": ids,
                "loss_mask": mask,
                "num_tokens": n,
                "num_loss_tokens": sum(mask),
                "truncated": False,
            }
        )
    write_parquet(root / "tokens.parquet", table_from_records(recs, TOKEN_SCHEMA))
    probe = {"drafter": {"block_size": 4, "num_draft_layers": 1, "target_layer_ids": [1, 2], "mask_token_id": 79}}
    (root / "probe.json").write_text(json.dumps(probe))
    return root, probe


#: A check appended to a copy of the page: once everything loaded, every image's natural width and the τ
#: table's cells go into the DOM, which --dump-dom prints.
PROBE_SCRIPT = """<script>
window.addEventListener('load', () => {
  const out = document.createElement('pre'); out.id = 'image-check';
  out.textContent = JSON.stringify([...document.images].map(
    i => [i.closest('figure')?.id, i.naturalWidth, i.complete]));
  document.body.appendChild(out);
});
</script>"""


def artefact_dir() -> Path:
    """Where tests keep artefacts a person looks at (screenshots): ``$DFLASH_TEST_ARTEFACTS``, else tests/artefacts/."""
    d = Path(os.environ.get("DFLASH_TEST_ARTEFACTS", REPO / "tests" / "artefacts"))
    d.mkdir(parents=True, exist_ok=True)
    return d


#: The longest modules, longest first (as measured on 2 cores; the cluster ones mostly wait on their executor's
#: status polling): under pytest-xdist they start first, so no worker is left alone with one at the end.
LONGEST_MODULES = (
    "tests/e2e/test_cluster.py",
    "tests/e2e/test_upgrade_previous.py",
    "tests/e2e/test_features_e2e.py",
    "tests/bench/test_bench_families.py",
    "tests/e2e/test_engine_vllm.py",
    "tests/e2e/test_e2e.py",
    "tests/e2e/test_upgrade.py",
    "tests/e2e/test_cluster_ssh.py",
    "tests/e2e/test_stable_shards.py",
    "tests/e2e/test_resume_e2e.py",
)


def pytest_collection_modifyitems(session, config, items):
    """The longest modules first (`LONGEST_MODULES`), then the other end-to-end and bench modules, then the
    unit modules, each module's tests in their order: under pytest-xdist (`--dist loadfile
    --no-loadscope-reorder`, one module to a worker, in this order) the short unit modules fill the gaps at the
    end, so the workers finish together."""
    rank = {m: i for i, m in enumerate(LONGEST_MODULES)}

    def key(it):
        module = it.nodeid.split("::", 1)[0]
        if module in rank:
            return (0, rank[module])
        return (1, 0) if module.startswith(("tests/e2e/", "tests/bench/")) else (2, 0)

    items.sort(key=key)


#: A test that runs longer than this must say why in its docstring (a line starting ``Slow:``); the end of every
#: run names the ones that do not (seconds of the call phase, on the machine that ran it).
SLOW_TEST_S = 120.0
#: nodeid -> (seconds, has a ``Slow:`` reason) of the calls over SLOW_TEST_S. Filled from the reports, which
#: carry the reason (``user_properties``): under pytest-xdist the controller that prints the summary holds no
#: test items, only the workers' reports.
_slow_calls: dict[str, tuple[float, bool]] = {}


def has_slow_reason(item) -> bool:
    """Whether the test function's docstring has a line starting ``Slow:``."""
    doc = getattr(getattr(item, "function", None), "__doc__", None) or ""
    return any(line.strip().startswith("Slow:") for line in doc.splitlines())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        report.user_properties.append(("slow_reason", has_slow_reason(item)))
    return report


def pytest_runtest_logreport(report):
    if report.when == "call" and report.duration > SLOW_TEST_S:
        _slow_calls[report.nodeid] = (report.duration, dict(report.user_properties).get("slow_reason", False))


def unexplained_slow_tests(calls: dict[str, tuple[float, bool]]) -> list[str]:
    """``nodeid (seconds)`` of the slow ``calls`` (nodeid -> seconds, has a reason) without a ``Slow:`` reason,
    slowest first."""
    return [
        f"{nid} ({secs:.0f} s)"
        for nid, (secs, explained) in sorted(calls.items(), key=lambda kv: -kv[1][0])
        if not explained
    ]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    unexplained = unexplained_slow_tests(_slow_calls)
    if unexplained:
        terminalreporter.write_sep("=", f"tests over {SLOW_TEST_S:.0f} s without a 'Slow:' reason in their docstring")
        for line in unexplained:
            terminalreporter.write_line(line)
