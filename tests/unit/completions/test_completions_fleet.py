"""Completions stage, openai backend: what a fresh user runs into with a fleet of local servers. The served
model checked against ``GET /models`` (different models, an unlisted ``generation.model``, a fleet replaced
between runs), connection errors that say "cannot connect", a base_url without ``/v1``, the warning while
no endpoint is available, consistent stats after a resume, and no per-request HTTP log lines."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from pathlib import Path

import pytest
from test_completions import MULTI, dead_url, openai_cfg, read_records, single_turn, write_prompts

from dflash_pipeline import completions
from dflash_pipeline.completions import (
    PROGRESS_SUFFIX,
    ProgressLog,
    _describe,
    _fingerprint,
    _settle_model,
    generate_shard,
)
from dflash_pipeline.core import contracts
from dflash_pipeline.core.errors import ConfigError, GenerationError
from dflash_pipeline.testing.server import Faults, TestServer, start_test_server

# ----------------------------------------------------------------------------------------------
# the served model


def test_settle_model_rules():
    a, b = "http://a:1/v1", "http://b:1/v1"
    # generation.model unset: the first id of the first endpoint that lists one; the same set in another
    # order is the same fleet; an endpoint listing nothing (or never probed: absent) is not judged
    assert _settle_model(None, [(a, []), (b, ["m", "m-lora"])], configured=False) == "m"
    assert _settle_model(None, [(a, ["m", "x"]), (b, ["x", "m"])], configured=False) == "m"
    assert _settle_model(None, [(a, [])], configured=False) is None
    with pytest.raises(
        ConfigError,
        match=r"different models .*http://a:1/v1 serves 'm'; http://b:1/v1 serves 'n'.*"
        r"generation\.model is not set",
    ):
        _settle_model(None, [(a, ["m"]), (b, ["n"])], configured=False)
    # generation.model set: every endpoint that lists models must list it
    assert _settle_model("m", [(a, ["x", "m"]), (b, [])], configured=True) == "m"
    with pytest.raises(ConfigError, match=r"endpoint http://b:1/v1 lists 'n' - not generation\.model='m'"):
        _settle_model("m", [(a, ["m"]), (b, ["n"])], configured=True)


def test_endpoints_serving_different_models_need_generation_model(tmp_path):
    write_prompts(tmp_path / "p.parquet", single_turn(4))
    with start_test_server(model_name="model-a") as a, start_test_server(model_name="model-b") as b:
        cfg = openai_cfg(a.base_url, b.base_url, model=None)
        with pytest.raises(ConfigError) as info:
            generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=None, gen_cfg=cfg)
        assert a.stats.chat_requests == b.stats.chat_requests == 0  # nothing was sent
    msg = str(info.value)
    assert f"{a.base_url} serves 'model-a'" in msg and f"{b.base_url} serves 'model-b'" in msg
    assert "set generation.model" in msg and not (tmp_path / "c.parquet").exists()


def test_generation_model_not_listed_by_an_endpoint(tmp_path):
    write_prompts(tmp_path / "p.parquet", single_turn(4))
    with start_test_server(model_name="model-a") as a, start_test_server(model_name="model-x") as x:
        cfg = openai_cfg(a.base_url, x.base_url, dead_url(), model="model-a")  # the dead one is not judged
        with pytest.raises(ConfigError) as info:
            generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=None, gen_cfg=cfg)
        assert a.stats.chat_requests == x.stats.chat_requests == 0
        msg = str(info.value)
        assert f"endpoint {x.base_url} lists 'model-x' - not generation.model='model-a'" in msg
        assert a.base_url not in msg  # only the offending endpoint

        # the same with client processes: raised as a ConfigError before any process starts
        cfg = openai_cfg(a.base_url, x.base_url, model="model-a", client_processes=2)
        with pytest.raises(ConfigError, match="not generation.model='model-a'"):
            generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=None, gen_cfg=cfg)

        # listed: runs (the model each endpoint lists is what it is asked for)
        generate_shard(
            tmp_path / "p.parquet",
            tmp_path / "c.parquet",
            target_dir=None,
            gen_cfg=openai_cfg(a.base_url, dead_url(), model="model-a"),
        )
    assert all(r["model"] == "model-a" and r["status"] == "ok" for r in read_records(tmp_path / "c.parquet"))


def test_endpoint_back_with_another_model_stops_the_job(tmp_path):
    """An endpoint that was down at start is judged when it answers: it may not join with another model."""
    n = 120
    write_prompts(tmp_path / "p.parquet", single_turn(n))
    late_url = dead_url()
    late = TestServer(model_name="model-b", port=int(late_url.rsplit(":", 1)[1].split("/")[0]))
    with start_test_server(model_name="model-a", faults=Faults(delay_s=0.05)) as a:
        cfg = openai_cfg(a.base_url, late_url, concurrency=1, model=None)

        def start_late_once_the_job_runs() -> None:  # on the job's progress, not on a timer: load cannot reorder it
            deadline = time.monotonic() + 60
            while a.stats.answered < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            late.start()

        starter = threading.Thread(target=start_late_once_the_job_runs, daemon=True)
        starter.start()
        try:
            with pytest.raises(ConfigError) as info:
                generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=None, gen_cfg=cfg)
        finally:
            starter.join()
            late.stop()
        assert late.stats.chat_requests == 0 and 3 <= a.stats.answered < n
    msg = str(info.value)
    assert f"endpoint {late_url} lists 'model-b' - not 'model-a'" in msg and "set generation.model" in msg
    # what model-a answered is kept for the rerun
    lines = Path(str(tmp_path / "c.parquet") + PROGRESS_SUFFIX).read_text().splitlines()
    assert len(lines) > 1 and all(json.loads(x)["model"] == "model-a" for x in lines[1:])


def test_resume_after_the_fleet_changed_model_redoes_the_shard(tmp_path, caplog):
    n = 8
    write_prompts(tmp_path / "p.parquet", single_turn(n))
    out = tmp_path / "c.parquet"
    progress = Path(str(out) + PROGRESS_SUFFIX)
    with start_test_server(model_name="model-a", faults=Faults(die_after=3)) as a:
        cfg = openai_cfg(a.base_url, concurrency=1, circuit_breaker_failures=3, endpoint_max_failures=1, model=None)
        with pytest.raises(GenerationError, match="3 of 8 conversations are finished"):
            generate_shard(tmp_path / "p.parquet", out, target_dir=None, gen_cfg=cfg)
    header = progress.read_text().splitlines()[0]
    with start_test_server(model_name="model-b") as b:
        caplog.set_level(logging.WARNING, logger="dflash_pipeline.completions")
        stats = generate_shard(tmp_path / "p.parquet", out, target_dir=None, gen_cfg=openai_cfg(b.base_url, model=None))
        assert b.stats.answered == n  # the 3 model-a conversations were redone
    assert {r["model"] for r in read_records(out)} == {"model-b"}
    assert stats["run"]["resumed"] == 0 and stats["run"]["generated"] == n and stats["model"] == "model-b"
    assert (
        "written under other generation settings (model 'model-a'; this run sends 'model-b'); starting over"
        in caplog.text
    )
    # the progress header itself is unchanged (a configured model's resume files are as before)
    assert json.loads(header)["header"] == _fingerprint("openai", cfg, None, None)


# ----------------------------------------------------------------------------------------------
# errors users can act on


def test_describe_names_the_cause_without_credentials():
    class APITimeoutError(Exception):  # as openai's aiohttp transport raises for a refused connection
        pass

    class ConnectTimeout(Exception):
        pass

    class ClientConnectorError(OSError):
        pass

    refused = ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 9)")
    connector = ClientConnectorError("Cannot connect to host http://user:pw@127.0.0.1:9/v1")
    connector.__cause__ = refused
    mapped = ConnectTimeout(str(connector))  # same message: the deeper, more specific type is named
    mapped.__cause__ = connector
    top = APITimeoutError("Request timed out.")
    top.__cause__ = mapped
    # a refused connection says so first, the client's label after it
    assert _describe(top) == (
        "connection refused: Cannot connect to host http://127.0.0.1:9/v1 "
        "(reported as APITimeoutError: Request timed out.)"
    )
    connector.__cause__ = OSError(113, "No route to host")  # not refused: the chain as it is
    assert _describe(top) == (
        "APITimeoutError: Request timed out. "
        "(cause: ClientConnectorError: Cannot connect to host http://127.0.0.1:9/v1)"
    )
    assert _describe(ValueError("plain")) == "ValueError: plain"

    class APIStatusError(Exception):  # openai's: "Error code: 500 - {body}", the error object as .body
        status_code = 500

        def __init__(self, body):
            super().__init__(f"Error code: 500 - {body}")
            self.body = body

    server = APIStatusError(
        {
            "message": "\nTraceback (most recent call last):\n  File x\nKeyError: "
            "'http://user:secret@host/v1'" + "x" * 400
        }
    )
    assert _describe(server) == "HTTP 500: Traceback (most recent call last):"  # one line, the server's
    leaky = APIStatusError({"message": "bad http://user:secret@host/v1 " + "y" * 400})
    assert "secret" not in _describe(leaky) and len(_describe(leaky)) < 320


def test_refused_connection_says_cannot_connect(tmp_path, caplog):
    write_prompts(tmp_path / "p.parquet", single_turn(2))
    url = dead_url()
    cfg = openai_cfg(url, circuit_breaker_failures=3)
    caplog.set_level(logging.WARNING, logger="dflash_pipeline.completions")
    with pytest.raises(GenerationError) as info:
        generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=None, gen_cfg=cfg)
    msg = str(info.value)
    port = url.rsplit(":", 1)[1].split("/")[0]
    # aiohttp transport: "Cannot connect to host 127.0.0.1:<port>"; httpx transport: "All connection attempts failed"
    # the refusal comes first, the client's "APITimeoutError: Request timed out." after it
    cause = re.compile(
        rf"connection refused: (Cannot connect to host 127\.0\.0\.1:{port}|All connection attempts "
        rf"failed).* \(reported as \w+: "
    )
    assert cause.search(msg), msg
    assert ".." not in msg.replace("...", "")  # no "timed out.." before the next sentence
    taken_out = [r.getMessage() for r in caplog.records if "does not answer" in r.getMessage()]
    assert taken_out and all(cause.search(m) for m in taken_out)


def test_base_url_without_v1_is_a_config_error(tmp_path):
    write_prompts(tmp_path / "p.parquet", single_turn(2))
    with start_test_server() as srv:
        root = srv.base_url[: -len("/v1")]
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as info:
            generate_shard(
                tmp_path / "p.parquet",
                tmp_path / "c.parquet",
                target_dir=None,
                gen_cfg=openai_cfg(root, circuit_breaker_failures=1000),
            )
        assert time.monotonic() - t0 < 10  # not re-probed until a breaker
        assert srv.stats.chat_requests == 0
    msg = str(info.value)
    assert f"endpoint {root}: GET {root}/models answered HTTP 404" in msg
    assert "base_url usually ends with /v1" in msg


def test_warning_while_no_endpoint_is_available(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(completions.fleet, "OUTAGE_LOG_S", 0.05)
    write_prompts(tmp_path / "p.parquet", single_turn(2))
    cfg = openai_cfg(
        dead_url(), dead_url(), circuit_breaker_failures=12, endpoint_reprobe_s=0.03, retry_backoff_max_s=0.06
    )
    caplog.set_level(logging.WARNING, logger="dflash_pipeline.completions")
    with pytest.raises(GenerationError, match="circuit breaker open"):
        generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=None, gen_cfg=cfg)
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("no endpoint available")]
    assert waits, caplog.text
    assert all(r.levelno == logging.WARNING for r in caplog.records if r.getMessage() in waits)
    assert re.search(
        r"no endpoint available for \d+ s: \d+ consecutive failures of circuit_breaker_failures=12 "
        r"\(the job stops once every endpoint reaches it\); re-probing 2 endpoint\(s\), next in \d+ s "
        r"\(last: http://127\.0\.0\.1:\d+/v1: .*probe: ",
        waits[0],
    ), waits[0]


# ----------------------------------------------------------------------------------------------
# stats and the progress bar after a resume


def _partial_progress(tmp_path: Path, cfg: dict, keep: int) -> tuple[Path, list[dict]]:
    """A complete shard's first ``keep`` records as the progress file a killed job leaves (shard removed)."""
    out = tmp_path / "c.parquet"
    with start_test_server() as srv:
        generate_shard(tmp_path / "p.parquet", out, target_dir=None, gen_cfg=openai_cfg(srv.base_url))
    recs = read_records(out)
    log = ProgressLog(Path(str(out) + PROGRESS_SUFFIX), _fingerprint("openai", cfg, None, None))
    log.open(recs[:keep])
    log.close()
    out.unlink()
    return out, recs


