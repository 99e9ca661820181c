"""Completions stage: transformers backend on the demo target, openai backend against the local test
server (faults, fleet, circuit breaker, resume after a kill, thinking modes, secrets)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash_pipeline.completions import ERRORS_SUFFIX, PROGRESS_SUFFIX, generate_shard
from dflash_pipeline.core import contracts, shards
from dflash_pipeline.core.config import validate_config
from dflash_pipeline.core.errors import ConfigError, GenerationError
from dflash_pipeline.target import chat
from dflash_pipeline.testing.server import Faults, start_test_server

REPO_ROOT = Path(__file__).resolve().parents[3]

#: Fast retry/probe timings so fault tests take well under a second of waiting.
FAST = {
    "retry_backoff_s": 0.005,
    "retry_backoff_max_s": 0.02,
    "endpoint_reprobe_s": 0.005,
    "request_timeout_s": 2.0,
}


def gen_cfg(**overrides) -> dict:
    return validate_config({"generation": overrides})["generation"]


def openai_cfg(*urls, concurrency=4, **overrides) -> dict:
    eps = [{"base_url": u, "max_concurrency": concurrency} for u in urls]
    return gen_cfg(backend="openai", endpoints=eps, **{**FAST, **overrides})


def write_prompts(path: Path, conversations: list[list[dict]]) -> list[dict]:
    recs = [
        {"prompt_id": contracts.prompt_id(m), "dataset": "t", "messages": m, "metadata": "{}"} for m in conversations
    ]
    shards.write_parquet(path, shards.table_from_records(recs, contracts.PROMPT_SCHEMA))
    return recs


def single_turn(n: int, prefix: str = "question") -> list[list[dict]]:
    return [[{"role": "user", "content": f"{prefix} {i}"}] for i in range(n)]


MULTI = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "user", "content": "And times 4?"},
    ],
    [{"role": "user", "content": "Natalia sold 48 clips in April. How many in May?"}],
    [{"role": "user", "content": "Hi there"}],
]


def read_records(path: Path) -> list[dict]:
    return shards.read_parquet(path).to_pylist()


def dead_url() -> str:
    """A base URL on a port where nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


# ----------------------------------------------------------------------------------------------
# transformers backend


