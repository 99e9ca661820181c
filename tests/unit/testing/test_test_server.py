"""The test server's CLI (``python -m dflash_pipeline.testing.server``): every fault of :class:`Faults` is
reachable from the command line, the READY line names the base URL, and ``GET /stats`` reports the
per-prompt request counts. The servers run as separate processes, as users and scripts run them."""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dflash_pipeline.testing.server import Faults, TestServer, _parser, faults_summary

REPO_ROOT = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 60.0
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1, whatever http_proxy says


class CliServer:
    """A server process started with CLI flags; ``base_url`` is read from its ``READY`` line."""

    def __init__(self, *flags: str):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH")])),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dflash_pipeline.testing.server", "--port", "0", *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        self._stderr: list[str] = []
        threading.Thread(target=lambda: self._stderr.extend(self.proc.stderr), daemon=True).start()
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stdout], daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                line = lines.get(timeout=0.1)
                break
            except queue.Empty:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise AssertionError(
                        f"server did not print READY (exit {self.proc.poll()}): {self.stderr}"
                    ) from None
        assert line.startswith("READY http://127.0.0.1:") and line.rstrip().endswith("/v1"), line
        self.base_url = line.split()[1]
        self.root = self.base_url.removesuffix("/v1")

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


def call(url: str, body: dict | None = None, timeout: float = 10.0):
    """``(status, headers, parsed JSON or text)``, or ``("dropped", None, None)`` when the server closed
    the connection without an answer, ``("timeout", None, None)`` when it did not answer in time."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            status, headers, raw = resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as exc:
        status, headers, raw = exc.code, exc.headers, exc.read()
    except TimeoutError:
        return "timeout", None, None
    except (ConnectionError, http.client.HTTPException) as exc:
        return "dropped", None, exc
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            return "timeout", None, None
        return "dropped", None, exc
    try:
        return status, headers, json.loads(raw)
    except ValueError:
        return status, headers, raw.decode()


def chat(base_url: str, prompt: str, **kw):
    return call(base_url + "/chat/completions", {"messages": [{"role": "user", "content": prompt}]}, **kw)


def test_cli_exposes_every_fault_field():
    """One flag per :class:`Faults` field, each parsed into the field of the same name."""
    dests = {a.dest for a in _parser()._actions}
    assert set(vars(Faults())) <= dests
    args = _parser().parse_args(
        [
            "--fail-every",
            "4",
            "--fail-status",
            "429",
            "--retry-after-s",
            "1.5",
            "--die-after",
            "0",
            "--bad-request-marker",
            "",
        ]
    )
    assert (args.fail_every, args.fail_status, args.retry_after_s, args.die_after, args.bad_request_marker) == (
        4,
        429,
        1.5,
        0,
        "",
    )
    for bad in (["--fail-status", "42"], ["--drop-first", "-1"], ["--hang-s", "nan"], ["--spec-accept-length", "0.5"]):
        with pytest.raises(SystemExit):
            _parser().parse_args(bad)
    assert faults_summary(Faults()) == "none"
    assert faults_summary(Faults(fail_every=5, retry_after_s=2.0)) == "retry_after_s=2.0 fail_every=5"


def test_fault_numbering():
    """``*_first`` take consecutive requests (drops, hangs, failures); ``*_every`` multiples after them."""
    server = TestServer(
        faults=Faults(drop_first=1, hang_first=1, fail_first=2, drop_every=5, hang_every=7, fail_every=3)
    )
    plan = [server._fault_of(n) for n in range(1, 16)]
    assert plan == [
        "drop",
        "hang",
        "fail",
        "fail",
        "drop",
        "fail",
        "hang",
        None,
        "fail",
        "drop",
        None,
        "fail",
        None,
        "hang",
        "drop",
    ]


def test_base_url_names_the_bound_host():
    assert TestServer(port=5).base_url == "http://127.0.0.1:5/v1"
    assert TestServer(port=5, host="0.0.0.0").base_url == "http://127.0.0.1:5/v1"
    assert TestServer(port=5, host="::1").base_url == "http://[::1]:5/v1"


def test_cli_rate_limit_drop_die_after_and_stats():
    """--drop-first, --fail-every with 429 + Retry-After, --die-after and --model-name from the command line;
    /stats counts every request per prompt (a re-sent prompt twice) and keeps answering after the death."""
    srv = CliServer(
        "--model-name",
        "fleet-a",
        "--drop-first",
        "1",
        "--fail-every",
        "3",
        "--fail-status",
        "429",
        "--retry-after-s",
        "2",
        "--die-after",
        "6",
    )
    try:
        plan = "faults: drop_first=1 fail_status=429 retry_after_s=2.0 fail_every=3 die_after=6"
        assert _wait_for(lambda: plan in srv.stderr), srv.stderr
        status, _, models = call(srv.base_url + "/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["fleet-a"]

        results = []
        for prompt in ["p1", "p1", "p2", "p2"]:  # 1 dropped, 2 ok, 3 = 429, 4 ok
            results.append(chat(srv.base_url, prompt))
        results.append(call(srv.base_url + "/completions", {"prompt": "p3", "max_tokens": 4}))  # 5 ok
        results.append(chat(srv.base_url, "p4"))  # 6 = 429
        statuses = [r[0] for r in results]
        assert statuses == ["dropped", 200, 429, 200, 200, 429]
        assert results[2][1]["Retry-After"] == "2"
        assert results[2][2]["error"]["message"] == "injected failure 429"
        assert results[1][2]["model"] == "fleet-a"
        assert results[4][2]["object"] == "text_completion" and results[4][2]["choices"][0]["text"]

        # dead after 6: generation, models and health requests are dropped and not counted
        assert chat(srv.base_url, "p5")[0] == "dropped"
        assert call(srv.base_url + "/models")[0] == "dropped"
        assert call(srv.root + "/health")[0] == "dropped"

        status, _, stats = call(srv.root + "/stats")
        assert status == 200
        assert stats["model"] == "fleet-a" and stats["dead"] is True
        assert stats["by_prompt"] == {"p1": 2, "p2": 2, "p3": 1, "p4": 1}
        assert stats["chat_requests"] == 6 and stats["completions_requests"] == 1
        assert stats["answered"] == 3 and stats["models_requests"] == 1
        assert stats["statuses"] == {"dropped": 1, "200": 3, "429": 2}
        conv = lambda text: json.dumps([{"content": text, "role": "user"}])  # noqa: E731
        assert stats["by_conversation"] == {conv("p1"): 2, conv("p2"): 2, "p3": 1, conv("p4"): 1}
        status, _, metrics = call(srv.root + "/metrics")
        assert status == 200 and "test_server_chat_requests_total 6" in metrics
    finally:
        assert srv.stop() == 0


def test_cli_hang_fail_markers_and_delay():
    """--fail-first with a 5xx, --hang-every/--hang-s (a dropped connection after the hang; a client timeout
    shorter than it), --delay-s, and the marker flags (one renamed, one turned off)."""
    srv = CliServer(
        "--fail-first",
        "1",
        "--fail-status",
        "500",
        "--hang-every",
        "2",
        "--hang-s",
        "0.5",
        "--delay-s",
        "0.2",
        "--bad-request-marker",
        "TOO-LONG",
        "--malformed-marker",
        "",
    )
    try:
        status, headers, body = chat(srv.base_url, "a")  # 1: 500, no Retry-After
        assert status == 500 and "Retry-After" not in headers
        assert body == {"error": {"message": "injected failure 500", "type": "server_error"}}

        t0 = time.monotonic()
        assert chat(srv.base_url, "b")[0] == "dropped"  # 2: no answer for 0.5 s, then the connection drops
        assert time.monotonic() - t0 >= 0.5

        t0 = time.monotonic()
        status, _, body = chat(srv.base_url, "c [[MALFORMED]] is off")  # 3: answered after the 0.2 s delay
        assert time.monotonic() - t0 >= 0.2
        assert status == 200 and body["choices"][0]["message"]["content"] == "Answer 1 to: c [[MALFORMED]] is off"

        assert chat(srv.base_url, "d", timeout=0.1)[0] == "timeout"  # 4: hangs longer than the client waits

        status, _, body = chat(srv.base_url, "this prompt is TOO-LONG")  # 5: the renamed 400 marker
        assert status == 400
        assert body == {
            "error": {"message": "injected bad request: prompt is too long", "type": "invalid_request_error"}
        }

        status, _, stats = call(srv.root + "/stats")
        assert status == 200 and stats["dead"] is False
        assert stats["statuses"] == {"500": 1, "hung": 2, "200": 1, "400": 1}
        assert stats["by_prompt"] == {"a": 1, "b": 1, "c [[MALFORMED]] is off": 1, "d": 1, "this prompt is TOO-LONG": 1}
    finally:
        assert srv.stop() == 0


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_sigterm_right_after_ready_stops_cleanly():
    """A SIGTERM sent the moment READY is printed (as a test fixture's teardown may) stops the server with
    exit 0: its signal handlers are installed before it announces itself (they were installed after, and
    such a SIGTERM killed it with -15 in about half the runs)."""
    for _ in range(4):
        srv = CliServer()
        assert srv.stop() == 0, srv.stderr