def test_stats_after_resume_cover_the_whole_shard_and_this_run(tmp_path, capfd):
    write_prompts(tmp_path / "p.parquet", MULTI + single_turn(5))  # 8 conversations, 9 assistant turns
    cfg = openai_cfg("http://unused/v1")
    out, full = _partial_progress(tmp_path, cfg, keep=4)
    capfd.readouterr()
    with start_test_server() as srv:
        cfg = openai_cfg(srv.base_url)
        stats = generate_shard(
            tmp_path / "p.parquet", out, target_dir=None, gen_cfg=cfg, stats_path=tmp_path / "c.stats.json"
        )
        assert srv.stats.answered == 4  # the 4 single-turn conversations not in the progress file
    recs = read_records(out)
    turns = [t for r in recs for t in r["turns"]]
    new_turns = [t for r in recs[4:] for t in r["turns"]]
    written = json.loads((tmp_path / "c.stats.json").read_text())
    assert written == json.loads(json.dumps(stats))
    # the whole shard
    assert (stats["prompts"], stats["ok"], stats["truncated"], stats["error"]) == (8, 8, 0, 0)
    assert stats["turns"] == len(turns) == 9
    assert stats["completion_tokens"] == sum(t["completion_tokens"] for t in turns) > 0
    assert stats["prompt_tokens"] == sum(t["prompt_tokens"] for t in turns) > 0
    # this run
    run = stats["run"]
    assert run["resumed"] == 4 and run["retries"] == 0
    assert run["generated"] == 4 and run["turns"] == len(new_turns) == 4
    assert run["completion_tokens"] == sum(t["completion_tokens"] for t in new_turns) < stats["completion_tokens"]
    assert run["prompt_tokens"] == sum(t["prompt_tokens"] for t in new_turns)
    assert run["wall_s"] > 0 and run["requests_per_s"] == pytest.approx(4 / run["wall_s"], rel=0.01)
    assert run["output_tokens_per_s"] == pytest.approx(run["completion_tokens"] / run["wall_s"], rel=0.01)
    # one copy of this run's figures: in `run`, none at the top level (stats version 2)
    assert stats["stats_version"] == contracts.COMPLETION_STATS_VERSION == 2
    assert not set(stats) & set(contracts.STATS_V1_RUN_KEYS)
    # the bar counts the resumed conversations too
    err = capfd.readouterr().err
    assert re.search(r"8/8 .*ok=8 trunc=0 err=0", err), err[-500:]