def test_transformers_multi_turn_greedy_and_truncation(tmp_path, demo_target):
    prompts = write_prompts(tmp_path / "p.parquet", MULTI)
    cfg = gen_cfg(max_tokens=6, batch_size=2)
    stats = generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=demo_target, gen_cfg=cfg)
    recs = read_records(tmp_path / "c.parquet")
    assert [r["prompt_id"] for r in recs] == [p["prompt_id"] for p in prompts]
    assert stats["prompts"] == 3 and stats["turns"] == 4 and stats["run"]["generated"] == 3
    assert not (tmp_path / ("c.parquet" + PROGRESS_SUFFIX)).exists()

    tok = chat.load_tokenizer(demo_target)
    eos = {tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")}
    first = recs[0]
    assert [m["role"] for m in first["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    # turn 2 was generated against the regenerated history (assistant turn 1 included)
    history = [{"role": m["role"], "content": m["content"]} for m in first["messages"][:4]]
    expect = chat.render(tok, history, thinking="disable", add_generation_prompt=True, tokenize=True)
    assert first["turns"][1]["prompt_token_ids"] == expect
    for r in recs:
        for t, m in zip(r["turns"], [m for m in r["messages"] if m["role"] == "assistant"]):
            ids = t["output_token_ids"]
            assert t["completion_tokens"] == len(ids) <= 6
            assert t["finish_reason"] == ("stop" if ids[-1] in eos else "length")
            body = ids[:-1] if t["finish_reason"] == "stop" else ids
            assert m["content"] == tok.decode(body, skip_special_tokens=True)
            assert m["reasoning_content"] is None and t["endpoint"] == "transformers"
        lengths = [t["finish_reason"] == "length" for t in r["turns"]]
        assert r["status"] == ("truncated" if any(lengths) else "ok")
        assert r["thinking"] == "disable" and json.loads(r["sampling"])["max_tokens"] == 6
    assert stats["truncated"] >= 1  # 6 new tokens is too few for the demo target to finish

    # greedy: a second run gives the same conversations
    generate_shard(tmp_path / "p.parquet", tmp_path / "c2.parquet", target_dir=demo_target, gen_cfg=cfg)
    again = read_records(tmp_path / "c2.parquet")
    strip = lambda rs: [(r["messages"], [{**t, "latency_s": None} for t in r["turns"]]) for r in rs]  # noqa: E731
    assert strip(again) == strip(recs)


def test_openai_backend_on_target_server_matches_transformers(tmp_path, demo_target):
    write_prompts(tmp_path / "p.parquet", MULTI[1:])
    local = gen_cfg(max_tokens=5, batch_size=1)
    generate_shard(tmp_path / "p.parquet", tmp_path / "local.parquet", target_dir=demo_target, gen_cfg=local)
    with start_test_server(target_dir=demo_target) as srv:
        cfg = openai_cfg(srv.base_url, max_tokens=5, extra_body={"return_token_ids": True})
        generate_shard(tmp_path / "p.parquet", tmp_path / "remote.parquet", target_dir=None, gen_cfg=cfg)
    for a, b in zip(read_records(tmp_path / "local.parquet"), read_records(tmp_path / "remote.parquet")):
        assert a["messages"] == b["messages"]
        for ta, tb in zip(a["turns"], b["turns"]):
            for k in ("finish_reason", "prompt_token_ids", "output_token_ids", "completion_tokens"):
                assert ta[k] == tb[k], k
        assert b["model"] == "test-model" and b["turns"][0]["endpoint"] == srv.base_url


# ----------------------------------------------------------------------------------------------
# openai backend: success, records, multi-turn


def test_openai_success_multi_turn_records(tmp_path):
    prompts = write_prompts(tmp_path / "p.parquet", MULTI)
    with start_test_server() as srv:
        cfg = openai_cfg(srv.base_url, temperature=0.7, top_k=20, seed=5, extra_body={"return_token_ids": True})
        stats = generate_shard(
            tmp_path / "p.parquet",
            tmp_path / "c.parquet",
            target_dir=None,
            gen_cfg=cfg,
            stats_path=tmp_path / "c.stats.json",
        )
        sent = list(srv.stats.requests)
    recs = read_records(tmp_path / "c.parquet")
    assert [r["prompt_id"] for r in recs] == [p["prompt_id"] for p in prompts]
    assert all(r["status"] == "ok" and r["model"] == "test-model" for r in recs)
    first = recs[0]
    assert first["messages"][2] == {
        "role": "assistant",
        "content": "Answer 1 to: What is 2 plus 3?",
        "reasoning_content": None,
    }
    assert first["messages"][4]["content"] == "Answer 2 to: And times 4?"
    t = first["turns"][1]
    assert t["finish_reason"] == "stop" and t["output_token_ids"] and t["prompt_token_ids"]
    assert t["completion_tokens"] == len(t["output_token_ids"]) and t["endpoint"] == srv.base_url
    assert json.loads(first["sampling"]) == {
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": 20,
        "max_tokens": cfg["max_tokens"],
        "seed": 5,
        "extra_body": {"return_token_ids": True},
    }
    # the turn-2 request carried the regenerated turn 1 and the sampling/thinking options
    turn2 = next(b for b in sent if len(b["messages"]) == 4)
    assert [m["role"] for m in turn2["messages"]] == ["system", "user", "assistant", "user"]
    assert turn2["messages"][2]["content"] == "Answer 1 to: What is 2 plus 3?"
    assert turn2["top_k"] == 20 and turn2["seed"] == 5 and turn2["temperature"] == 0.7
    assert (
        turn2["chat_template_kwargs"]
        == chat.template_kwargs("disable")
        == {"enable_thinking": False, "thinking": False}
    )
    assert stats["turns"] == 4 and stats["run"]["retries"] == 0
    assert json.loads((tmp_path / "c.stats.json").read_text())["ok"] == 3
    meta = shards.read_shard_metadata(tmp_path / "c.parquet")
    assert meta["schema_version"] == contracts.COMPLETION_SCHEMA_VERSION and meta["model"] == "test-model"


def test_length_finish_is_truncated_and_kept(tmp_path):
    write_prompts(tmp_path / "p.parquet", [[{"role": "user", "content": "one two three four five six"}]])
    with start_test_server() as srv:
        generate_shard(
            tmp_path / "p.parquet",
            tmp_path / "c.parquet",
            target_dir=None,
            gen_cfg=openai_cfg(srv.base_url, max_tokens=3),
        )
    (rec,) = read_records(tmp_path / "c.parquet")
    assert rec["status"] == "truncated" and rec["turns"][0]["finish_reason"] == "length"
    assert rec["messages"][1]["content"] == "Answer 1 to:"


# ----------------------------------------------------------------------------------------------
# faults


@pytest.mark.parametrize(
    "faults",
    [
        Faults(fail_first=3, fail_status=503),
        Faults(fail_first=3, fail_status=429, retry_after_s=0.01),
        Faults(drop_first=2),
        Faults(hang_first=1, hang_s=10.0),
        Faults(fail_first=2, fail_status=408),
    ],
    ids=["5xx", "429-retry-after", "dropped-connection", "timeout", "408"],
)
def test_transient_faults_are_retried(tmp_path, faults):
    n = 6
    write_prompts(tmp_path / "p.parquet", single_turn(n))
    with start_test_server(faults=faults) as srv:
        cfg = openai_cfg(srv.base_url, request_timeout_s=0.5, endpoint_max_failures=10)
        stats = generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=None, gen_cfg=cfg)
        injected = faults.fail_first + faults.drop_first + faults.hang_first
        assert srv.stats.chat_requests == n + injected
        assert srv.stats.answered == n
    assert stats["ok"] == n and stats["run"]["retries"] == injected
    assert all(r["status"] == "ok" for r in read_records(tmp_path / "c.parquet"))


def test_slow_server_and_malformed_answer_retried(tmp_path):
    write_prompts(
        tmp_path / "p.parquet", [[{"role": "user", "content": "x [[MALFORMED]]"}], [{"role": "user", "content": "y"}]]
    )
    with start_test_server(faults=Faults(delay_s=0.05)) as srv:
        cfg = openai_cfg(srv.base_url, max_retries=2, max_error_fraction=1.0, endpoint_max_failures=10)
        stats = generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=None, gen_cfg=cfg)
        assert srv.stats.by_prompt["x [[MALFORMED]]"] == 3  # 1 + max_retries
    bad, good = read_records(tmp_path / "c.parquet")
    assert good["status"] == "ok" and bad["status"] == "error" and "malformed" in bad["error"]
    assert stats["error"] == 1


def test_400_not_retried_error_row_then_rerun_retries_only_failures(tmp_path):
    convs = single_turn(4) + [[{"role": "user", "content": "too long [[400]]"}]]
    prompts = write_prompts(tmp_path / "p.parquet", convs)
    out = tmp_path / "c.parquet"
    errors = Path(str(out) + ERRORS_SUFFIX)
    with start_test_server() as srv:
        with pytest.raises(GenerationError, match="1 of 5 conversations failed"):
            generate_shard(tmp_path / "p.parquet", out, target_dir=None, gen_cfg=openai_cfg(srv.base_url))
        assert srv.stats.by_prompt["too long [[400]]"] == 1  # not retried
        assert not out.exists()
        (err,) = [json.loads(x) for x in errors.read_text().splitlines()]
        assert (
            err["prompt_id"] == prompts[4]["prompt_id"]
            and "HTTP 400: injected bad request: prompt is too long" in err["error"]
        )
        assert "Error code" not in err["error"]  # the server's message once, not openai's wrapper
        # rerun accepting error rows: only the failed prompt is sent again
        cfg = openai_cfg(srv.base_url, max_error_fraction=0.5)
        stats = generate_shard(tmp_path / "p.parquet", out, target_dir=None, gen_cfg=cfg)
        assert srv.stats.by_prompt["too long [[400]]"] == 2
        assert all(srv.stats.by_prompt[f"question {i}"] == 1 for i in range(4))
    recs = read_records(out)
    assert [r["prompt_id"] for r in recs] == [p["prompt_id"] for p in prompts]
    assert [r["status"] for r in recs] == ["ok"] * 4 + ["error"]
    assert "HTTP 400" in recs[4]["error"] and "turn 1" in recs[4]["error"]
    assert stats["run"]["resumed"] == 4 and stats["run"]["generated"] == 1
    assert errors.exists() and not Path(str(out) + PROGRESS_SUFFIX).exists()


# ----------------------------------------------------------------------------------------------
# fleet


def test_two_endpoints_one_dead_from_start(tmp_path):
    n = 10
    write_prompts(tmp_path / "p.parquet", single_turn(n))
    with start_test_server() as srv:
        cfg = openai_cfg(dead_url(), srv.base_url, concurrency=3)
        stats = generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=None, gen_cfg=cfg)
        assert srv.stats.answered == n
    assert stats["ok"] == n
    dead = [v for k, v in stats["run"]["endpoints"].items() if k != srv.base_url][0]
    assert dead["taken_out"] >= 1 and dead["attempts"] == 0


