"""Completions stage, ``generation.client_processes > 1``: one shard's requests spread over several client
processes (shared prompt queue, the parent the only writer of the progress file) against the local test
server: order and exactly-once, an endpoint dying, the breaker, resume, raw mode, and no orphans after a
kill -9 of the job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_completions import KILL_SCRIPT, MULTI, gen_cfg, openai_cfg, read_records, single_turn, write_prompts
from test_completions_raw import raw_cfg

from dflash_pipeline.completions import (
    PROGRESS_SUFFIX,
    ProgressLog,
    _fingerprint,
    _split_caps,
    generate_shard,
    make_backend,
)
from dflash_pipeline.core.errors import ConfigError, GenerationError
from dflash_pipeline.testing.server import Faults, start_test_server

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_split_caps_sums_to_each_cap():
    cfg = gen_cfg(
        backend="openai",
        client_processes=3,
        endpoints=[{"base_url": f"http://h{i}/v1", "max_concurrency": c} for i, c in enumerate([7, 3, 4, 64])],
    )
    parts = _split_caps(cfg, 3)
    for j, c in enumerate([7, 3, 4, 64]):
        shares = [p["endpoints"][j]["max_concurrency"] for p in parts]
        assert sum(shares) == c and max(shares) - min(shares) <= 1
    assert all(p["client_processes"] == 1 for p in parts)


def test_client_processes_only_for_openai(tmp_path):
    with pytest.raises(ConfigError, match="client_processes"):
        make_backend(gen_cfg(client_processes=2), target_dir=tmp_path)


def test_two_processes_two_endpoints_each_prompt_once_in_order(tmp_path):
    n = 60
    prompts = write_prompts(tmp_path / "p.parquet", single_turn(n) + MULTI)
    with start_test_server() as a, start_test_server() as b:
        cfg = openai_cfg(a.base_url, b.base_url, concurrency=4, client_processes=2, model=None)
        stats = generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=None, gen_cfg=cfg)
        sent = a.stats.by_conversation + b.stats.by_conversation
        assert a.stats.answered > 0 and b.stats.answered > 0
    recs = read_records(tmp_path / "c.parquet")
    assert [r["prompt_id"] for r in recs] == [p["prompt_id"] for p in prompts]
    assert all(r["status"] == "ok" and r["model"] == "test-model" for r in recs)
    assert all(v == 1 for v in sent.values()) and sum(sent.values()) == n + 4  # MULTI has 4 user turns
    assert stats["run"]["client_processes"] == 2 and stats["run"]["attempts"] == stats["run"]["requests"] == n + 4
    assert sum(e["attempts"] for e in stats["run"]["endpoints"].values()) == n + 4
    assert recs[-3]["messages"][4]["content"] == "Answer 2 to: And times 4?"  # multi-turn history per process


def test_endpoint_dies_mid_shard_with_two_processes(tmp_path):
    n = 40
    prompts = write_prompts(tmp_path / "p.parquet", single_turn(n))
    with start_test_server() as a, start_test_server(faults=Faults(die_after=5)) as b:
        cfg = openai_cfg(a.base_url, b.base_url, concurrency=2, endpoint_max_failures=2, client_processes=2)
        stats = generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=None, gen_cfg=cfg)
        assert b.stats.answered == 5 and a.stats.answered + b.stats.answered == n
        assert all(v == 1 for v in a.stats.by_prompt.values())
    recs = read_records(tmp_path / "c.parquet")
    assert [r["prompt_id"] for r in recs] == [p["prompt_id"] for p in prompts]
    assert all(r["status"] == "ok" for r in recs)
    assert stats["run"]["endpoints"][b.base_url]["taken_out"] >= 1


def test_breaker_with_two_processes_keeps_progress(tmp_path):
    n = 30
    write_prompts(tmp_path / "p.parquet", single_turn(n))
    out = tmp_path / "c.parquet"
    with start_test_server(faults=Faults(die_after=6)) as srv:
        cfg = openai_cfg(
            srv.base_url, concurrency=2, circuit_breaker_failures=3, endpoint_max_failures=1, client_processes=2
        )
        with pytest.raises(GenerationError, match=r"circuit breaker open.* 6 of 30 conversations are finished"):
            generate_shard(tmp_path / "p.parquet", out, target_dir=None, gen_cfg=cfg)
    lines = Path(str(out) + PROGRESS_SUFFIX).read_text().splitlines()
    assert len(lines) == 1 + 6 and not out.exists()


def test_resume_with_two_processes_sends_only_unfinished(tmp_path):
    n = 24
    prompts = write_prompts(tmp_path / "p.parquet", single_turn(n))
    out = tmp_path / "c.parquet"
    progress = Path(str(out) + PROGRESS_SUFFIX)
    with start_test_server() as srv:
        generate_shard(tmp_path / "p.parquet", out, target_dir=None, gen_cfg=openai_cfg(srv.base_url))
    # a partial progress file (as a killed job leaves it): the header, the first 10 conversations, a torn line
    cfg = openai_cfg(srv.base_url, client_processes=2)
    log = ProgressLog(progress, _fingerprint("openai", cfg, None, None))
    log.open(read_records(out)[:10])
    log.close()
    with progress.open("a") as fh:
        fh.write('{"prompt_id": "abc", "messa')
    out.unlink()
    with start_test_server() as srv2:
        cfg = openai_cfg(srv2.base_url, client_processes=2)
        stats = generate_shard(tmp_path / "p.parquet", out, target_dir=None, gen_cfg=cfg)
        sent = srv2.stats.by_prompt
    assert sorted(sent) == sorted(f"question {i}" for i in range(10, n)) and all(v == 1 for v in sent.values())
    assert stats["run"]["resumed"] == 10 and stats["run"]["generated"] == n - 10 and not progress.exists()
    assert [r["prompt_id"] for r in read_records(out)] == [p["prompt_id"] for p in prompts]


def test_raw_completions_mode_with_two_processes(tmp_path, demo_target):
    prompts = write_prompts(tmp_path / "p.parquet", MULTI + single_turn(8))
    with start_test_server(tokenizer_dir=demo_target) as srv:
        cfg = raw_cfg(srv.base_url, client_processes=2)
        stats = generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=demo_target, gen_cfg=cfg)
        assert srv.stats.completions_requests == srv.stats.chat_requests == 12
    recs = read_records(tmp_path / "c.parquet")
    assert [r["prompt_id"] for r in recs] == [p["prompt_id"] for p in prompts]
    assert all(r["status"] == "ok" for r in recs) and stats["run"]["client_processes"] == 2


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie no longer runs (nobody may reap it in a container)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_job_leaves_no_client_processes(tmp_path):
    n, kill_after, conc = 80, 10, 4
    prompts = write_prompts(tmp_path / "p.parquet", single_turn(n))
    out, pid_file = tmp_path / "c.parquet", tmp_path / "pids.json"
    with start_test_server(faults=Faults(delay_s=0.05)) as srv:
        cfg = openai_cfg(srv.base_url, concurrency=conc, client_processes=2)
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                KILL_SCRIPT,
                str(tmp_path / "p.parquet"),
                str(out),
                json.dumps(cfg),
                str(kill_after),
                str(pid_file),
            ],
            env=env,
            capture_output=True,
            timeout=120,
        )
        assert proc.returncode == -9, proc.stderr.decode()[-2000:]
        pids = json.loads(pid_file.read_text())
        assert len(pids) == 2
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids):
            assert time.monotonic() < deadline, f"client processes still alive: {[p for p in pids if _alive(p)]}"
            time.sleep(0.05)
        seen = dict(srv.stats.by_prompt)
        assert sum(seen.values()) < n  # stopped mid-shard, not finished by orphans
        done = ProgressLog(tmp_path / ("c.parquet" + PROGRESS_SUFFIX), _fingerprint("openai", cfg, None, None)).load()
        logged = {p["messages"][0]["content"] for p in prompts if p["prompt_id"] in done}  # a torn last line: not done
        assert len(logged) >= kill_after
        generate_shard(tmp_path / "p.parquet", out, target_dir=None, gen_cfg=cfg)
        counts = srv.stats.by_prompt
    assert sorted(counts) == sorted(p["messages"][0]["content"] for p in prompts)
    assert all(v <= 2 for v in counts.values())
    assert all(counts[c] == 1 for c in logged)  # nothing the progress file holds is sent again
    # re-sent: only requests in flight at the kill or answered but still in the results pipe
    assert {c for c, v in counts.items() if v > 1} <= set(seen) - logged
    assert [r["prompt_id"] for r in read_records(out)] == [p["prompt_id"] for p in prompts]