def test_stats_when_every_conversation_was_resumed(tmp_path):
    write_prompts(tmp_path / "p.parquet", single_turn(5))
    cfg = openai_cfg(dead_url())  # never contacted: nothing is left to send
    out, full = _partial_progress(tmp_path, cfg, keep=5)
    stats = generate_shard(
        tmp_path / "p.parquet", out, target_dir=None, gen_cfg=cfg, stats_path=tmp_path / "c.stats.json"
    )
    assert read_records(out) == full
    assert stats["ok"] == stats["run"]["resumed"] == 5 and stats["run"]["generated"] == 0
    assert (
        stats["turns"] == 5 and stats["completion_tokens"] == sum(r["turns"][0]["completion_tokens"] for r in full) > 0
    )
    assert stats["run"]["turns"] == stats["run"]["completion_tokens"] == 0
    assert stats["run"]["retries"] == 0 and stats["run"]["requests"] == 0


# ----------------------------------------------------------------------------------------------
# logs


def test_no_log_line_per_http_request(tmp_path, caplog):
    write_prompts(tmp_path / "p.parquet", single_turn(3))
    levels = {name: logging.getLogger(name).level for name in completions.HTTP_LOGGERS}
    caplog.set_level(logging.INFO)
    with start_test_server() as srv:
        generate_shard(
            tmp_path / "p.parquet",
            tmp_path / "c.parquet",
            target_dir=None,
            gen_cfg=openai_cfg(srv.base_url, dead_url()),
        )
        assert srv.stats.answered == 3
    assert not [r for r in caplog.records if "HTTP Request" in r.getMessage()], caplog.text
    assert any(
        r.name == "dflash_pipeline.completions" and r.levelno == logging.WARNING and "does not answer" in r.getMessage()
        for r in caplog.records
    )  # our own warnings stay
    assert {name: logging.getLogger(name).level for name in completions.HTTP_LOGGERS} == levels  # restored