def test_endpoint_dies_mid_shard_no_rows_lost_or_duplicated(tmp_path):
    n = 16
    prompts = write_prompts(tmp_path / "p.parquet", single_turn(n))
    with start_test_server() as a, start_test_server(faults=Faults(die_after=3)) as b:
        cfg = openai_cfg(a.base_url, b.base_url, concurrency=2, endpoint_max_failures=2)
        stats = generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=None, gen_cfg=cfg)
        answered = a.stats.answered + b.stats.answered
        assert b.stats.answered == 3 and answered == n
    recs = read_records(tmp_path / "c.parquet")
    assert [r["prompt_id"] for r in recs] == [p["prompt_id"] for p in prompts]
    assert all(r["status"] == "ok" for r in recs)
    assert stats["run"]["endpoints"][b.base_url]["taken_out"] >= 1


def test_circuit_breaker_stops_when_every_endpoint_fails(tmp_path):
    write_prompts(tmp_path / "p.parquet", single_turn(3))
    cfg = openai_cfg(dead_url(), dead_url(), circuit_breaker_failures=3)
    with pytest.raises(GenerationError, match="circuit breaker open"):
        generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=None, gen_cfg=cfg)
    assert not (tmp_path / "c.parquet").exists()


# ----------------------------------------------------------------------------------------------
# resume


