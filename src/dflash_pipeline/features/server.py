"""The hf feature server: target features over HTTP, in the request contract of ``vllm serve`` with
``extract_hidden_states`` and a hidden-states KV connector (so one client, :mod:`.stream_client`, reads both).

Contract (``features.stream``; peers: speculators' online mode, vLLM's ``ExampleHiddenStatesConnector``):

- ``GET /v1/models`` → ``{"object": "list", "data": [{"id": <model>, "object": "model"}]}`` (the fleet's
  health probe, :class:`dflash_pipeline.completions._Fleet`).
- ``POST /v1/completions`` with JSON ``{"model", "prompt": [token ids], "max_tokens": 1}`` → a completion
  JSON whose top-level ``kv_transfer_params.hidden_states_path`` names a safetensors file in the server's
  scratch directory: ``hidden_states`` [T, n_aux, H] (the server's compute dtype) and ``token_ids`` int64 [T].
  The aux ids are HF ``hidden_states`` indices (canonical ``target_layer_ids`` + 1, then, with
  ``--last-hidden``, ``num_hidden_layers`` for the last decoder layer's output *before* the final norm),
  exactly vLLM's ``eagle_aux_hidden_state_layer_ids``. The client reads the file and deletes it. vLLM writes
  a ``<path>.lock`` it holds while writing; this server writes the file atomically (temp + rename) before
  it answers, so there is no lock file. This server also names its aux ids in the file's metadata
  (``__metadata__["aux_layer_ids"]``, e.g. ``"2,4"``), so a client expecting other layers of the same count
  refuses the first answer (vLLM's connector writes no metadata: a shape check only).
- ``POST /v1/features`` with the same JSON → the same safetensors file as the response body
  (``application/octet-stream``): for servers whose scratch directory the trainer cannot see (remote).
- A bad body (not JSON, no token ids, ids out of the vocabulary, a record longer than ``--max-len``, nesting
  deeper than the JSON parser allows) answers 400 (a client error: not retried); a body larger than
  ``--max-len`` tokens can take 413 before a byte of it is read; a ``Content-Length`` that is not a
  non-negative integer 400, none 411; the scratch directory over its byte budget 503 (retried later). A
  500 is only the server's own fault (a failing forward), with a generic body; the detail goes to the log.

Trust (see docs/how-to/streaming-security.md): with a key (``--api-key-env``, default
``$DFLASH_FEATURES_API_KEY``) every route answers 401 without ``Authorization: Bearer <key>`` except the bare
liveness probe ``GET /health`` (``{"status": "ok"}``; its counters only with the key). Binding a
non-loopback address without a key is refused unless ``--insecure-no-auth``. Limits: one request's headers
and body must arrive within ``--request-timeout-s`` (idle keep-alive connections are closed after it too),
at most ``--max-connections`` connections are served at once (more get 503 and are closed), and answer files
nobody read expire after ``--scratch-max-age-s`` or when the files of this server pass
``--scratch-max-bytes``.

Features are computed one record per forward by :class:`.hf_backend.HFExtractor` (no padding), the same
code ``features.backend: hf`` extracts shards with, so a streamed record equals its feature-shard record.
Forwards are serialized (one lock); HTTP handling is threaded (``http.server``: the limits above are a few
lines each here, and uvicorn/starlette would give only the connection cap and keep-alive timeout while adding a
dependency to every train environment). CLI: ``python -m dflash_pipeline.features
serve --target DIR --layer-ids 1,3 ...``; prints ``[features] serving <url>`` once the target is loaded
(and writes the URL to ``--url-file`` atomically).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

from .colocate import DEFAULT_API_KEY_ENV  # noqa: F401 - the variable `features serve` reads its key from

#: Bytes of a request body besides its token ids (model name, sampling fields, whitespace).
BODY_OVERHEAD_BYTES = 64 << 10


class RequestRefused(Exception):
    """A request the server refuses with ``status`` (4xx/503); the message names the field or limit."""

    status = 400

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status


class BadRequest(RequestRefused, ValueError):
    """A request the server refuses (HTTP 400): the message names the field."""


def max_body_bytes(max_len: int, vocab_size: int) -> int:
    """The largest request body accepted: ``max_len`` token ids of the vocabulary's widest decimal
    spelling, each with a separator (``", "``), plus :data:`BODY_OVERHEAD_BYTES` (bytes)."""
    return int(max_len) * (len(str(max(int(vocab_size) - 1, 0))) + 2) + BODY_OVERHEAD_BYTES


def content_length(value: str | None, cap: int) -> int:
    """The body size a ``Content-Length`` header announces. Raises RequestRefused: 411 without one, 400 when it
    is not a non-negative decimal integer, 413 when it exceeds ``cap`` bytes."""
    if value is None:
        raise RequestRefused("Content-Length: required (chunked bodies are not accepted)", 411)
    v = value.strip()
    if not v or len(v) > 20 or not v.isascii() or not v.isdigit():
        raise BadRequest(f"Content-Length: {value[:40]!r} is not a non-negative integer")
    n = int(v)
    if n > cap:
        raise RequestRefused(f"Content-Length: {n} bytes, more than this server accepts ({cap}; --max-len)", 413)
    return n


def parse_request(body: bytes, *, vocab_size: int, max_len: int) -> np.ndarray:
    """Token ids int64 [T] of a request body (``prompt``: a list of ints, or a one-element list of such a
    list, as the OpenAI API allows). Raises BadRequest naming the field (bodies too deeply nested for the
    JSON parser and integers of any size included)."""
    try:
        req = json.loads(body or b"{}")
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"request body is not JSON the server can read: {str(exc)[:200]}") from None
    if not isinstance(req, dict):
        raise BadRequest("request body: expected a JSON object")
    prompt = req.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if not isinstance(prompt, list) or not prompt or not all(type(t) is int for t in prompt):
        raise BadRequest("prompt: expected a non-empty list of token ids (ints)")
    if len(prompt) > max_len:
        raise BadRequest(f"prompt: {len(prompt)} tokens, more than this server's --max-len {max_len}")
    lo, hi = min(prompt), max(prompt)  # Python ints: any size compares, none reaches numpy out of range
    if lo < 0 or hi >= vocab_size:
        bad = hi if hi >= vocab_size else lo
        shown = str(bad) if abs(bad) < 10**30 else f"{str(bad)[:12]}... ({len(str(abs(bad)))} digits)"
        raise BadRequest(f"prompt: token id {shown} outside the vocabulary [0, {vocab_size})")
    if "max_tokens" in req and (type(req["max_tokens"]) is not int or not 0 <= req["max_tokens"] <= 1 << 31):
        raise BadRequest("max_tokens: expected a non-negative integer")
    if "model" in req and not isinstance(req["model"], str):
        raise BadRequest("model: expected a string")
    return np.asarray(prompt, dtype=np.int64)


class ScratchBudget:
    """The answer files this server wrote and nobody has read yet: those older than ``max_age_s`` are
    deleted, and a new answer is admitted only while the files still there and it fit ``max_bytes``.

    Only files this server wrote are ever deleted (the scratch directory may be shared). Thread-safe."""

    def __init__(self, max_bytes: int, max_age_s: float):
        self.max_bytes, self.max_age_s = int(max_bytes), float(max_age_s)
        self._files: dict[Path, tuple[int, float]] = {}
        self._lock = threading.Lock()
        self.expired = 0

    def sweep(self, now: float | None = None) -> int:
        """Forget files their client deleted, delete expired ones; returns the bytes still held."""
        now = time.monotonic() if now is None else now
        held = 0
        with self._lock:
            for path, (size, t) in list(self._files.items()):
                if not path.exists():
                    del self._files[path]
                elif now - t > self.max_age_s:
                    path.unlink(missing_ok=True)
                    del self._files[path]
                    self.expired += 1
                else:
                    held += size
        return held

    def admit(self, size: int, now: float | None = None) -> None:
        """Raise RequestRefused (503) when an answer of ``size`` bytes would take the files held past
        ``max_bytes``."""
        held = self.sweep(now)
        if held + size > self.max_bytes:
            raise RequestRefused(
                f"scratch budget: {held:,} bytes of unread answers held, this one needs {size:,}, the budget is "
                f"{self.max_bytes:,} (--scratch-max-bytes); retry once clients have read theirs",
                503,
            )

    def add(self, path: Path, size: int, now: float | None = None) -> None:
        with self._lock:
            self._files[path] = (int(size), time.monotonic() if now is None else now)


@dataclass
class Limits:
    """What one server accepts (``features serve`` flags): ``request_timeout_s`` (a request's headers and
    body, and an idle keep-alive connection, seconds), ``max_connections`` (served at once; more get 503),
    ``scratch_max_bytes`` / ``scratch_max_age_s`` (:class:`ScratchBudget`)."""

    request_timeout_s: float = 30.0
    max_connections: int = 64
    scratch_max_bytes: int = 16 << 30
    scratch_max_age_s: float = 600.0


class FeatureServer:
    """The target and its scratch directory behind the HTTP handler (see the module docstring).

    ``aux`` layout per token: the K layers of ``layer_ids`` (canonical), then the pre-norm last hidden state
    when ``last_hidden``. ``scratch_dir`` holds the files of answered ``/v1/completions`` requests until their
    client deletes them (or they expire, :class:`ScratchBudget`). ``max_len``: the longest record (tokens;
    None or more than the target's ``max_position_embeddings``: that). ``api_key``: the key every route but
    ``GET /health`` requires (None: none). ``extractor_kwargs`` go to the :class:`.hf_backend.HFExtractor`
    that runs the target (``num_hidden_layers`` required; ``gpus``, ``target_dtype``, ``trust_remote_code``).
    """

    def __init__(
        self,
        target_dir,
        layer_ids: Sequence[int],
        *,
        last_hidden: bool = False,
        scratch_dir: str | os.PathLike = "feature-scratch",
        model_name: str | None = None,
        max_len: int | None = None,
        hang_after: int | None = None,
        api_key: str | None = None,
        limits: Limits | None = None,
        **extractor_kwargs,
    ):
        from dflash_pipeline.target.layer_ids import aux_hidden_state_ids

        from .hf_backend import HFExtractor

        self.extractor = HFExtractor(target_dir, layer_ids, last_hidden=last_hidden, **extractor_kwargs)
        #: safetensors metadata of every answer: the HF hidden_states indices this server taps
        self.metadata = {
            "aux_layer_ids": ",".join(
                map(str, aux_hidden_state_ids(layer_ids, extractor_kwargs["num_hidden_layers"], last_hidden))
            )
        }
        cfg = self.extractor.model.config
        cfg = getattr(cfg, "text_config", None) or cfg
        self.vocab_size = int(self.extractor.model.get_input_embeddings().weight.shape[0])
        self.hidden_size = int(cfg.hidden_size)
        self.k = len(layer_ids)
        self.last_hidden = last_hidden
        self.model_name = model_name or Path(target_dir).name
        context = getattr(cfg, "max_position_embeddings", None)
        self.max_len = int(min(max_len or context or 1 << 20, context or 1 << 62))
        self.max_body = max_body_bytes(self.max_len, self.vocab_size)
        self.itemsize = next(self.extractor.model.parameters()).element_size()
        self.scratch = Path(scratch_dir).resolve()
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.api_key = api_key or None
        self.limits = limits or Limits()
        self.budget = ScratchBudget(self.limits.scratch_max_bytes, self.limits.scratch_max_age_s)
        self.lock = threading.Lock()
        self.stats = {"requests": 0, "tokens": 0, "compute_s": 0.0, "hung": 0, "refused": 0, "errors": 0}
        #: fault injection (tests, benches): feature requests after the first ``hang_after`` are accepted
        #: and never answered, while ``GET /v1/models`` and ``/health`` still answer (a wedged engine
        #: behind a live HTTP front end: only the client's request timeout detects it)
        self.hang_after = hang_after
        self._posts = 0
        self._count_lock = threading.Lock()
        self._never = threading.Event()

    def authorized(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header value carries this server's key (always, without a key)."""
        if self.api_key is None:
            return True
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    def answer_bytes(self, num_tokens: int) -> int:
        """The size of one answer file of ``num_tokens`` tokens (bytes; the header estimated at 1 KiB)."""
        n_aux = self.k + int(self.last_hidden)
        return num_tokens * (n_aux * self.hidden_size * self.itemsize + 8) + 1024

    def maybe_hang(self) -> None:
        """Block this request's thread forever once ``hang_after`` feature requests were taken."""
        if self.hang_after is None:
            return
        with self._count_lock:
            self._posts += 1
            hang = self._posts > self.hang_after
            self.stats["hung"] += int(hang)
        if hang:
            self._never.wait()  # never set: the request is accepted and never answered

    def tensors(self, ids: np.ndarray) -> dict:
        """``{"hidden_states": [T, n_aux, H], "token_ids": int64 [T]}`` of one record (torch, CPU)."""
        import torch

        with self.lock:
            t0 = time.perf_counter()
            ((_, feats, last),) = list(self.extractor.run([0], [ids]))
            self.stats["compute_s"] += time.perf_counter() - t0
            self.stats["requests"] += 1
            self.stats["tokens"] += len(ids)
        hs = feats.reshape(len(ids), self.k, self.hidden_size)
        if self.last_hidden:
            hs = torch.cat([hs, last.to(hs.dtype)[:, None]], dim=1)
        return {"hidden_states": hs.contiguous(), "token_ids": torch.from_numpy(ids)}

    def write(self, tensors: dict) -> Path:
        """Save ``tensors`` to a fresh file in the scratch directory, atomically, readable by its owner only;
        returns its path."""
        from safetensors.torch import save_file

        path = self.scratch / f"{uuid.uuid4().hex}.safetensors"
        tmp = path.with_name(f".{path.name}.tmp")
        old = os.umask(0o077)
        try:
            save_file(tensors, str(tmp), metadata=self.metadata)
        finally:
            os.umask(old)
        os.replace(tmp, path)
        self.budget.add(path, path.stat().st_size)
        return path

    def completion(self, ids: np.ndarray) -> dict:
        """The ``/v1/completions`` answer for one record (its file written first). Raises RequestRefused
        (503) when the scratch budget cannot take it."""
        self.budget.admit(self.answer_bytes(len(ids)))
        path = self.write(self.tensors(ids))
        return {
            "id": f"cmpl-{path.stem}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "text": "", "finish_reason": "length", "logprobs": None}],
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": 0,
                "total_tokens": len(ids),
            },
            "kv_transfer_params": {"hidden_states_path": str(path)},
        }

    def feature_bytes(self, ids: np.ndarray) -> bytes:
        """The ``/v1/features`` answer: the safetensors bytes of one record."""
        from safetensors.torch import save

        return save(self.tensors(ids), metadata=self.metadata)

    def close(self) -> None:
        self.extractor.close()


