"""The feature client: token ids to a fleet of feature servers, target features back (`features.stream`).

One client talks to every server of `features.stream` (our hf server, `.server`, or `vllm serve` with
`extract_hidden_states`: the same contract) through the completions stage's fleet and retry classes; the
fleet knobs are the `generation.*` ones (`request_timeout_s`, `max_retries`, `endpoint_max_failures`, ...).

A record's features are never skipped: a failed request is retried on the least busy server that is up, so
a server killed mid-epoch costs time only. The job stops (state saved; the rerun resumes) when the breaker
opens, at a client error (4xx but 408/409/425/429), or when one record has failed `max_retries` + 1 times on
servers that are up. A 429 is back-pressure and does not count.

`FeatureClient.submit` returns a `concurrent.futures.Future` of a `Features` (the event loop runs in a
background thread). `transport`: `path` (the answer names a file in a scratch directory both sides see:
read, then deleted with its `.lock`, as vLLM's `load_hidden_states` / `cleanup_hidden_states`) or `bytes`
(`POST /features`; hf servers only).

No answer is trusted (`.stream_answers`): a named file is read only when it is a regular file under the
client's `scratch_dir` of the size its record's shape gives, else `UntrustedAnswer` (not retried, nothing
deleted). A malformed answer is a failed attempt, and after `max_retries` + 1 failures a `StreamError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dflash_pipeline.core.errors import GenerationError

# the answer-trust checks live in .stream_answers; re-exported: callers and tests import them from here
from .stream_answers import (  # noqa: F401
    MAX_HEADER_BYTES,
    MAX_JSON_ANSWER_BYTES,
    AnswerMismatch,
    UntrustedAnswer,
    check_answer_header,
    max_answer_bytes,
    open_scratch_answer,
    read_scratch_file,
    safetensors_metadata,
)


class StreamError(GenerationError):
    """The feature servers cannot deliver (breaker open, a refused record, a mismatching answer)."""


@dataclass
class Features:
    """One record's features: `features` torch [T, K*H] and `last_hidden` [T, H] | None in the storage dtype's
    values, `wire_bytes` (bytes the server sent or wrote) and `scratch_bytes` (of those, bytes that sat in the scratch
    dir)."""

    features: object
    last_hidden: object
    wire_bytes: int
    scratch_bytes: int


def as_stored(x, dtype: str):
    """`x` [T, D] (any float) rounded as a feature shard of `features.dtype` stores and reads it back:
    bf16, or fp8 e4m3 with its per-token scale, dequantized to bf16 (`.format`)."""
    import torch

    from .format import _to_storage

    vals, scale = _to_storage(x, dtype)
    raw = torch.from_numpy(vals)
    if scale is None:
        return raw.view(torch.bfloat16)
    return raw.view(torch.float8_e4m3fn).to(torch.bfloat16) * torch.from_numpy(scale)[:, None].to(torch.bfloat16)


def endpoint_key(endpoint: dict) -> str | None:
    """The API key of a stream endpoint: its `api_key` (colocated servers' per-job key, handed over in
    memory or the environment), else the variable its `api_key_env` names, else None.

    Raises StreamError naming the variable when `api_key_env` is set and the variable is not."""
    if endpoint.get("api_key"):
        return endpoint["api_key"]
    env = endpoint.get("api_key_env")
    if not env:
        return None
    if not os.environ.get(env):
        from dflash_pipeline.completions import redact_url

        raise StreamError(
            f"features.stream.endpoints: ${env} (the key of {redact_url(endpoint['base_url'])}, its api_key_env) "
            "is not set; export it (the key itself never goes into the config)"
        )
    return os.environ[env]


#: The `generation` keys the stream client's fleet reuses (timeouts, failures, back-off, the breaker).
FLEET_KEYS = (
    "request_timeout_s",
    "max_retries",
    "endpoint_max_failures",
    "endpoint_reprobe_s",
    "retry_backoff_s",
    "retry_backoff_max_s",
    "circuit_breaker_failures",
)


def fleet_config(gen_cfg: dict, model: str | None) -> dict:
    """The fleet's knobs (`completions._Fleet`, `FLEET_KEYS`) from the `generation`
    section."""
    return {**{k: gen_cfg[k] for k in FLEET_KEYS}, "model": model}


class FeatureClient:
    """Target features of token-id records from a fleet of feature servers (see the module docstring).

    `endpoints`: `[{"base_url", "max_concurrency", "transport"}]`; `fleet_cfg`: `fleet_config`.
    `num_layers` (K), `hidden_size` (H), `last_hidden`: what the servers send (`[T, K(+1), H]`); `dtype`:
    `features.dtype` (values rounded as a feature shard stores them; None: as sent). `aux_layer_ids`: the HF
    `hidden_states` indices expected; an answer naming others stops the client (None: shape check only).
    `scratch_dir`: where path-transport servers write (required for `transport: path`). An endpoint's key:
    `api_key` (never logged) or `api_key_env`, sent as `Authorization: Bearer`.

    Raises (from `start` and the futures): `StreamError` (breaker open, client error, answers that do not
    match the record or cannot be trusted; at construction: path transport without `scratch_dir`, an unset
    `api_key_env`), ConfigError (a rejected key, a 404 `/models`)."""

    def __init__(
        self,
        endpoints: Sequence[dict],
        fleet_cfg: dict,
        *,
        num_layers: int,
        hidden_size: int,
        last_hidden: bool = False,
        dtype: str = "bfloat16",
        aux_layer_ids: Sequence[int] | None = None,
        scratch_dir: str | os.PathLike | None = None,
    ):
        if not endpoints:
            raise StreamError("features.stream: no feature server (set features.stream.endpoints, or servers > 0)")
        self.endpoints = [dict(e) for e in endpoints]
        self.cfg = fleet_cfg
        self.k, self.h, self.last_hidden, self.dtype = (
            int(num_layers),
            int(hidden_size),
            bool(last_hidden),
            dtype,
        )
        self.aux_layer_ids = [int(i) for i in aux_layer_ids] if aux_layer_ids is not None else None
        self.scratch_dir = os.fspath(scratch_dir) if scratch_dir is not None else None
        if self.scratch_dir is None and any(e.get("transport", "path") == "path" for e in self.endpoints):
            raise StreamError(
                "features.stream: path transport needs the scratch directory the servers write to "
                "(features.stream.scratch_dir); answers naming files elsewhere are refused"
            )
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="feature-client", daemon=True)
        self.fleet = None
        self._transport_of: dict[int, str] = {}
        self._lock = threading.Lock()
        self.stats = {
            "requests": 0,
            "retries": 0,
            "tokens": 0,
            "wire_bytes": 0,
            "scratch_now": 0,
            "peak_scratch_bytes": 0,
            "first_request_t": None,
            "last_reply_t": None,
        }

    # -- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> str:
        """Start the loop, probe every server (`GET /models`) and settle the model; returns the model id."""
        self._thread.start()
        return self._call(self._start())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _start(self) -> str:
        import openai

        from dflash_pipeline.completions import _Endpoint, _Fleet, redact_url

        eps = []
        for e in self.endpoints:
            client = openai.AsyncOpenAI(
                base_url=e["base_url"],
                api_key=endpoint_key(e) or "EMPTY",
                max_retries=0,
                timeout=float(self.cfg["request_timeout_s"]),
            )
            eps.append(
                _Endpoint(
                    url=redact_url(e["base_url"]),
                    client=client,
                    max_concurrency=int(e["max_concurrency"]),
                    key_env=e.get("api_key_env"),
                )
            )
            self._transport_of[id(eps[-1])] = e.get("transport", "path")
        self.fleet = _Fleet(eps, self.cfg, model=self.cfg.get("model"))
        return await self.fleet.start()

    def close(self) -> None:
        """Cancel what is in flight, close the connections, stop the loop."""
        if not self._thread.is_alive():
            return

        async def _close():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.fleet is not None:
                await self.fleet.close()

        try:
            self._call(_close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)

    # -- requests ------------------------------------------------------------------------------------

    def submit(self, ids: np.ndarray) -> concurrent.futures.Future:
        """Request the features of one record (token ids int [T]); a Future of `Features`."""
        return asyncio.run_coroutine_threadsafe(self._fetch(np.asarray(ids, dtype=np.int64)), self.loop)

    def fetch_all(self, records: Sequence[np.ndarray]) -> list[Features]:
        """Features of several records (submitted together, returned in order)."""
        futs = [self.submit(r) for r in records]
        return [f.result() for f in futs]

    async def _fetch(self, ids: np.ndarray) -> Features:
        from dflash_pipeline import completions as retry  # its retry classes, through the public face
        from dflash_pipeline.completions import _auth_error

        if self.stats["first_request_t"] is None:
            self.stats["first_request_t"] = time.monotonic()
        self.stats["requests"] += 1
        attempt = failed = 0  # retries; failures that count against max_retries (not 429s)
        while True:
            try:
                ep = await self.fleet.acquire()  # raises once the breaker is open
            except GenerationError as exc:
                if isinstance(exc, StreamError):
                    raise
                raise StreamError(f"every feature server is gone: {exc}") from exc
            try:
                out, failure = await self._attempt(ep, ids)
            finally:
                self.fleet.release(ep)
            if failure is None:
                self.fleet.success(ep)
                self.stats["tokens"] += len(ids)
                self.stats["last_reply_t"] = time.monotonic()
                return out
            if failure.kind == retry.AUTH:
                raise _auth_error(ep, failure.exc)
            if failure.kind == retry.CLIENT:
                self.fleet.success(ep)
                raise StreamError(
                    f"feature server {ep.url} cannot serve a record of {len(ids)} tokens: {failure.error} "
                    "(a client error or a mismatching answer is not retried)"
                )
            if failure.kind != retry.RATE_LIMITED:
                self.fleet.failure(ep, failure.error)
                failed += 1
                if failed > int(self.cfg["max_retries"]):
                    raise StreamError(
                        f"a record of {len(ids)} tokens failed {failed} times (generation.max_retries "
                        f"{self.cfg['max_retries']}); last: {failure.error} from {ep.url}"
                    )
            attempt += 1
            self.stats["retries"] += 1
            await asyncio.sleep(
                retry.retry_delay(
                    min(attempt, 30),
                    base_s=float(self.cfg["retry_backoff_s"]),
                    max_s=float(self.cfg["retry_backoff_max_s"]),
                    retry_after=failure.retry_after,
                    jitter=random.random(),
                )
            )

    def _want(self, ids: np.ndarray) -> tuple[int, int, int]:
        return (len(ids), self.k + (1 if self.last_hidden else 0), self.h)

    async def _attempt(self, ep, ids: np.ndarray):
        """One request on `ep`: `(Features, None)` or `(None, retry.Failure)`."""
        import openai

        from dflash_pipeline import completions as retry  # its retry classes, through the public face
        from dflash_pipeline.completions import _describe

        transport = self._transport_of[id(ep)]
        body = {
            "model": self.fleet.model,
            "prompt": ids.tolist(),
            "max_tokens": 1,
            "temperature": 0.0,
        }
        path = "/features" if transport == "bytes" else "/completions"
        limit = max_answer_bytes(*self._want(ids)) if transport == "bytes" else MAX_JSON_ANSWER_BYTES
        try:
            raw = await asyncio.wait_for(
                self._post_bounded(ep.client, path, body, limit),
                float(self.cfg["request_timeout_s"]),
            )
        except openai.APIStatusError as exc:
            header = exc.response.headers.get("retry-after") if exc.response is not None else None
            return None, retry.status_failure(exc.status_code, _describe(exc), header, exc)
        except (openai.APIConnectionError, asyncio.TimeoutError) as exc:
            return None, retry.Failure(_describe(exc))
        except AnswerMismatch as exc:
            return None, retry.Failure(f"unusable answer: {exc}", kind=retry.CLIENT)
        except Exception as exc:  # noqa: BLE001 - the body's transport failing mid-read (httpx errors): retried
            return None, retry.Failure(_describe(exc))
        try:
            return await asyncio.to_thread(self._decode, raw, ids, transport), None
        except AnswerMismatch as exc:
            return None, retry.Failure(f"unusable answer: {exc}", kind=retry.CLIENT)
        except Exception as exc:  # noqa: BLE001 - any malformed answer (SafetensorError too) is a failed attempt
            return None, retry.Failure(f"unusable answer: {type(exc).__name__}: {exc}")

    @staticmethod
    async def _post_bounded(client, path: str, body: dict, limit: int) -> bytes:
        """POST `body` and read the answer's body up to `limit` bytes: a `Content-Length` above it is
        refused before reading, a body that runs past it is cut off there (UntrustedAnswer)."""
        import importlib.util

        import openai

        # openai's own transport: httpx2 in the releases that moved to it, httpx before (either is its dependency)
        httpx = importlib.import_module("httpx2" if importlib.util.find_spec("httpx2") else "httpx")
        resp = await client.post(
            path,
            cast_to=httpx.Response,
            body=body,
            options={"headers": {openai._constants.RAW_RESPONSE_HEADER: "stream"}},
        )
        try:
            declared = resp.headers.get("content-length")
            if declared is not None and (not declared.isdigit() or int(declared) > limit):
                raise UntrustedAnswer(
                    f"an answer body of Content-Length {declared[:40]}; its record's shape allows at most "
                    f"{limit:,} bytes: refused before reading"
                )
            chunks, n = [], 0
            async for chunk in resp.aiter_bytes():
                n += len(chunk)
                if n > limit:
                    raise UntrustedAnswer(
                        f"an answer body of more than {limit:,} bytes (its record's shape allows no more): cut off"
                    )
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            await resp.aclose()

    def _decode(self, raw: bytes, ids: np.ndarray, transport: str) -> Features:
        """The `Features` of one answer (runs in a worker thread: file I/O and the dtype rounding)."""
        from safetensors.torch import load

        want = self._want(ids)
        hint = " (the server taps other layers" + (
            "; train.loss: kl needs the last layer: start it with --last-hidden / aux id num_hidden_layers)"
            if self.last_hidden
            else ")"
        )
        if transport == "bytes":
            scratch = 0
            check_answer_header(raw[: 8 + MAX_HEADER_BYTES], len(raw), want, hint)
        else:
            answer = json.loads(raw)
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            path = params.get("hidden_states_path") if isinstance(params, dict) else None
            if not path:
                raise ValueError(
                    "the answer has no kv_transfer_params.hidden_states_path (is the server started "
                    "with extract_hidden_states and a hidden-states connector?)"
                )
            if self.scratch_dir is None:
                raise UntrustedAnswer(
                    f"the answer names {path}, and this client has no scratch directory to check it against "
                    "(features.stream.scratch_dir): refused"
                )
            raw, scratch = read_scratch_file(
                path, self._scratch_add, scratch_dir=self.scratch_dir, want=want, hint=hint
            )
        data = load(raw)
        served = safetensors_metadata(raw).get("aux_layer_ids")
        if self.aux_layer_ids is not None and served is not None and served != ",".join(map(str, self.aux_layer_ids)):
            raise AnswerMismatch(
                f"the server taps hidden_states [{served}], expected {self.aux_layer_ids} (HF indices: "
                "target_layer_ids + 1, then num_hidden_layers with the last layer); start it with the probe's "
                "drafter.target_layer_ids as --layer-ids"
            )
        got = data["token_ids"].numpy().astype(np.int64)
        if not np.array_equal(got, ids):
            raise AnswerMismatch(f"the server's token_ids ({len(got)}) differ from the record's ({len(ids)})")
        hs = data["hidden_states"]
        if tuple(hs.shape) != want:  # check_answer_header saw the same shape; kept as the decoder's own check
            raise AnswerMismatch(f"hidden_states {tuple(hs.shape)}, expected {want}{hint}")
        feats = hs[:, : self.k].reshape(len(ids), -1)
        last = hs[:, self.k] if self.last_hidden else None
        if self.dtype is not None:  # None: the server's values as sent (a shard writer rounds them itself)
            feats, last = as_stored(feats, self.dtype), (as_stored(last, self.dtype) if last is not None else None)
        nbytes = hs.numel() * hs.element_size()
        with self._lock:
            self.stats["wire_bytes"] += nbytes
        return Features(feats, last, nbytes, scratch)

    def _scratch_add(self, n: int) -> None:
        with self._lock:  # decode threads run concurrently
            self.stats["scratch_now"] += n
            self.stats["peak_scratch_bytes"] = max(self.stats["peak_scratch_bytes"], self.stats["scratch_now"])

    def server_tokens_per_s(self) -> float | None:
        """Tokens received per second since the first request (None before any reply)."""
        t0, t1 = self.stats["first_request_t"], self.stats["last_reply_t"]
        return self.stats["tokens"] / (t1 - t0) if t0 is not None and t1 is not None and t1 > t0 else None