def test_resume_after_server_death_sends_only_unfinished(tmp_path):
    n = 12
    prompts = write_prompts(tmp_path / "p.parquet", single_turn(n))
    out = tmp_path / "c.parquet"
    progress = Path(str(out) + PROGRESS_SUFFIX)
    with start_test_server(faults=Faults(die_after=5)) as srv:
        cfg = openai_cfg(srv.base_url, concurrency=2, circuit_breaker_failures=3, endpoint_max_failures=1)
        with pytest.raises(GenerationError, match="5 of 12 conversations are finished"):
            generate_shard(tmp_path / "p.parquet", out, target_dir=None, gen_cfg=cfg)
    lines = progress.read_text().splitlines()
    assert "header" in json.loads(lines[0]) and len(lines) == 1 + 5
    finished = {json.loads(x)["prompt_id"] for x in lines[1:]}
    with progress.open("a") as fh:  # the half-written tail of a killed append
        fh.write('{"prompt_id": "abc", "messa')
    with start_test_server() as srv2:
        stats = generate_shard(tmp_path / "p.parquet", out, target_dir=None, gen_cfg=openai_cfg(srv2.base_url))
        sent = srv2.stats.by_prompt
    by_content = {p["messages"][0]["content"]: p["prompt_id"] for p in prompts}
    assert sum(sent.values()) == n - 5 and all(v == 1 for v in sent.values())
    assert not finished & {by_content[c] for c in sent}
    recs = read_records(out)
    assert [r["prompt_id"] for r in recs] == [p["prompt_id"] for p in prompts]
    assert stats["run"]["resumed"] == 5 and stats["run"]["generated"] == 7 and not progress.exists()