def _error_body(status: int, msg: str) -> bytes:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    return json.dumps({"error": {"message": msg, "type": kind, "code": status}}).encode()


def _handler(server: FeatureServer):
    limits = server.limits

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # one line per request would flood the job log
            pass

        def _expire(self) -> None:
            """The request deadline passed: shut the socket, so a blocked read returns and the thread ends."""
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        def _arm(self, seconds: float) -> threading.Timer:
            timer = threading.Timer(seconds, self._expire)
            timer.daemon = True
            timer.start()
            return timer

        def handle_one_request(self):
            # the deadline covers the wait for the request line, the headers and the body (an idle
            # keep-alive connection included); do_GET / do_POST cancel it once the request is in
            self._deadline = self._arm(limits.request_timeout_s)
            try:
                super().handle_one_request()
            finally:
                self._deadline.cancel()

        def _send(self, status: int, body: bytes, ctype: str = "application/json", headers=()) -> None:
            send = self._arm(limits.request_timeout_s + len(body) / 1e7)  # a reader of >= 10 MB/s
            try:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in headers:
                    self.send_header(k, v)
                if self.close_connection:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)
            finally:
                send.cancel()

        def _refuse(self, status: int, msg: str, *, unread: int = 0) -> None:
            """Answer an error; with a body left unread, close the connection after a bounded drain (the
            client's send then ends in our answer rather than a reset)."""
            server.stats["refused"] += int(status != 404)
            headers = []
            if status == 401:
                headers.append(("WWW-Authenticate", "Bearer"))
            if status == 503:
                headers.append(("Retry-After", "1"))
            if unread:
                self.close_connection = True
            self._send(status, _error_body(status, msg), headers=headers)
            if unread:
                self._drain(unread)

        def _drain(self, n: int, seconds: float = 1.0) -> None:
            try:
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_WR)
                self.connection.settimeout(0.2)
                deadline = time.monotonic() + seconds
                while n > 0 and time.monotonic() < deadline:
                    got = self.connection.recv(min(n, 1 << 16))  # discarded: never held
                    if not got:
                        break
                    n -= len(got)
            except OSError:
                pass

        def _authorized(self) -> bool:
            return server.authorized(self.headers.get("Authorization"))

        def handle_expect_100(self) -> bool:
            # "Expect: 100-continue" asks whether to send the body: only with the key and a size we take
            if not self._authorized():
                self._deadline.cancel()
                self.close_connection = True
                self._refuse(401, "missing or wrong API key (Authorization: Bearer <key>)")
                return False
            try:
                content_length(self.headers.get("Content-Length"), server.max_body)
            except RequestRefused as exc:
                self._deadline.cancel()
                self.close_connection = True
                self._refuse(exc.status, str(exc))
                return False
            return super().handle_expect_100()

        def do_GET(self):
            self._deadline.cancel()
            route = self.path.split("?", 1)[0].rstrip("/")
            if route in ("/health", "/v1/health"):
                body = {"status": "ok", **(server.stats if self._authorized() else {})}
                return self._send(200, json.dumps(body).encode())
            if not self._authorized():
                return self._refuse(401, "missing or wrong API key (Authorization: Bearer <key>)")
            if route in ("/v1/models", "/models"):
                return self._send(
                    200,
                    json.dumps(
                        {
                            "object": "list",
                            "data": [{"id": server.model_name, "object": "model", "owned_by": "dflash-pipeline"}],
                        }
                    ).encode(),
                )
            return self._refuse(404, f"no route GET {self.path[:200]}")

        def do_POST(self):
            route = self.path.split("?", 1)[0].rstrip("/").removeprefix("/v1")
            declared = self.headers.get("Content-Length")
            unread = int(declared) if declared and declared.strip().isdigit() and len(declared) <= 20 else 0
            if not self._authorized():
                self._deadline.cancel()
                self.close_connection = True  # its body is never read
                return self._refuse(401, "missing or wrong API key (Authorization: Bearer <key>)", unread=unread)
            if route not in ("/completions", "/features"):
                self._deadline.cancel()
                self.close_connection = True
                return self._refuse(404, f"no route POST {self.path[:200]}", unread=unread)
            try:
                if self.headers.get("Transfer-Encoding"):
                    raise BadRequest("Transfer-Encoding: not accepted; send the body with a Content-Length")
                n = content_length(declared, server.max_body)
            except RequestRefused as exc:
                self._deadline.cancel()
                self.close_connection = True
                return self._refuse(exc.status, str(exc), unread=unread)
            body = self.rfile.read(n)
            self._deadline.cancel()
            if len(body) < n:  # the deadline or the client cut the body short: nobody to answer
                self.close_connection = True
                return
            server.maybe_hang()
            try:
                ids = parse_request(body, vocab_size=server.vocab_size, max_len=server.max_len)
                del body
                if route == "/features":
                    return self._send(200, server.feature_bytes(ids), "application/octet-stream")
                return self._send(200, json.dumps(server.completion(ids)).encode())
            except RequestRefused as exc:
                return self._refuse(exc.status, str(exc))
            except Exception:  # noqa: BLE001 - the server's own fault: details to the log, a generic answer
                server.stats["errors"] += 1
                print(f"[features] error answering POST {route}:", file=sys.stderr, flush=True)
                traceback.print_exc()
                return self._send(
                    500, _error_body(500, "internal error computing the features (details in the server log)")
                )

    return Handler


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server serving at most ``max_connections`` connections at once: one more is
    answered 503 (``Retry-After: 1``) and closed at once, without a thread."""

    daemon_threads = True
    request_queue_size = 256

    def __init__(self, address, handler, max_connections: int):
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            body = _error_body(503, "too many connections; retry")
            try:
                request.settimeout(1.0)
                request.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                    b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                )
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # a client that hung up or timed out: nothing to answer, nothing to log
            return
        super().handle_error(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address (127.0.0.0/8, ::1)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def check_bind(host: str, api_key: str | None, insecure_no_auth: bool) -> str | None:
    """Refuse to serve a non-loopback ``host`` without a key (SystemExit naming the fix) unless
    ``insecure_no_auth``; returns the warning to log when serving without a key (None with one)."""
    if api_key:
        return None
    if not is_loopback(host) and not insecure_no_auth:
        raise SystemExit(
            f"features serve: refusing to listen on {host} without an API key: anyone who reaches the port gets "
            f"the target's hidden states and its GPUs. Export a key in ${DEFAULT_API_KEY_ENV} (or the variable "
            "--api-key-env names) and give the trainers the same one (features.stream.endpoints[].api_key_env), "
            "or say --insecure-no-auth on a network only you can reach"
        )
    where = "any host that reaches the port" if not is_loopback(host) else "any user of this machine"
    return f"[features] WARNING: serving without an API key: {where} can use this server (see --api-key-env)"


def serve(
    server: FeatureServer,
    host: str = "127.0.0.1",
    port: int = 0,
    url_file: str | None = None,
    *,
    insecure_no_auth: bool = False,
) -> None:
    """Serve until killed (SIGTERM/SIGINT); prints ``[features] serving http://host:port/v1`` when ready.

    Raises SystemExit before binding when ``host`` is not a loopback address and the server has no key
    (:func:`check_bind`), unless ``insecure_no_auth``."""
    from dflash_pipeline.core.shards import atomic_write_bytes

    warning = check_bind(host, server.api_key, insecure_no_auth)
    httpd = _BoundedHTTPServer((host, port), _handler(server), server.limits.max_connections)
    url = f"http://{host}:{httpd.server_address[1]}/v1"
    if warning:
        print(warning, flush=True)
    if url_file:
        atomic_write_bytes(url_file, url.encode(), skip_if_identical=False)
    lim = server.limits
    print(
        f"[features] serving {url} (model {server.model_name!r}, {server.k} layers x {server.hidden_size}"
        f"{' + last hidden' if server.last_hidden else ''}, scratch {server.scratch}; "
        f"{'API key required' if server.api_key else 'no API key'}; max-len {server.max_len} tokens "
        f"(bodies <= {server.max_body:,} B), request timeout {lim.request_timeout_s:g} s, "
        f"<= {lim.max_connections} connections, scratch budget {lim.scratch_max_bytes:,} B / "
        f"{lim.scratch_max_age_s:g} s)",
        flush=True,
    )
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
        server.close()
