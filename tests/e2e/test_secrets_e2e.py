"""Real Snakemake + the openai backend against test servers: the API key never leaks, and a
generation job killed with SIGKILL resumes through Snakemake sending only the unfinished prompts.

Both run the workflow up to the token shards on the session demo target.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import snakemake_command
from mini_workflow import REPO, mini_config, snakemake, token_targets, write_config

pytestmark = pytest.mark.e2e

KEY_ENV = "DFLASH_TEST_API_KEY"


def start_server_process(tmp: Path, *args: str, env: dict) -> tuple[subprocess.Popen, int]:
    """`python -m dflash_pipeline.testing.server` as a separate process; returns it and its port."""
    port_file = tmp / "port.txt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_pipeline.testing.server", "--port", "0", "--port-file", str(port_file), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 180
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"test server did not start: {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)
    return proc, int(port_file.read_text())


def _cmdlines() -> list[str]:
    """The argv of every process now running (what ``ps`` shows)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                out.append((p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:  # ended meanwhile
                pass
    return out


def test_api_key_appears_nowhere(tmp_path, demo_target, monkeypatch):
    """Planted: the endpoint's API key, an OPENAI_API_KEY in the environment (forwarded by the cluster
    profiles) and a password in a second endpoint's URL (a keyless server: basic auth in the URL works with
    the openai client only without a bearer key). None of them appears in any file of the working
    directory (logs, params and metadata under .snakemake, benchmark TSVs, shards, the report), in what
    Snakemake prints, or on the command line of any process while the run goes on (sampled from /proc)."""
    key = "sk-dflash-" + secrets.token_hex(16)
    openai_key = "sk-openai-" + secrets.token_hex(16)
    password = "pw-" + secrets.token_hex(12)
    monkeypatch.setenv(KEY_ENV, key)
    monkeypatch.setenv("OPENAI_API_KEY", openai_key)
    server, port = start_server_process(
        tmp_path, "--target", str(demo_target), "--api-key-env", KEY_ENV, env=dict(os.environ)
    )
    (tmp_path / "open").mkdir()
    open_server, open_port = start_server_process(tmp_path / "open", "--target", str(demo_target), env=dict(os.environ))
    secrets_planted = (key, openai_key, password)
    try:
        work = tmp_path / "work"
        work.mkdir()
        gen = {
            "backend": "openai",
            "max_tokens": 8,
            "max_retries": 1,
            "retry_backoff_s": 0.1,
            "endpoints": [
                {"base_url": f"http://127.0.0.1:{port}/v1", "api_key_env": KEY_ENV, "max_concurrency": 4},
                {"base_url": f"http://dflash:{password}@127.0.0.1:{open_port}/v1", "max_concurrency": 4},
            ],
        }
        write_config(work, mini_config(demo_target, generation=gen))
        cmd, env = snakemake_command(work, *token_targets(work), configfile=work / "config.yaml")
        argv_seen: set[str] = set()
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        reader = threading.Thread(target=lambda: outs.extend(proc.communicate()), daemon=True)
        outs: list[str] = []
        reader.start()
        while proc.poll() is None:  # sample every process's argv while the run goes on
            argv_seen.update(_cmdlines())
            time.sleep(0.02)  # the sampling period (a process living less may be missed)
        reader.join(60)
        assert proc.returncode == 0, "".join(outs)[-6000:]
        report = snakemake(work, "--report", str(work / "report.html"))
        outputs = [*outs, report.stdout, report.stderr]
    finally:
        for srv in (server, open_server):
            srv.send_signal(signal.SIGTERM)
            srv.wait(30)

    shard = pq.read_table(work / "results/completions/gsm8k/00000.parquet").to_pylist()
    assert shard and all(r["status"] in ("ok", "truncated") for r in shard)  # the key was accepted
    assert {t["endpoint"] for r in shard for t in r["turns"]} <= {
        f"http://127.0.0.1:{port}/v1",
        f"http://127.0.0.1:{open_port}/v1",  # recorded without its password
    }
    assert list((work / ".snakemake").rglob("*")), "expected Snakemake metadata to grep"
    assert list((work / "results").rglob("*.tsv")), "expected benchmark TSVs to grep"
    assert any("snakemake" in a for a in argv_seen), "expected to have sampled the run's processes"
    for planted in secrets_planted:
        leaks = [
            str(p.relative_to(work))
            for p in work.rglob("*")
            if p.is_file() and p.name != "config.yaml" and planted.encode() in p.read_bytes()
        ]  # config.yaml: the user's own file, where the URL was written
        assert leaks == [], f"{planted[:6]}... found in {leaks}"
        assert not any(planted in text for text in outputs), f"{planted[:6]}... printed by snakemake"
        assert not [a for a in argv_seen if planted in a], f"{planted[:6]}... on a command line"
    # the key reached the job through the environment only: the config names the variable, not the key
    assert KEY_ENV in (work / "config.yaml").read_text()


def test_killed_generation_job_resumes_through_snakemake(tmp_path, demo_target):
    """SIGKILL to Snakemake and its generation job mid-shard; `--unlock` and the rerun (same command,
    `rerun-incomplete` from the profile) finish the shard
    sending only prompts that were not finished: each prompt is in the shard once, prompts finished
    before the kill are never sent again, at most the in-flight ones (<= max_concurrency) twice."""
    from dflash_pipeline.testing.server import Faults, start_test_server

    n, conc = 12, 2
    with start_test_server(faults=Faults(delay_s=0.4)) as server:
        work = tmp_path / "work"
        work.mkdir()
        gen = {
            "backend": "openai",
            "max_tokens": 32,
            "endpoints": [{"base_url": server.base_url, "max_concurrency": conc}],
        }
        write_config(work, mini_config(demo_target, generation=gen, max_prompts=n, shard_size=16))
        targets = token_targets(work)
        progress = work / "results/completions/gsm8k/00000.parquet.progress.jsonl"
        cmd = [
            sys.executable,
            "-m",
            "snakemake",
            *targets,
            "-s",
            str(REPO / "Snakefile"),
            "-d",
            str(work),
            "--profile",
            str(REPO / "profiles" / "local"),
            "--configfile",
            str(work / "config.yaml"),
        ]
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        first = subprocess.Popen(
            cmd, cwd=work, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 300
        try:
            while not (progress.exists() and len(progress.read_text().splitlines()) >= 1 + 4):
                assert first.poll() is None, "snakemake ended before the kill"
                assert time.monotonic() < deadline, "generation did not start"
                time.sleep(0.05)
        finally:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(30)
        finished = {json.loads(line)["prompt_id"] for line in progress.read_text().splitlines()[1:] if line.strip()}
        sent_before = dict(server.stats.by_prompt)
        assert 4 <= len(finished) < n and progress.exists()

        # a SIGKILLed Snakemake leaves its lock: the user unlocks, then reruns the same command
        unlock = subprocess.run(cmd + ["--unlock"], cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert unlock.returncode == 0, (unlock.stdout + unlock.stderr)[-3000:]
        assert progress.exists()  # not a declared output: neither the kill nor the unlock removes it
        rerun = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-6000:]

    rows = pq.read_table(work / "results/completions/gsm8k/00000.parquet").to_pylist()
    assert len(rows) == n and len({r["prompt_id"] for r in rows}) == n
    assert not progress.exists()  # removed once the shard is written
    first_user = {r["prompt_id"]: next(m["content"] for m in r["messages"] if m["role"] == "user") for r in rows}
    for pid in finished:  # finished before the kill: sent exactly once in total
        assert server.stats.by_prompt[first_user[pid]] == 1, pid
    resent = sum(1 for pid in first_user if pid not in finished and sent_before.get(first_user[pid], 0) > 0)
    assert resent <= conc  # only what was in flight at the kill is sent twice
    assert sum(server.stats.by_prompt.values()) <= n + conc