def test_progress_from_other_settings_is_discarded(tmp_path):
    write_prompts(tmp_path / "p.parquet", single_turn(3))
    out = tmp_path / "c.parquet"
    with start_test_server() as srv:
        generate_shard(tmp_path / "p.parquet", out, target_dir=None, gen_cfg=openai_cfg(srv.base_url))
        recs = read_records(out)
        progress = Path(str(out) + PROGRESS_SUFFIX)
        header = {"header": {"other": "settings"}}
        progress.write_text("\n".join(json.dumps(x) for x in [header, *recs]) + "\n")
        stats = generate_shard(tmp_path / "p.parquet", out, target_dir=None, gen_cfg=openai_cfg(srv.base_url))
        assert stats["run"]["resumed"] == 0 and srv.stats.answered == 6


#: Runs generate_shard and SIGKILLs itself after ``kill_after`` progress appends; an optional 5th argument
#: names a file that receives the pids of its child processes first (client processes).
KILL_SCRIPT = textwrap.dedent(
    """
    import json, multiprocessing, os, signal, sys
    from dflash_pipeline import completions
    prompt_shard, out, cfg_json, kill_after = sys.argv[1:5]
    pid_file = sys.argv[5] if len(sys.argv) > 5 else None
    append = completions.ProgressLog.append
    count = [0]
    def append_then_die(self, record):
        append(self, record)
        count[0] += 1
        if count[0] == int(kill_after):
            if pid_file:
                with open(pid_file, "w") as fh:
                    json.dump([p.pid for p in multiprocessing.active_children()], fh)
            os.kill(os.getpid(), signal.SIGKILL)
    completions.ProgressLog.append = append_then_die
    completions.generate_shard(prompt_shard, out, target_dir=None, gen_cfg=json.loads(cfg_json))
    """
)


def test_kill_9_midway_then_rerun_each_prompt_once(tmp_path):
    n, kill_after, conc = 20, 8, 3
    prompts = write_prompts(tmp_path / "p.parquet", single_turn(n))
    out = tmp_path / "c.parquet"
    with start_test_server() as srv:
        cfg = openai_cfg(srv.base_url, concurrency=conc)
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
            ],
            env=env,
            capture_output=True,
            timeout=120,
        )
        assert proc.returncode == -9, proc.stderr.decode()[-2000:]
        first_run = sum(srv.stats.by_prompt.values())
        generate_shard(tmp_path / "p.parquet", out, target_dir=None, gen_cfg=cfg)
        counts = srv.stats.by_prompt
    assert sorted(counts) == sorted(p["messages"][0]["content"] for p in prompts)
    resent = [c for c, v in counts.items() if v > 1]
    assert all(v <= 2 for v in counts.values())
    assert len(resent) <= conc  # at most the requests in flight at the kill
    assert first_run >= kill_after
    recs = read_records(out)
    assert [r["prompt_id"] for r in recs] == [p["prompt_id"] for p in prompts]


# ----------------------------------------------------------------------------------------------
# thinking modes


