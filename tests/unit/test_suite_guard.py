"""The suite cannot silently shrink (issue 26): where ``../shared/data`` is expected (``DFLASH_CI_SERVICES=1``,
or ``CI`` set, as CI systems export it), a missing model metadata directory fails the run at collection with
a message naming it, instead of a green run of half the suite (tests/conftest.py ``shared_data_problem``).
Each case runs pytest in a subprocess, collecting only this file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT, SHARED_DATA, expects_shared_data, shared_data_problem


def collect(env: dict) -> subprocess.CompletedProcess:
    """``pytest --collect-only`` of this file in a subprocess with ``env``."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", __file__],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def base_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "DFLASH_CI_SERVICES", "DFLASH_MODELS_DIR")}
    return {**env, **extra}


@pytest.mark.parametrize("ci", [{"DFLASH_CI_SERVICES": "1"}, {"CI": "true"}])
def test_a_missing_models_dir_fails_collection_in_ci_naming_it(tmp_path, ci):
    missing = tmp_path / "no-such-models"
    proc = collect(base_env(DFLASH_MODELS_DIR=str(missing), **ci))
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out
    assert f"DFLASH_MODELS_DIR={missing} is not a directory" in out and "collected" not in out


def test_outside_ci_the_same_run_collects(tmp_path):
    proc = collect(base_env(DFLASH_MODELS_DIR=str(tmp_path / "no-such-models")))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "test_outside_ci_the_same_run_collects" in proc.stdout


def test_the_rule_names_shared_data_and_reads_ci_like_ci_systems(tmp_path):
    assert not any(expects_shared_data(env) for env in ({}, {"CI": "false"}, {"CI": "0"}, {"CI": ""}))
    assert expects_shared_data({"CI": "1"}) and expects_shared_data({"DFLASH_CI_SERVICES": "1"})
    missing = tmp_path / "shared" / "data"
    assert shared_data_problem({}, shared=missing) is None  # not expected here
    problem = shared_data_problem({"DFLASH_CI_SERVICES": "1"}, shared=missing)
    assert problem.startswith(f"../shared/data ({missing}) is missing")
    missing.mkdir(parents=True)
    assert shared_data_problem({"CI": "true"}, shared=missing) is None
    assert "is not a directory" in shared_data_problem(
        {"CI": "true", "DFLASH_MODELS_DIR": str(tmp_path / "x")}, shared=missing
    )
    assert SHARED_DATA == Path(REPO_ROOT).parent / "shared" / "data"


def test_slow_tests_without_a_reason_are_named():
    """The run's end names every test over 120 s whose docstring gives no ``Slow:`` reason (conftest)."""
    from types import SimpleNamespace

    from conftest import has_slow_reason, unexplained_slow_tests

    def item(nid, doc):
        def f():
            pass

        f.__doc__ = doc
        return SimpleNamespace(nodeid=nid, function=f)

    items = [item("a", "Checks a.\n    Slow: one full workflow build."), item("b", "Checks b."), item("c", None)]
    assert [has_slow_reason(it) for it in items] == [True, False, False]
    calls = {it.nodeid: (secs, has_slow_reason(it)) for it, secs in zip(items, (200.0, 130.0, 300.0))}
    assert unexplained_slow_tests(calls) == ["c (300 s)", "b (130 s)"]


def test_longest_modules_exist():
    """The modules the suite starts first under xdist (conftest `LONGEST_MODULES`) are real files: a renamed one
    would silently fall back to the default order."""
    from conftest import LONGEST_MODULES, REPO

    assert [m for m in LONGEST_MODULES if not (REPO / m).is_file()] == []
