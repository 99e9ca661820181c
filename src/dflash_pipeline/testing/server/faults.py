"""The test server's fault plan (`Faults`) and how it answers a generation request.

Generation requests (chat and completions, counted together) are numbered 1, 2, … in order of arrival; `Faults.fault_of`
says which of them the plan drops, hangs or fails, `inject_faults` gives that answer (or waits `delay_s`), and
`marker_response` the 400 or malformed 200 that a marker string in the prompt forces.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from aiohttp import web

from .stats import ServerStats


@dataclass
class Faults:
    """Fault plan of a `TestServer` (counts are numbers of chat + completions requests, in arrival
    order; times in seconds). `*_first` take consecutive requests from the start (drops, then hangs,
    then failures); `*_every = N` (0 = off) takes every later request whose number is a multiple of N
    (drop before hang before fail)."""

    drop_first: int = 0
    hang_first: int = 0
    hang_s: float = 30.0
    fail_first: int = 0
    fail_status: int = 503
    retry_after_s: float | None = None
    drop_every: int = 0
    hang_every: int = 0
    fail_every: int = 0
    delay_s: float = 0.0
    die_after: int | None = None
    bad_request_marker: str = "[[400]]"
    wrong_content_marker: str = "[[WRONG]]"
    malformed_marker: str = "[[MALFORMED]]"

    def fault_of(self, n: int) -> str | None:
        """`"drop"`, `"hang"`, `"fail"` or None: what the plan does to generation request `n`."""
        if n <= self.drop_first:
            return "drop"
        if n <= self.drop_first + self.hang_first:
            return "hang"
        if n <= self.drop_first + self.hang_first + self.fail_first:
            return "fail"
        for kind, every in (("drop", self.drop_every), ("hang", self.hang_every), ("fail", self.fail_every)):
            if every > 0 and n % every == 0:
                return kind
        return None


def faults_summary(faults: Faults) -> str:
    """The fields of `faults` that differ from the defaults, as `name=value` (`none` if all do not)."""
    default = Faults()
    changed = [f"{k}={v!r}" for k, v in vars(faults).items() if getattr(default, k) != v]
    return " ".join(changed) or "none"


def drop(request: web.Request) -> web.Response:
    """Abort `request`'s connection: the client gets no answer (the response returned never reaches it)."""
    if request.transport is not None:
        request.transport.abort()
    return web.Response(status=500)  # never reaches the client: the connection is gone


async def inject_faults(
    request: web.Request, n: int, faults: Faults, stats: ServerStats, stopping: asyncio.Event
) -> web.StreamResponse | None:
    """The fault plan's answer to generation request number `n` (None: answer normally, after
    `faults.delay_s` seconds). Hangs and delays end early once `stopping` is set. Counts the fault in
    `stats.statuses` (`"dropped"`, `"hung"` or the failure status)."""
    fault = faults.fault_of(n)
    if fault == "drop":
        stats.statuses["dropped"] += 1
        return drop(request)
    if fault == "hang":
        stats.statuses["hung"] += 1
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stopping.wait(), faults.hang_s)
        return drop(request)
    if fault == "fail":
        stats.statuses[faults.fail_status] += 1
        headers = {"Retry-After": f"{faults.retry_after_s:g}"} if faults.retry_after_s is not None else None
        return web.json_response(
            {"error": {"message": f"injected failure {faults.fail_status}", "type": "server_error"}},
            status=faults.fail_status,
            headers=headers,
        )
    if faults.delay_s > 0:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stopping.wait(), faults.delay_s)
    return None


def marker_response(text: str, faults: Faults, stats: ServerStats) -> web.Response | None:
    """A 400 or a malformed 200 forced by a marker in `text` (None: no such marker); counted in
    `stats.statuses`."""
    if faults.bad_request_marker and faults.bad_request_marker in text:
        stats.statuses[400] += 1
        return web.json_response(
            {"error": {"message": "injected bad request: prompt is too long", "type": "invalid_request_error"}},
            status=400,
        )
    if faults.malformed_marker and faults.malformed_marker in text:
        stats.statuses["malformed"] += 1
        return web.Response(status=200, text='{"choices": [', content_type="application/json")
    return None