def test_thinking_save_stores_and_resends_reasoning(tmp_path):
    write_prompts(tmp_path / "p.parquet", MULTI[:1])
    with start_test_server(reasoning=True) as srv:
        generate_shard(
            tmp_path / "p.parquet",
            tmp_path / "c.parquet",
            target_dir=None,
            gen_cfg=openai_cfg(srv.base_url, thinking="save"),
        )
        sent = list(srv.stats.requests)
    (rec,) = read_records(tmp_path / "c.parquet")
    assistants = [m for m in rec["messages"] if m["role"] == "assistant"]
    assert [m["reasoning_content"] for m in assistants] == ["Let me think about turn 1.", "Let me think about turn 2."]
    assert rec["thinking"] == "save" and rec["status"] == "ok"
    turn2 = next(b for b in sent if len(b["messages"]) == 4)
    assert turn2["chat_template_kwargs"] == chat.template_kwargs("save") == {"enable_thinking": True, "thinking": True}
    assert turn2["messages"][2]["reasoning_content"] == "Let me think about turn 1."


def test_thinking_save_vllm_reasoning_field(tmp_path):
    write_prompts(tmp_path / "p.parquet", single_turn(1))
    with start_test_server(reasoning=True, reasoning_field="reasoning") as srv:
        generate_shard(
            tmp_path / "p.parquet",
            tmp_path / "c.parquet",
            target_dir=None,
            gen_cfg=openai_cfg(srv.base_url, thinking="save"),
        )
    (rec,) = read_records(tmp_path / "c.parquet")
    assert rec["messages"][1]["reasoning_content"] == "Let me think about turn 1."


def test_thinking_save_without_reasoning_parser_is_an_error_row(tmp_path):
    write_prompts(tmp_path / "p.parquet", single_turn(2))
    with start_test_server(reasoning=False) as srv:
        cfg = openai_cfg(srv.base_url, thinking="save", max_error_fraction=1.0)
        generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=None, gen_cfg=cfg)
        assert srv.stats.chat_requests == 2  # not retried
    recs = read_records(tmp_path / "c.parquet")
    assert all(r["status"] == "error" and "--reasoning-parser" in r["error"] for r in recs)


def test_thinking_disable_rejects_reasoning_and_none_keeps_it(tmp_path):
    write_prompts(
        tmp_path / "p.parquet", [[{"role": "user", "content": "a [[WRONG]]"}], [{"role": "user", "content": "b"}]]
    )
    with start_test_server(reasoning=True) as srv:
        cfg = openai_cfg(srv.base_url, thinking="disable", max_error_fraction=1.0)
        generate_shard(tmp_path / "p.parquet", tmp_path / "d.parquet", target_dir=None, gen_cfg=cfg)
        bad, good = read_records(tmp_path / "d.parquet")
        assert bad["status"] == "error" and "thinking=disable" in bad["error"]
        assert good["status"] == "ok" and good["messages"][1]["reasoning_content"] is None
        generate_shard(
            tmp_path / "p.parquet",
            tmp_path / "n.parquet",
            target_dir=None,
            gen_cfg=openai_cfg(srv.base_url, thinking="none"),
        )
        assert "chat_template_kwargs" not in srv.stats.requests[-1]
    recs = read_records(tmp_path / "n.parquet")
    assert all(r["status"] == "ok" and r["messages"][1]["reasoning_content"] for r in recs)


# ----------------------------------------------------------------------------------------------
# secrets


