"""Session-scoped fixtures shared by the test suite.

``demo_target`` builds the tiny Qwen3 demo target once per session (few training steps, so it is fast but
its continuations are only loosely structured); tests that need a well-trained target build their own.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parents[1]
GSM8K_TRAIN = REPO_ROOT / "data" / "gsm8k" / "train.jsonl"
SHAREGPT = REPO_ROOT / "data" / "sharegpt" / "sharegpt.json"
#: Steps of the session demo target: enough for the loss to fall clearly, cheap on 2 cores.
DEMO_TEST_STEPS = 50


def models_dir() -> Path | None:
    """Directory of real model metadata (config.json, tokenizer_config.json, chat templates):
    ``$DFLASH_MODELS_DIR``, else ``tests/data/models`` in the repo, else ``../shared/data/models``."""
    for cand in (os.environ.get("DFLASH_MODELS_DIR"), REPO_ROOT / "tests" / "data" / "models",
                 REPO_ROOT.parent / "shared" / "data" / "models"):
        if cand and Path(cand).is_dir():
            return Path(cand)
    return None


@pytest.fixture(scope="session")
def demo_target(tmp_path_factory) -> Path:
    """Path of a tiny demo target (tokenizer + Qwen3ForCausalLM + chat template), built once per session."""
    from dflash_pipeline.demo import build_demo_target

    out = tmp_path_factory.mktemp("demo") / "demo-target"
    return build_demo_target(out, [GSM8K_TRAIN, SHAREGPT], seed=0, train_steps=DEMO_TEST_STEPS, log=None)


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
    from dflash_pipeline.vllm_env import VLLMNotFound, require_vllm_python

    try:
        return require_vllm_python()
    except VLLMNotFound as exc:
        if os.environ.get("DFLASH_CI_SERVICES") == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))


#: Headless Chromium flags for the report screenshot test: no sandbox (root in CI), no GPU, no network
#: side channels; each call gets its own fresh profile directory.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")


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
        return subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, url],
                              capture_output=True, text=True, timeout=timeout)

    return run
