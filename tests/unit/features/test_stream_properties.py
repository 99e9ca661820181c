"""Property-based tests (hypothesis) of the feature server and client at the network boundary.

Server: random and malformed requests (methods, paths, headers, Content-Length spellings, JSON of any shape,
raw bytes, with and without the key) never crash it, never get a 500 (every one is the client's mistake),
never leave a file outside its scratch directory, and a well-formed request is still served after each.
Client: random answers (paths anywhere, symlinks, relative and ``..`` paths, garbage text, files of random
bytes in scratch, bodies of random bytes) end in features or a StreamError, never another exception; no file
outside scratch is read-and-deleted or changed; memory stays bounded."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
from conftest import FAST_FLEET
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server_limits import KEY, post, running, stub_server
from test_stream_trust import FakeFeatureServer, answer_bytes

from dflash_pipeline.features import FeatureClient, StreamError, fleet_config
from dflash_pipeline.features.server import Limits

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=40,
)
prompts = st.one_of(
    json_values,
    st.lists(st.integers(min_value=-(2**70), max_value=2**70), max_size=40),
    st.lists(st.integers(min_value=0, max_value=79), min_size=0, max_size=3000),
    st.lists(st.lists(st.integers(min_value=-5, max_value=100), max_size=5), max_size=3),
)
bodies = st.one_of(
    st.builds(
        lambda p, extra: json.dumps({"prompt": p, **extra}).encode(),
        prompts,
        st.dictionaries(st.sampled_from(["model", "max_tokens", "temperature", "stream"]), json_values, max_size=3),
    ),
    st.builds(lambda v: json.dumps(v).encode(), json_values),
    st.binary(max_size=300),
    st.integers(min_value=1, max_value=3000).map(lambda n: b"[" * n + b"]" * n),
)
lengths = st.one_of(
    st.none(),
    st.just("exact"),
    st.integers(min_value=-(10**3), max_value=10**13).map(str),
    st.text(alphabet="0123456789 +-xe.abc", max_size=25),
)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("prop-server")
    (root / "outside.txt").write_text("keep")
    server = stub_server(root / "scratch", limits=Limits(request_timeout_s=0.5, max_connections=16), fail_id=None)
    with running(server) as port:
        yield root, server, port


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    method=st.sampled_from(["POST", "GET", "PUT", "DELETE", "POST\x00", "P O S T"]),
    path=st.sampled_from(["/v1/completions", "/v1/features", "/v1/models", "/health", "/", "/v1/../../etc"])
    | st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=30).map(lambda p: "/" + p),
    body=bodies,
    length=lengths,
    key=st.sampled_from([KEY, None, "wrong", KEY + " ", "Basic " + KEY]),
    chunked=st.booleans(),
)
def test_the_server_never_crashes_nor_500s_on_client_mistakes(live, method, path, body, length, key, chunked):
    root, server, port = live
    headers = {"Host": "x"}
    if key:
        headers["Authorization"] = key if key.startswith("Basic") else f"Bearer {key}"
    if length is not None:
        headers["Content-Length"] = str(len(body)) if length == "exact" else length
    if chunked:
        headers["Transfer-Encoding"] = "chunked"
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    status = _exchange(port, head.encode("utf-8", "surrogatepass") + body)
    assert status != 500 and (status == 0 or 200 <= status < 600), status
    # still serving, and nothing written outside scratch
    assert post(port, body=json.dumps({"prompt": [1, 2, 3]}).encode())[0] == 200
    assert sorted(p.name for p in root.iterdir()) == ["outside.txt", "scratch"]
    assert (root / "outside.txt").read_text() == "keep"
    assert server.stats["errors"] == 0


def _exchange(port: int, data: bytes) -> int:
    """Send ``data``, read the status line (0 when the server closes without an answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            got = s.recv(64)
        except OSError:
            return 0
    parts = got.split()
    return int(parts[1]) if len(parts) > 1 and parts[0].startswith(b"HTTP/") and parts[1].isdigit() else 0


@pytest.fixture(scope="module")
def fake_fleet(tmp_path_factory):
    """One fake server whose answer each example sets, one client that never gives up on it."""
    root = tmp_path_factory.mktemp("prop-client")
    scratch, outside = root / "scratch", root / "outside"
    scratch.mkdir()
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(answer_bytes(np.arange(6)))
    os.symlink(outside / "model.safetensors", scratch / "link.safetensors")
    os.symlink(outside, scratch / "dirlink")
    state = {"answer": ("status", 500)}
    srv = FakeFeatureServer(lambda route, ids: state["answer"])
    fleet = {**FAST_FLEET, "max_retries": 0, "endpoint_max_failures": 10**6, "circuit_breaker_failures": 10**6}
    clients = {
        t: FeatureClient(
            [{"base_url": srv.url, "max_concurrency": 1, "transport": t}],
            fleet_config(fleet, None),
            num_layers=2,
            hidden_size=8,
            scratch_dir=scratch,
        )
        for t in ("path", "bytes")
    }
    for c in clients.values():
        c.start()
    yield root, scratch, outside, state, clients
    for c in clients.values():
        c.close()
    srv.close()


def _snapshot(d: Path) -> dict:
    return {p: (p.read_bytes() if p.is_file() and not p.is_symlink() else os.readlink(p)) for p in d.rglob("*")}


def _rss() -> int:
    return int(next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS")).split()[1])


paths = st.one_of(
    st.sampled_from(
        [
            "OUT/model.safetensors",
            "SCRATCH/link.safetensors",
            "SCRATCH/dirlink/model.safetensors",
            "SCRATCH/../outside/model.safetensors",
            "SCRATCH",
            "SCRATCH/",
            "/dev/zero",
            "/dev/null",
            "/proc/self/environ",
            "/etc/passwd",
            "model.safetensors",
            "../outside/model.safetensors",
            "",
            "SCRATCH/missing.safetensors",
        ]
    ),
    st.text(max_size=40),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(["path", "file", "bytes", "json"]),
    path=paths,
    payload=st.binary(max_size=2000),
    valid=st.booleans(),
    transport=st.sampled_from(["path", "bytes"]),
)
def test_the_client_survives_any_answer_and_touches_nothing_outside_scratch(
    fake_fleet, kind, path, payload, valid, transport
):
    root, scratch, outside, state, clients = fake_fleet
    ids = np.arange(6)
    before, rss0 = _snapshot(outside), _rss()
    if kind == "path":
        state["answer"] = ("path", path.replace("OUT", str(outside)).replace("SCRATCH", str(scratch)))
    elif kind == "file":  # a regular file in scratch: a real answer or random bytes
        f = scratch / "answer.safetensors"
        f.write_bytes(answer_bytes(ids) if valid else payload)
        state["answer"] = ("path", str(f))
    elif kind == "bytes":
        state["answer"] = ("bytes", answer_bytes(ids) if valid else payload)
    else:
        state["answer"] = ("bytes", json.dumps({"kv_transfer_params": {"hidden_states_path": path}}).encode())
    try:
        out = clients[transport].submit(ids).result(timeout=60)
        assert out.features.shape == (6, 16)
    except StreamError:
        pass  # every refusal and every malformed answer ends here, nothing else
    assert _snapshot(outside) == before
    assert (scratch / "link.safetensors").is_symlink() and (scratch / "dirlink").is_symlink()
    assert _rss() - rss0 < 100_000  # KiB: bounded whatever the answer
