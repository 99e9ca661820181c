"""The hf feature server: target features over HTTP, in the request contract of `vllm serve` with
`extract_hidden_states` and a hidden-states KV connector (so one client, `.stream_client`, reads both).

Contract (`features.stream`; peers: speculators' online mode, vLLM's `ExampleHiddenStatesConnector`):

- `GET /v1/models` → `{"object": "list", "data": [{"id": <model>, "object": "model"}]}` (the fleet's
  health probe).
- `POST /v1/completions` with JSON `{"model", "prompt": [token ids], "max_tokens": 1}` → a completion
  JSON whose `kv_transfer_params.hidden_states_path` names a safetensors file in the server's scratch
  directory: `hidden_states` [T, n_aux, H] (the server's compute dtype) and `token_ids` int64 [T]. The aux
  ids are HF `hidden_states` indices (canonical `target_layer_ids` + 1, then, with `--last-hidden`,
  `num_hidden_layers` for the last decoder layer's output before the final norm), as vLLM's
  `eagle_aux_hidden_state_layer_ids`. The file is written atomically before the answer (no `.lock`) and
  names its aux ids in `__metadata__["aux_layer_ids"]` (e.g. `"2,4"`); the client reads and deletes it.
- `POST /v1/features` with the same JSON → the same safetensors file as the body (remote servers).
- A bad body answers 400 (not retried), a body over `--max-len` tokens 413, a bad `Content-Length` 400,
  none 411, a full scratch directory 503 (retried); a 500 is only a failing forward (detail in the log).

Trust (docs/how-to/streaming-security.md): with a key (`--api-key-env`, default
`$DFLASH_FEATURES_API_KEY`) every route but `GET /health` answers 401 without `Authorization: Bearer <key>`;
a non-loopback address without a key is refused unless `--insecure-no-auth`. `--request-timeout-s`,
`--max-connections`, `--scratch-max-age-s` and `--scratch-max-bytes` bound what one client can hold.

Features come from `.hf_backend.HFExtractor`, one record per forward, the code `features.backend: hf`
extracts shards with, so a streamed record equals its feature-shard record. Forwards are serialized; HTTP
handling is threaded (`http.server`). CLI: `python -m dflash_pipeline.features serve --target DIR
--layer-ids 1,3 ...`; prints `[features] serving <url>` once the target is loaded (and writes the URL to
`--url-file`).
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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

from .colocate import DEFAULT_API_KEY_ENV  # noqa: F401 - the variable `features serve` reads its key from

# the request limits and checks live in .server_limits; re-exported: callers and tests import them from here
from .server_limits import (  # noqa: F401
    BODY_OVERHEAD_BYTES,
    BadRequest,
    Limits,
    RequestRefused,
    ScratchBudget,
    content_length,
    max_body_bytes,
    parse_request,
)


class FeatureServer:
    """The target and its scratch directory behind the HTTP handler (see the module docstring).

    `aux` layout per token: the K layers of `layer_ids` (canonical), then the pre-norm last hidden state
    when `last_hidden`. `scratch_dir` holds the files of answered `/v1/completions` requests until their
    client deletes them (or they expire, `ScratchBudget`). `max_len`: the longest record (tokens;
    None or more than the target's `max_position_embeddings`: that). `api_key`: the key every route but
    `GET /health` requires (None: none). `extractor_kwargs` go to the `.hf_backend.HFExtractor`
    that runs the target (`num_hidden_layers` required; `gpus`, `target_dtype`, `trust_remote_code`).
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
        #: fault injection (tests, benches): feature requests after the first `hang_after` are never answered
        #: while `/v1/models` and `/health` still answer (a wedged engine)
        self.hang_after = hang_after
        self._posts = 0
        self._count_lock = threading.Lock()
        self._never = threading.Event()

    def authorized(self, header: str | None) -> bool:
        """Whether an `Authorization` header value carries this server's key (always, without a key)."""
        if self.api_key is None:
            return True
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    def answer_bytes(self, num_tokens: int) -> int:
        """The size of one answer file of `num_tokens` tokens (bytes; the header estimated at 1 KiB)."""
        n_aux = self.k + int(self.last_hidden)
        return num_tokens * (n_aux * self.hidden_size * self.itemsize + 8) + 1024

    def maybe_hang(self) -> None:
        """Block this request's thread forever once `hang_after` feature requests were taken."""
        if self.hang_after is None:
            return
        with self._count_lock:
            self._posts += 1
            hang = self._posts > self.hang_after
            self.stats["hung"] += int(hang)
        if hang:
            self._never.wait()  # never set: the request is accepted and never answered

    def tensors(self, ids: np.ndarray) -> dict:
        """`{"hidden_states": [T, n_aux, H], "token_ids": int64 [T]}` of one record (torch, CPU)."""
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
        """Save `tensors` to a fresh file in the scratch directory, atomically, readable by its owner only;
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
        """The `/v1/completions` answer for one record (its file written first). Raises RequestRefused
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
        """The `/v1/features` answer: the safetensors bytes of one record."""
        from safetensors.torch import save

        return save(self.tensors(ids), metadata=self.metadata)

    def close(self) -> None:
        self.extractor.close()


def _error_body(status: int, msg: str) -> bytes:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    return json.dumps({"error": {"message": msg, "type": kind, "code": status}}).encode()


_UNAUTHORIZED = "missing or wrong API key (Authorization: Bearer <key>)"


class _FeatureHandler(BaseHTTPRequestHandler):
    """The HTTP side of one `FeatureServer` (`features`: set by `_handler`): the routes of the
    module docstring, each request's deadline, and the refusals of `.server_limits`."""

    protocol_version = "HTTP/1.1"
    features: FeatureServer

    def log_message(self, fmt, *args):  # one line per request would flood the job log
        pass

    # -- deadlines and answers -----------------------------------------------------------------------

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
        self._deadline = self._arm(self.features.limits.request_timeout_s)
        try:
            super().handle_one_request()
        finally:
            self._deadline.cancel()

    def _send(self, status: int, body: bytes, ctype: str = "application/json", headers=()) -> None:
        send = self._arm(self.features.limits.request_timeout_s + len(body) / 1e7)  # a reader of >= 10 MB/s
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
        self.features.stats["refused"] += int(status != 404)
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

    def _refuse_unread(self, status: int, msg: str, *, unread: int = 0) -> None:
        """Refuse a request before its body is read: the deadline stops, the connection closes after."""
        self._deadline.cancel()
        self.close_connection = True
        self._refuse(status, msg, unread=unread)

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
        return self.features.authorized(self.headers.get("Authorization"))

    # -- routes --------------------------------------------------------------------------------------

    def handle_expect_100(self) -> bool:
        # "Expect: 100-continue" asks whether to send the body: only with the key and a size we take
        if not self._authorized():
            self._refuse_unread(401, _UNAUTHORIZED)
            return False
        try:
            content_length(self.headers.get("Content-Length"), self.features.max_body)
        except RequestRefused as exc:
            self._refuse_unread(exc.status, str(exc))
            return False
        return super().handle_expect_100()

    def do_GET(self):
        self._deadline.cancel()
        route = self.path.split("?", 1)[0].rstrip("/")
        if route in ("/health", "/v1/health"):
            body = {"status": "ok", **(self.features.stats if self._authorized() else {})}
            return self._send(200, json.dumps(body).encode())
        if not self._authorized():
            return self._refuse(401, _UNAUTHORIZED)
        if route in ("/v1/models", "/models"):
            model = {"id": self.features.model_name, "object": "model", "owned_by": "dflash-pipeline"}
            return self._send(200, json.dumps({"object": "list", "data": [model]}).encode())
        return self._refuse(404, f"no route GET {self.path[:200]}")

    def _body_size(self, route: str, declared: str | None, unread: int) -> int | None:
        """The size of the body to read (the key, the route and `Content-Length` checked first); None when
        the request was refused before its body."""
        if not self._authorized():  # its body is never read
            return self._refuse_unread(401, _UNAUTHORIZED, unread=unread)
        if route not in ("/completions", "/features"):
            return self._refuse_unread(404, f"no route POST {self.path[:200]}", unread=unread)
        try:
            if self.headers.get("Transfer-Encoding"):
                raise BadRequest("Transfer-Encoding: not accepted; send the body with a Content-Length")
            return content_length(declared, self.features.max_body)
        except RequestRefused as exc:
            return self._refuse_unread(exc.status, str(exc), unread=unread)

    def do_POST(self):
        route = self.path.split("?", 1)[0].rstrip("/").removeprefix("/v1")
        declared = self.headers.get("Content-Length")
        unread = int(declared) if declared and declared.strip().isdigit() and len(declared) <= 20 else 0
        n = self._body_size(route, declared, unread)
        if n is not None:
            self._answer(route, n)

    def _answer(self, route: str, n: int) -> None:
        """Read a feature request's body of `n` bytes and answer it (its features, the refusal, or a
        generic 500)."""
        body = self.rfile.read(n)
        self._deadline.cancel()
        if len(body) < n:  # the deadline or the client cut the body short: nobody to answer
            self.close_connection = True
            return
        self.features.maybe_hang()
        server = self.features
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


def _handler(server: FeatureServer) -> type[_FeatureHandler]:
    """The request handler class of `server` (for `_BoundedHTTPServer`)."""
    return type("Handler", (_FeatureHandler,), {"features": server})


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server serving at most `max_connections` connections at once: one more is
    answered 503 (`Retry-After: 1`) and closed at once, without a thread."""

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
    """Whether every address `host` resolves to is a loopback address (127.0.0.0/8, ::1)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def check_bind(host: str, api_key: str | None, insecure_no_auth: bool) -> str | None:
    """Refuse to serve a non-loopback `host` without a key (SystemExit naming the fix) unless
    `insecure_no_auth`; returns the warning to log when serving without a key (None with one)."""
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
    """Serve until killed (SIGTERM/SIGINT); prints `[features] serving http://host:port/v1` when ready.

    Raises SystemExit before binding when `host` is not a loopback address and the server has no key
    (`check_bind`), unless `insecure_no_auth`."""
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
