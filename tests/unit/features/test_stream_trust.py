"""The stream client trusts no answer: a fake feature server (no model) names files outside the scratch
directory, symlinks, devices and FIFOs, oversized files and bodies, and malformed safetensors. Each is refused
with a clear error, never retried when it cannot be trusted, retried when it is only malformed, and no file
outside the scratch directory is read or deleted. Memory stays bounded while a 256 MiB answer is refused."""

from __future__ import annotations

import http.server
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FAST_FLEET
from safetensors.torch import save

from dflash_pipeline.features import FeatureClient, StreamError, fleet_config
from dflash_pipeline.features.stream_client import max_answer_bytes

K, H = 2, 8


def answer_bytes(ids: np.ndarray, *, k: int = K, dtype=torch.float32) -> bytes:
    """A well-formed answer for ``ids``: hidden_states [T, k, H], token_ids int64 [T]."""
    t = len(ids)
    return save(
        {
            "hidden_states": torch.arange(t * k * H, dtype=torch.float32).reshape(t, k, H).to(dtype),
            "token_ids": torch.from_numpy(np.asarray(ids, dtype=np.int64)),
        }
    )


class FakeFeatureServer:
    """A feature server that answers whatever ``answer(route, ids)`` says: ``("path", str)`` (a completion
    naming that path), ``("bytes", bytes)`` (the body), ``("short", bytes)`` (a tenth of it, then the
    connection closed), ``("stream", n)`` (n zero bytes streamed without a
    Content-Length, 1 MiB at a time, never held whole) or ``("status", code)``. Counts feature requests."""

    def __init__(self, answer):
        self.answer, self.posts = answer, 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, code, body: bytes, ctype="application/json", length=True):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                if length:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send(200, json.dumps({"object": "list", "data": [{"id": "t", "object": "model"}]}).encode())

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.posts += 1
                kind, val = outer.answer(self.path, np.asarray(req["prompt"], dtype=np.int64))
                if kind == "path":
                    body = {"id": "x", "choices": [], "kv_transfer_params": {"hidden_states_path": val}}
                    return self._send(200, json.dumps(body).encode())
                if kind == "bytes":
                    return self._send(200, val, "application/octet-stream")
                if kind == "status":
                    return self._send(val, b'{"error": {"message": "no"}}')
                if kind == "short":  # announces a body, sends a tenth of it, hangs up
                    self.close_connection = True
                    self.send_response(200)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.send_header("Content-Length", str(len(val)))
                    self.end_headers()
                    self.wfile.write(val[: len(val) // 10])
                    return
                self.close_connection = True
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                chunk = bytes(1 << 20)
                try:
                    for _ in range(val >> 20):
                        self.wfile.write(chunk)
                except OSError:  # the client hung up: what it should do
                    pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda *a: None  # a client hanging up mid-body is what the tests ask for
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def fetch(answer, scratch, transport="path", ids=None, fleet=FAST_FLEET):
    """``(result or exception, fake server)`` of one record through a FeatureClient."""
    srv = FakeFeatureServer(answer)
    c = FeatureClient(
        [{"base_url": srv.url, "max_concurrency": 1, "transport": transport}],
        fleet_config(fleet, None),
        num_layers=K,
        hidden_size=H,
        scratch_dir=scratch,
    )
    try:
        c.start()
        try:
            return c.submit(np.arange(6) if ids is None else ids).result(timeout=60), srv, c
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc, srv, c
    finally:
        c.close()
        srv.close()


@pytest.fixture
def dirs(tmp_path):
    scratch, ckpt = tmp_path / "scratch", tmp_path / "ckpt"
    scratch.mkdir()
    ckpt.mkdir()
    weights = ckpt / "model.safetensors"
    weights.write_bytes(answer_bytes(np.arange(6)))  # a file that would even decode as an answer
    return scratch, weights


def _untrusted(out, srv, c, match: str):
    assert isinstance(out, StreamError), out
    assert match in str(out), str(out)
    assert "not retried" in str(out)
    assert srv.posts == 1 and c.stats["retries"] == 0  # refused at once, never re-sent


@pytest.mark.parametrize("how", ["checkpoint", "dotdot", "symlink", "symlinked_dir", "dev_zero", "fifo", "dir"])
def test_a_named_file_that_cannot_be_trusted_is_refused_and_survives(dirs, how):
    """A checkpoint outside scratch, a ``..`` path, a symlink in scratch to it, a symlinked directory, /dev/zero,
    a FIFO in scratch (it would block a reader), a directory: each a clear non-retryable error; every file
    survives unchanged."""
    scratch, weights = dirs
    before = weights.read_bytes()
    path, match = {
        "checkpoint": (str(weights), "outside the scratch directory"),
        "dotdot": (str(scratch / ".." / "ckpt" / "model.safetensors"), "outside the scratch directory"),
        "symlink": (str(scratch / "a.safetensors"), "outside the scratch directory"),
        "symlinked_dir": (str(scratch / "d" / "model.safetensors"), "outside the scratch directory"),
        "dev_zero": ("/dev/zero", "outside the scratch directory"),
        "fifo": (str(scratch / "f.safetensors"), "not a regular file"),
        "dir": (str(scratch / "sub"), "not a regular file"),
    }[how]
    if how == "symlink":
        os.symlink(weights, scratch / "a.safetensors")
    if how == "symlinked_dir":
        os.symlink(weights.parent, scratch / "d")
    if how == "fifo":
        os.mkfifo(scratch / "f.safetensors")
    if how == "dir":
        (scratch / "sub").mkdir()
    out, srv, c = fetch(lambda route, ids: ("path", path), scratch)
    _untrusted(out, srv, c, match)
    assert weights.read_bytes() == before
    if how == "symlink":
        assert (scratch / "a.safetensors").is_symlink()
    if how == "fifo":
        assert (scratch / "f.safetensors").exists()


def test_a_symlink_to_a_file_inside_scratch_is_refused(dirs):
    """Even pointing inside scratch, a symlink is not an answer: refused, link and file kept."""
    scratch, _ = dirs
    real = scratch / "real.safetensors"
    real.write_bytes(answer_bytes(np.arange(6)))
    os.symlink(real, scratch / "link.safetensors")
    out, srv, c = fetch(lambda route, ids: ("path", str(scratch / "link.safetensors")), scratch)
    _untrusted(out, srv, c, "not a regular file")
    assert real.is_file() and (scratch / "link.safetensors").is_symlink()


def test_a_good_answer_in_scratch_is_read_and_deleted(dirs):
    scratch, weights = dirs
    f = scratch / "good.safetensors"
    f.write_bytes(answer_bytes(np.arange(6)))
    out, srv, c = fetch(lambda route, ids: ("path", str(f)), scratch)
    assert out.features.shape == (6, K * H) and not f.exists() and weights.exists()


def _vm(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process (bytes)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


@pytest.mark.parametrize("transport", ["path", "bytes"])
def test_a_256_mib_answer_is_refused_before_it_is_read(dirs, transport):
    """A 256 MiB answer (a sparse file in scratch; a body streamed without Content-Length) for a 6-token record
    is refused once it passes the record's largest answer size; the client's peak RSS (VmHWM, reset first)
    stays within 50 MB of its baseline, and the file is left in place."""
    scratch, _ = dirs
    big = scratch / "big.safetensors"
    with open(big, "wb") as fh:
        fh.truncate(256 << 20)
    answer = (lambda r, i: ("path", str(big))) if transport == "path" else (lambda r, i: ("stream", 256 << 20))
    good = scratch / "good.safetensors"
    good.write_bytes(answer_bytes(np.arange(6)))
    fetch(lambda r, i: ("path", str(good)), scratch)  # warm: imports and first-use allocations out of the figure
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (Linux >= 4.0)
    base = _vm("VmRSS")
    out, srv, c = fetch(answer, scratch, transport)
    grew = _vm("VmHWM") - base
    print(f"256 MiB {transport} answer refused; client peak RSS +{grew / 1e6:.1f} MB over its baseline")
    _untrusted(out, srv, c, "refused before reading" if transport == "path" else "cut off")
    assert grew < 50e6
    assert big.stat().st_size == 256 << 20
    assert max_answer_bytes(6, K, H) < 1 << 20


def test_an_oversized_content_length_is_refused_before_reading(dirs):
    scratch, _ = dirs
    out, srv, c = fetch(lambda r, ids: ("bytes", answer_bytes(ids) + bytes(1 << 20)), scratch, "bytes")
    _untrusted(out, srv, c, "Content-Length")


def test_a_file_whose_size_its_header_does_not_give_is_refused_and_kept(dirs):
    scratch, _ = dirs
    f = scratch / "padded.safetensors"
    f.write_bytes(answer_bytes(np.arange(6)) + b"\0" * 16)
    out, srv, c = fetch(lambda route, ids: ("path", str(f)), scratch)
    assert isinstance(out, StreamError) and "give" in str(out), out
    assert srv.posts == 1


@pytest.mark.parametrize(
    "kind",
    ["not_json", "no_path", "garbage_file", "bad_offsets", "cut_short"],
)
def test_malformed_answers_are_retried_then_stop_the_client(dirs, kind):
    """Malformed answers (not JSON, no path, garbage in a scratch file, a safetensors header whose offsets the
    library refuses: SafetensorError) are ordinary failed attempts: sent max_retries + 1 times, then a
    StreamError naming the last one (the train job saves its state on it)."""
    scratch, _ = dirs

    def bad_offsets(ids):
        raw = answer_bytes(ids)
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        a, b = header["token_ids"]["data_offsets"]
        header["token_ids"]["data_offsets"] = [a + 8, b + 8]  # overlaps nothing valid: SafetensorError
        hdr = json.dumps(header).encode()
        hdr += b" " * (n - len(hdr)) if len(hdr) <= n else b""
        return len(hdr).to_bytes(8, "little") + hdr + raw[8 + n :]

    def answer(route, ids):
        if kind == "not_json":
            return "bytes", b"<html>"
        if kind == "no_path":
            return "bytes", b'{"choices": []}'
        if kind == "cut_short":
            return "short", answer_bytes(ids)
        if kind == "garbage_file":
            f = scratch / "garbage.safetensors"
            f.write_bytes(b"\xff" * 64)
            return "path", str(f)
        return "bytes", bad_offsets(ids)

    transport = "bytes" if kind in ("bad_offsets", "cut_short") else "path"
    out, srv, c = fetch(answer, scratch, transport, fleet={**FAST_FLEET, "max_retries": 2})
    assert isinstance(out, StreamError), out
    assert "failed 3 times" in str(out), str(out)
    assert ("unusable answer" in str(out)) != (kind == "cut_short"), str(out)
    if kind == "bad_offsets":
        assert "SafetensorError" in str(out), str(out)
    assert srv.posts == 3
    assert not (scratch / "garbage.safetensors").exists()  # a file in scratch that passed the checks is cleaned


def test_path_transport_without_a_scratch_dir_is_refused():
    with pytest.raises(StreamError, match="scratch_dir"):
        FeatureClient(
            [{"base_url": "http://127.0.0.1:9/v1", "max_concurrency": 1, "transport": "path"}],
            fleet_config(FAST_FLEET, None),
            num_layers=K,
            hidden_size=H,
        )