def test_generation_table_counts_a_resumed_run_own_tokens_per_second(tmp_path):
    """tokens_per_job_s divides the tokens the last run generated (not the resumed ones) by its seconds."""
    from dflash_pipeline.report import tables as report

    n = 6
    write_prompts(tmp_path / "p.parquet", single_turn(n))
    out = tmp_path / "d" / "00000.parquet"
    out.parent.mkdir()
    with start_test_server() as srv:
        cfg = openai_cfg(srv.base_url)
        generate_shard(tmp_path / "p.parquet", out, target_dir=None, gen_cfg=cfg)
        first = {p["prompt_id"] for p in read_records(out)[:4]}
        # a progress file holding 4 of them, as a killed run leaves it; the rerun generates the other 2
        records = [r for r in read_records(out) if r["prompt_id"] in first]
        out.unlink()
        progress = ProgressLog(Path(str(out) + PROGRESS_SUFFIX), _fingerprint("openai", cfg, None, None))
        progress.open(records)
        progress.close()
        stats_path = out.with_name("00000.stats.json")
        stats = generate_shard(tmp_path / "p.parquet", out, target_dir=None, gen_cfg=cfg, stats_path=stats_path)
    assert stats["run"]["resumed"] == 4 and stats["run"]["completion_tokens"] < stats["completion_tokens"]
    (row, _all) = report.generation_table([out], tmp_path / "g.tsv")
    assert row["tokens_per_job_s"] == round(stats["run"]["completion_tokens"] / stats["run"]["wall_s"], 1)