def test_api_key_from_env_never_written(tmp_path, monkeypatch, capfd, caplog):
    secret = "sk-test-7f3a9c-very-secret"
    monkeypatch.setenv("DFLASH_TEST_API_KEY", secret)
    write_prompts(tmp_path / "p.parquet", single_turn(3) + [[{"role": "user", "content": "bad [[400]]"}]])
    with start_test_server(api_key=secret, faults=Faults(fail_first=1)) as srv:
        eps = [{"base_url": srv.base_url, "api_key_env": "DFLASH_TEST_API_KEY"}]
        cfg = gen_cfg(backend="openai", endpoints=eps, max_error_fraction=0.5, **FAST)
        generate_shard(
            tmp_path / "p.parquet",
            tmp_path / "c.parquet",
            target_dir=None,
            gen_cfg=cfg,
            stats_path=tmp_path / "stats.json",
        )
        assert srv.stats.unauthorized == 0 and srv.stats.answered == 3  # the key was sent
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"c.parquet", "c.parquet" + ERRORS_SUFFIX, "stats.json"}
    for p in files:
        assert secret.encode() not in p.read_bytes(), p
    out, err = capfd.readouterr()
    assert secret not in out + err + caplog.text

    monkeypatch.delenv("DFLASH_TEST_API_KEY")
    with pytest.raises(ConfigError, match="DFLASH_TEST_API_KEY"):
        generate_shard(tmp_path / "p.parquet", tmp_path / "c2.parquet", target_dir=None, gen_cfg=cfg)


def test_rejected_api_key_stops_the_job_at_once(tmp_path, monkeypatch):
    """A 401 is not an outage: no retries, no re-probing until the breaker; the error names the variable."""
    monkeypatch.setenv("DFLASH_TEST_API_KEY", "sk-wrong-key")
    write_prompts(tmp_path / "p.parquet", single_turn(4))
    with start_test_server(api_key="sk-right-key") as srv:
        eps = [{"base_url": srv.base_url, "api_key_env": "DFLASH_TEST_API_KEY"}]
        cfg = gen_cfg(backend="openai", endpoints=eps, **FAST)
        with pytest.raises(ConfigError, match=r"rejected the key in \$DFLASH_TEST_API_KEY") as info:
            generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=None, gen_cfg=cfg)
        assert srv.stats.unauthorized == 1 and srv.stats.answered == 0  # the start-up probe only
    assert "sk-wrong-key" not in str(info.value) and not (tmp_path / "c.parquet").exists()


def test_credentials_in_base_url_are_redacted():
    from dflash_pipeline.completions import redact_url

    assert redact_url("http://user:pw@host:8000/v1") == "http://host:8000/v1"
    assert redact_url("http://host:8000/v1") == "http://host:8000/v1"


def test_server_cli_serves_models_and_stops_on_sigterm():
    import signal
    import urllib.request

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_pipeline.testing.server", "--port", "0", "--model-name", "cli-model"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # blocks until the server listens
        assert line.startswith("READY "), proc.stderr.read() if proc.poll() is not None else line
        base_url = line.split()[1]
        with urllib.request.urlopen(base_url + "/models", timeout=30) as resp:
            assert json.load(resp)["data"][0]["id"] == "cli-model"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


# ----------------------------------------------------------------------------------------------
# over-long conversations


def _too_long_prompts(tok, limit: int) -> list[list[dict]]:
    words = " ".join(f"number {i}" for i in range(limit))  # well over `limit` tokens
    assert len(tok(words, add_special_tokens=False)["input_ids"]) > limit
    return [
        [{"role": "user", "content": "Hi there"}],
        [{"role": "user", "content": words}],
        [{"role": "user", "content": "What is 2 plus 3?"}],
    ]


