"""The fleet of OpenAI-compatible endpoints: least-outstanding-requests selection under each endpoint's
`max_concurrency`, take-out after `endpoint_max_failures` consecutive failures and re-probing
(`GET /models`, backoff doubling up to `retry_backoff_max_s`), a warning every `OUTAGE_LOG_S` seconds while
none is available, the circuit breaker, and the model check (`_settle_model`). Single event loop, no
locks: state changes happen between awaits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

from dflash_pipeline.core.errors import ConfigError, GenerationError

from .describe import _describe
from .retry import AUTH_STATUS

log = logging.getLogger(__package__)  # one logger for the whole completions stage


@dataclass
class _Endpoint:
    """One endpoint of the fleet: its client, cap and the counters the stats report."""

    url: str  # redacted
    client: Any
    max_concurrency: int
    outstanding: int = 0
    up: bool = True
    consecutive_failures: int = 0
    last_error: str = ""
    attempts: int = 0
    failures: int = 0
    taken_out: int = 0
    reprobe_task: Any = None
    key_env: str | None = None  # name of the API-key variable (for error messages; never the key)
    served: list[str] | None = None  # model ids its last answered GET /models listed; None: never answered
    next_probe_at: float | None = None  # time.monotonic() of its next re-probe while taken out


#: Seconds between the warnings logged while every endpoint is taken out (until the breaker opens).
OUTAGE_LOG_S = 30.0


def _auth_error(ep: _Endpoint, exc: BaseException) -> ConfigError:
    """The error for an endpoint that rejected the API key (names the variable, never the key)."""
    where = (
        f"the key in ${ep.key_env} (its api_key_env)" if ep.key_env else "no API key (set api_key_env on this endpoint)"
    )
    return ConfigError(
        f"endpoint {ep.url} rejected {where}: {_describe(exc)}; fix the key or the endpoint's "
        f"api_key_env in generation.endpoints - retrying cannot help"
    )


def _not_found_error(ep: _Endpoint, exc: BaseException) -> ConfigError:
    """The error for an endpoint whose `GET /models` answers 404: its base_url is not an API root."""
    return ConfigError(
        f"endpoint {ep.url}: GET {ep.url.rstrip('/')}/models answered {_describe(exc)}; base_url usually ends "
        f"with /v1 (e.g. http://host:30000/v1); fix its base_url in generation.endpoints - retrying cannot help"
    )


def _model_list(ids: Sequence[str], limit: int = 8) -> str:
    """`'a', 'b'` (the first `limit` ids, then how many more)."""
    shown = ", ".join(repr(i) for i in ids[:limit])
    return shown + (f" and {len(ids) - limit} more" if len(ids) > limit else "")


def _settle_model(model: str | None, served: Sequence[tuple[str, list[str]]], *, configured: bool) -> str | None:
    """The model to send: `model` (`generation.model` when `configured`, or settled earlier) when given,
    else the first id the endpoints list (`served`: `(url, ids)` per answering endpoint; an empty list is
    not judged); None when none lists one.

    Raises:
        ConfigError: `model` is not listed by an endpoint, or none is given and the endpoints list
            different ones (names each endpoint and what it lists)."""
    listing = [(url, list(ids)) for url, ids in served if ids]
    if model:
        bad = [(url, ids) for url, ids in listing if model not in ids]
        if not bad:
            return model
        where = "; ".join(f"endpoint {url} lists {_model_list(ids)}" for url, ids in bad)
        if configured:
            raise ConfigError(
                f"{where} - not generation.model={model!r}; set generation.model to the model these servers "
                f"serve, or list only endpoints that serve {model!r}"
            )
        raise ConfigError(
            f"{where} - not {model!r}, which the other endpoints served when this job started (generation.model "
            f"is not set); the servers now serve different models: set generation.model and list only "
            f"endpoints that serve it"
        )
    if not listing:
        return None
    if len({frozenset(ids) for _, ids in listing}) > 1:
        what = "; ".join(f"{url} serves {_model_list(ids)}" for url, ids in listing)
        raise ConfigError(
            f"the endpoints serve different models ({what}) and generation.model is not set; set "
            f"generation.model to the model to generate with, and list only endpoints that serve it"
        )
    return listing[0][1][0]


class _Fleet:
    """Endpoints with least-outstanding-requests selection, take-out/re-probe and a circuit breaker.

    `model` is the model id sent. Single event loop, no locks: state changes happen between awaits.
    """

    def __init__(self, endpoints: list[_Endpoint], gen_cfg: dict, model: str | None = None):
        self.eps = endpoints
        self.cfg = gen_cfg
        self.configured = bool(gen_cfg["model"])
        self.model = gen_cfg["model"] or model or None
        self.tripped: GenerationError | ConfigError | None = None
        self._waiters: list[asyncio.Future] = []
        self._outage_task: asyncio.Task | None = None
        self._outage_since: float | None = None  # time.monotonic() since when every endpoint is out

    def _wake(self, n: int | None = None) -> None:
        while self._waiters and (n is None or n > 0):
            fut = self._waiters.pop(0)
            if not fut.done():
                fut.set_result(None)
                if n is not None:
                    n -= 1

    def _raise_if_tripped(self) -> None:
        if self.tripped is not None:
            raise self.tripped

    def _trip(self, exc: GenerationError | ConfigError) -> None:
        """Stop the job with `exc` (every waiter wakes and raises it)."""
        if self.tripped is None:
            self.tripped = exc
        self._wake()

    async def acquire(self) -> _Endpoint:
        """An up endpoint with a free slot and the fewest outstanding requests (relative to its cap);
        waits while none has one. Raises GenerationError once the breaker is open."""
        while True:
            self._raise_if_tripped()
            best = None
            for ep in self.eps:
                if ep.up and ep.outstanding < ep.max_concurrency:
                    if best is None or ep.outstanding * best.max_concurrency < best.outstanding * ep.max_concurrency:
                        best = ep
            if best is not None:
                best.outstanding += 1
                best.attempts += 1
                return best
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)

    def release(self, ep: _Endpoint) -> None:
        ep.outstanding -= 1
        self._wake(1)

    def success(self, ep: _Endpoint) -> None:
        ep.consecutive_failures = 0

    def failure(self, ep: _Endpoint, err: str) -> None:
        """A failed request on `ep`: counted while `ep` is in; takes it out at `endpoint_max_failures`."""
        ep.failures += 1
        ep.last_error = err
        if not ep.up:
            return
        ep.consecutive_failures += 1
        if ep.consecutive_failures >= self.cfg["endpoint_max_failures"]:
            self._take_out(ep)
            log.warning(
                "endpoint %s taken out after %d consecutive failures (last: %s)", ep.url, ep.consecutive_failures, err
            )
        self._check_breaker()
        self._watch_outage()

    def _take_out(self, ep: _Endpoint) -> None:
        ep.up = False
        ep.taken_out += 1
        ep.next_probe_at = time.monotonic() + float(self.cfg["endpoint_reprobe_s"])
        ep.reprobe_task = asyncio.get_running_loop().create_task(self._reprobe(ep))

    def _check_breaker(self) -> None:
        n = self.cfg["circuit_breaker_failures"]
        if self.tripped is None and all(e.consecutive_failures >= n for e in self.eps):
            detail = "; ".join(f"{e.url}: {e.last_error}" for e in self.eps).rstrip(".")
            self._trip(
                GenerationError(
                    f"circuit breaker open: every endpoint failed {n}+ consecutive times "
                    f"(generation.circuit_breaker_failures) — {detail}. Check that the servers are up and "
                    f"reachable from this host"
                )
            )

    def _watch_outage(self) -> None:
        """While every endpoint is taken out, warn every `OUTAGE_LOG_S` seconds (the wait for the
        breaker is otherwise silent between re-probes)."""
        if self.tripped is None and not any(ep.up for ep in self.eps):
            if self._outage_since is None:
                self._outage_since = time.monotonic()
            if self._outage_task is None:
                self._outage_task = asyncio.get_running_loop().create_task(self._outage_log())

    async def _outage_log(self) -> None:
        try:
            while True:
                await asyncio.sleep(OUTAGE_LOG_S)
                if self.tripped is not None or self._outage_since is None or any(ep.up for ep in self.eps):
                    self._outage_since = None
                    return
                now = time.monotonic()
                fewest = min(self.eps, key=lambda e: e.consecutive_failures)
                nxt = [e.next_probe_at - now for e in self.eps if e.next_probe_at is not None]
                log.warning(
                    "no endpoint available for %.0f s: %d consecutive failures of circuit_breaker_failures=%d "
                    "(the job stops once every endpoint reaches it); re-probing %d endpoint(s), next in %.0f s "
                    "(last: %s: %s)",
                    now - self._outage_since,
                    fewest.consecutive_failures,
                    self.cfg["circuit_breaker_failures"],
                    len(self.eps),
                    max(0.0, min(nxt)) if nxt else 0.0,
                    fewest.url,
                    fewest.last_error,
                )
        finally:
            self._outage_task = None

    async def probe(self, ep: _Endpoint) -> list[str]:
        """`GET /models` on `ep`; records and returns the model ids. Raises what the client raises."""
        timeout = min(float(self.cfg["request_timeout_s"]), 30.0)
        page = await asyncio.wait_for(ep.client.with_options(timeout=timeout).models.list(), timeout)
        ep.served = [m.id for m in page.data]
        return ep.served

    def _config_error(self, ep: _Endpoint, exc: BaseException) -> ConfigError | None:
        """The error when `exc` from a probe of `ep` is a configuration fault retrying cannot fix: the
        key rejected (401/403), or 404 from an endpoint that never answered `/models` (a base_url
        without `/v1`); None for an outage."""
        status = getattr(exc, "status_code", None)
        if status in AUTH_STATUS:
            return _auth_error(ep, exc)
        if status == 404 and ep.served is None:
            return _not_found_error(ep, exc)
        return None

    async def _reprobe(self, ep: _Endpoint) -> None:
        delay = float(self.cfg["endpoint_reprobe_s"])
        while self.tripped is None:
            ep.next_probe_at = time.monotonic() + delay
            await asyncio.sleep(delay)
            try:
                ids = await self.probe(ep)
            except Exception as exc:  # any failure keeps it out
                err = self._config_error(ep, exc)
                if err is not None:
                    self._trip(err)  # stops the job like the breaker
                    return
                ep.consecutive_failures += 1
                ep.last_error = f"re-probe: {_describe(exc)}"
                self._check_breaker()
                delay = min(delay * 2, float(self.cfg["retry_backoff_max_s"]))
                continue
            if self.model is not None:  # an endpoint back with another model must not join silently
                try:
                    _settle_model(self.model, [(ep.url, ids)], configured=self.configured)
                except ConfigError as exc:
                    self._trip(exc)
                    return
            log.warning("endpoint %s is back", ep.url)
            ep.up = True
            ep.consecutive_failures = 0
            ep.next_probe_at = None
            self._outage_since = None
            self._wake()
            return

    async def start(self) -> str:
        """Probe every endpoint (`GET /models`) and settle the model to send (see `_settle_model`).

        Returns:
            The model id.

        Raises:
            ConfigError: an endpoint rejects the API key, answers 404 (base_url without `/v1`), or lists
                other models than the one to send, or the endpoints list different models and
                `generation.model` is not set.
            GenerationError: the breaker opened, or no answering endpoint lists a model and
                `generation.model` is not set.
        """
        results = await asyncio.gather(*(self.probe(ep) for ep in self.eps), return_exceptions=True)
        for ep, res in zip(self.eps, results):
            if isinstance(res, Exception) and (err := self._config_error(ep, res)) is not None:
                raise err
        self.model = _settle_model(
            self.model, [(ep.url, ep.served) for ep in self.eps if ep.served is not None], configured=self.configured
        )
        for ep, res in zip(self.eps, results):
            if isinstance(res, BaseException):
                self._take_out(ep)
                ep.consecutive_failures = 1
                ep.last_error = f"probe: {_describe(res)}"
                log.warning("endpoint %s does not answer (%s); re-probing later", ep.url, ep.last_error)
        self._check_breaker()
        self._watch_outage()
        while not any(ep.served is not None for ep in self.eps):  # a re-probe records what it lists
            self._raise_if_tripped()
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut
        self._raise_if_tripped()
        self.model = _settle_model(
            self.model, [(ep.url, ep.served) for ep in self.eps if ep.served is not None], configured=self.configured
        )
        if self.model is None:
            urls = ", ".join(f"{ep.url}/models" for ep in self.eps if ep.served is not None)
            raise GenerationError(f"{urls} lists no model; set generation.model")
        return self.model

    async def close(self) -> None:
        if self._outage_task is not None:
            self._outage_task.cancel()
        for ep in self.eps:
            if ep.reprobe_task is not None:
                ep.reprobe_task.cancel()
        for ep in self.eps:
            try:
                await ep.client.close()
            except Exception:  # closing a broken connection is not worth failing the run
                pass
