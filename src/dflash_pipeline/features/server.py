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
- A bad body (no token ids, ids out of the vocabulary, a record longer than ``--max-len``) answers 400
  (a client error: not retried); a failing forward 500 (retried on another server by the fleet).

Features are computed one record per forward by :class:`.hf_backend.HFExtractor` (no padding), the same
code ``features.backend: hf`` extracts shards with, so a streamed record equals its feature-shard record.
Forwards are serialized (one lock); HTTP handling is threaded. CLI: ``python -m dflash_pipeline.features
serve --target DIR --layer-ids 1,3 ...``; prints ``[features] serving <url>`` once the target is loaded
(and writes the URL to ``--url-file`` atomically).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400): the message names the field."""


def parse_request(body: bytes, *, vocab_size: int, max_len: int) -> np.ndarray:
    """Token ids int64 [T] of a request body (``prompt``: a list of ints, or a one-element list of such a
    list, as the OpenAI API allows). Raises BadRequest naming the field."""
    try:
        req = json.loads(body or b"{}")
    except ValueError as exc:
        raise BadRequest(f"request body is not JSON: {exc}") from None
    prompt = req.get("prompt") if isinstance(req, dict) else None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if (
        not isinstance(prompt, list)
        or not prompt
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        raise BadRequest("prompt: expected a non-empty list of token ids (ints)")
    ids = np.asarray(prompt, dtype=np.int64)
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise BadRequest(
            f"prompt: token id {int(ids.max() if ids.max() >= vocab_size else ids.min())} outside the "
            f"vocabulary [0, {vocab_size})"
        )
    if len(ids) > max_len:
        raise BadRequest(f"prompt: {len(ids)} tokens, more than this server's --max-len {max_len}")
    return ids


class FeatureServer:
    """The target and its scratch directory behind the HTTP handler (see the module docstring).

    ``aux`` layout per token: the K layers of ``layer_ids`` (canonical), then the pre-norm last hidden state
    when ``last_hidden``. ``scratch_dir`` holds the files of answered ``/v1/completions`` requests until their
    client deletes them. ``extractor_kwargs`` go to the :class:`.hf_backend.HFExtractor` that runs the target
    (``num_hidden_layers`` required; ``gpus``, ``target_dtype``, ``trust_remote_code``).
    """

    def __init__(
        self,
        target_dir,
        layer_ids: Sequence[int],
        *,
        last_hidden: bool = False,
        scratch_dir: str | os.PathLike = "feature-scratch",
        model_name: str | None = None,
        max_len: int = 1 << 20,
        hang_after: int | None = None,
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
        self.max_len = int(max_len)
        self.scratch = Path(scratch_dir).resolve()
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.stats = {"requests": 0, "tokens": 0, "compute_s": 0.0, "hung": 0}
        #: fault injection (tests, benches): feature requests after the first ``hang_after`` are accepted
        #: and never answered, while ``GET /v1/models`` and ``/health`` still answer (a wedged engine
        #: behind a live HTTP front end: only the client's request timeout detects it)
        self.hang_after = hang_after
        self._posts = 0
        self._count_lock = threading.Lock()
        self._never = threading.Event()

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
        """Save ``tensors`` to a fresh file in the scratch directory, atomically; returns its path."""
        from safetensors.torch import save_file

        path = self.scratch / f"{uuid.uuid4().hex}.safetensors"
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(tensors, str(tmp), metadata=self.metadata)
        os.replace(tmp, path)
        return path

    def completion(self, ids: np.ndarray) -> dict:
        """The ``/v1/completions`` answer for one record (its file written first)."""
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


def _handler(server: FeatureServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # one line per request would flood the job log
            pass

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, msg: str) -> None:
            self._send(
                status,
                json.dumps(
                    {
                        "error": {
                            "message": msg,
                            "type": "invalid_request_error" if status == 400 else "server_error",
                            "code": status,
                        }
                    }
                ).encode(),
            )

        def do_GET(self):
            if self.path.rstrip("/") in ("/v1/models", "/models"):
                self._send(
                    200,
                    json.dumps(
                        {
                            "object": "list",
                            "data": [
                                {
                                    "id": server.model_name,
                                    "object": "model",
                                    "owned_by": "dflash-pipeline",
                                }
                            ],
                        }
                    ).encode(),
                )
            elif self.path.rstrip("/") in ("/health", "/v1/health"):
                self._send(200, json.dumps({"status": "ok", **server.stats}).encode())
            else:
                self._error(404, f"no route GET {self.path}")

        def do_POST(self):
            route = self.path.rstrip("/").removeprefix("/v1")
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if route not in ("/completions", "/features"):
                return self._error(404, f"no route POST {self.path}")
            server.maybe_hang()
            try:
                ids = parse_request(body, vocab_size=server.vocab_size, max_len=server.max_len)
                if route == "/features":
                    return self._send(200, server.feature_bytes(ids), "application/octet-stream")
                return self._send(200, json.dumps(server.completion(ids)).encode())
            except BadRequest as exc:
                return self._error(400, str(exc))
            except Exception as exc:  # noqa: BLE001 - the client retries a 500 on another server
                return self._error(500, f"{type(exc).__name__}: {exc}")

    return Handler


def serve(
    server: FeatureServer,
    host: str = "127.0.0.1",
    port: int = 0,
    url_file: str | None = None,
) -> None:
    """Serve until killed (SIGTERM/SIGINT); prints ``[features] serving http://host:port/v1`` when ready."""
    from dflash_pipeline.core.shards import atomic_write_bytes

    httpd = ThreadingHTTPServer((host, port), _handler(server))
    httpd.daemon_threads = True
    url = f"http://{host}:{httpd.server_address[1]}/v1"
    if url_file:
        atomic_write_bytes(url_file, url.encode(), skip_if_identical=False)
    print(
        f"[features] serving {url} (model {server.model_name!r}, {server.k} layers x {server.hidden_size}"
        f"{' + last hidden' if server.last_hidden else ''}, scratch {server.scratch})",
        flush=True,
    )
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
        server.close()