def test_over_long_prompt_is_skipped_with_an_example_rest_completes(tmp_path, demo_target):
    """A prompt longer than the target's context (max_position_embeddings) is skipped and counted with an
    example in the stats and the shard metadata, in the transformers backend and in chat mode (never sent
    to the server); every other conversation of the shard completes."""
    from dflash_pipeline.completions import context_limit

    tok = chat.load_tokenizer(demo_target)
    limit = context_limit(demo_target)
    assert isinstance(limit, int)
    prompts = write_prompts(tmp_path / "p.parquet", _too_long_prompts(tok, limit))
    long_id = prompts[1]["prompt_id"]
    stats = generate_shard(
        tmp_path / "p.parquet",
        tmp_path / "c.parquet",
        target_dir=demo_target,
        gen_cfg=gen_cfg(max_tokens=4, batch_size=4),
        stats_path=tmp_path / "s.json",
    )
    recs = read_records(tmp_path / "c.parquet")
    assert [r["prompt_id"] for r in recs] == [prompts[0]["prompt_id"], prompts[2]["prompt_id"]]
    assert all(r["status"] in ("ok", "truncated") for r in recs)
    assert stats["skipped"] == {"too_long": 1}
    (ex,) = stats["skipped_examples"]["too_long"]
    assert ex["prompt_id"] == long_id and ex["prompt_tokens"] > limit and ex["max_position_embeddings"] == limit
    assert json.loads((tmp_path / "s.json").read_text())["skipped"] == {"too_long": 1}
    assert shards.read_shard_metadata(tmp_path / "c.parquet")["skipped"] == {"too_long": 1}
    with start_test_server() as srv:
        stats = generate_shard(
            tmp_path / "p.parquet",
            tmp_path / "o.parquet",
            target_dir=demo_target,
            gen_cfg=openai_cfg(srv.base_url, max_tokens=4),
        )
        assert srv.stats.chat_requests == 2  # the over-long prompt was never sent
    assert stats["skipped"] == {"too_long": 1} and len(read_records(tmp_path / "o.parquet")) == 2


def test_later_turn_outgrowing_the_context_is_skipped_in_the_transformers_backend(tmp_path, demo_target):
    """Multi-turn: the first turn fits, the grown history of the second does not: the transformers backend
    skips that conversation (never calls generate() with it) and the others complete."""
    from dflash_pipeline.completions import TransformersBackend

    cfg = gen_cfg(max_tokens=4, batch_size=2)
    backend = TransformersBackend(demo_target, cfg)
    convs = [
        [{"role": "user", "content": "Hi"}, {"role": "user", "content": "And what is six times four?"}],
        [{"role": "user", "content": "Hi there"}],
        [{"role": "user", "content": "Hi you"}],
    ]
    write_prompts(tmp_path / "p.parquet", convs)
    tok = chat.load_tokenizer(demo_target)
    firsts = [
        len(chat.render(tok, c[:1], thinking="disable", add_generation_prompt=True, tokenize=True)) for c in convs
    ]
    # every first turn fits; the second turn of convs[0] (its history, answer and 7 more words) cannot
    backend.context_limit = max(firsts) + 4
    stats = generate_shard(
        tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=demo_target, gen_cfg=cfg, backend=backend
    )  # the shard-level check (the real context) skips nothing here
    recs = read_records(tmp_path / "c.parquet")
    assert stats["skipped"]["too_long"] == 1 and stats["skipped_examples"]["too_long"][0]["turn"] == 1
    assert len(recs) == 2 and all(r["status"] in ("ok", "truncated") for r in recs)


def test_length_check_renders_conversations_for_templates_that_insist_on_alternation(demo_target, real_models_dir):
    """The over-long check renders a multi-turn prompt with empty answers between its user turns, as the
    regenerated conversation alternates; Gemma's template (which raises on two user turns in a row) renders
    it, and the bound stays below the real last-turn prompt (answers only add)."""
    from dflash_pipeline.completions.generate import too_long_prompts

    template = (real_models_dir / "gemma-3-4b-it" / "chat_template.jinja").read_text()
    tok = chat.load_tokenizer(demo_target)
    tok.chat_template = template
    turns = [{"role": "user", "content": "Name a prime number."}, {"role": "user", "content": "And a larger one?"}]
    prompts = [{"prompt_id": "p", "messages": [{"role": "system", "content": "You are terse."}, *turns]}]
    gen = {"thinking": "none", "max_tokens": 4}
    assert too_long_prompts(prompts, tok, gen, limit=10_000) == {}
    (ex,) = too_long_prompts(prompts, tok, gen, limit=8).values()
    answered = [prompts[0]["messages"][0], turns[0], {"role": "assistant", "content": "Seven."}, turns[1]]
    real = chat.render(tok, answered, thinking="none", add_generation_prompt=True, tokenize=True)
    assert 0 < ex["prompt_tokens"] < len(real)
