"""One-line descriptions of request failures, for logs, take-out lines, error rows and the breaker
message (credentials in URLs removed)."""

from __future__ import annotations

import asyncio
import re

from dflash_pipeline.core.errors import strip_url_credentials


def _first_line(exc: BaseException | str) -> str:
    """The first line of `exc`'s message, or its type name when it has none."""
    text = str(exc)
    if text.strip():
        msg = next(line for line in text.splitlines() if line.strip())[:300]
    else:
        msg = type(exc).__name__ if isinstance(exc, BaseException) else "(empty message)"
    return strip_url_credentials(msg)


def _root_cause(exc: BaseException) -> BaseException | None:
    """The first exception in `exc`'s cause chain (`__cause__`, else an unsuppressed `__context__`)
    whose message differs from `exc`'s: the deepest of those sharing that message (the most specific
    type). None when the chain adds nothing."""
    top = _first_line(exc)
    found = None
    seen = {id(exc)}
    cur = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        msg = _first_line(cur)
        if found is None:
            if msg != top:
                found = cur
        elif msg == _first_line(found):
            found = cur  # a deeper exception with the same message names the more specific type
        else:
            break
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return found


def _refused(exc: BaseException) -> bool:
    """Whether `exc`'s cause chain holds a refused connection."""
    import errno

    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, ConnectionRefusedError) or getattr(cur, "errno", None) == errno.ECONNREFUSED:
            return True
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return False


def _describe(exc: BaseException) -> str:
    """One line for logs, take-out lines, error rows and the breaker message: `HTTP <status>: <message>` or
    `<Type>: <message>`, plus `(cause: ...)` from the cause chain; a refused connection (which openai's aiohttp
    transport reports as `APITimeoutError`) is described cause first. Credentials in URLs are removed."""
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout"
    if _refused(exc):
        cause = _root_cause(exc)
        where = _first_line(cause) if cause is not None else _first_line(exc)
        return f"connection refused: {where} (reported as {type(exc).__name__}: {_first_line(exc)})"
    status = getattr(exc, "status_code", None)
    msg = _first_line(exc)
    if status is not None:  # openai's text is "Error code: 400 - {body}": say the server's message once
        body = getattr(exc, "body", None)
        server_msg = body.get("message") if isinstance(body, dict) else None
        msg = (
            _first_line(server_msg)
            if isinstance(server_msg, str) and server_msg.strip()
            else re.sub(r"^Error code: \d+ - ", "", msg)
        )
    out = f"HTTP {status}: {msg}" if status is not None else f"{type(exc).__name__}: {msg}"
    cause = _root_cause(exc)
    if cause is not None:
        out += f" (cause: {type(cause).__name__}: {_first_line(cause)})"
    return out
