"""Retry policy of the openai backend, as small pure functions (after openai-python's `_should_retry`,
`_parse_retry_after_header` and `_calculate_retry_timeout`, `openai/_base_client.py`).

A failed attempt is a `Failure` of one kind: `auth` (401/403: the job stops with a ConfigError),
`client` (other 4xx but 408/409/425/429: an error row at once, the endpoint stays alive),
`rate_limited` (429: retried after at least `Retry-After`, capped) or `endpoint` (5xx, 408/409/425,
connection errors, timeouts, malformed answers: retried and counted against the endpoint and the
breaker).
"""

from __future__ import annotations

import email.utils
import time
from dataclasses import dataclass

#: HTTP statuses that are retried (plus every 5xx); other 4xx make an error row at once.
RETRYABLE_STATUS = frozenset({408, 409, 425, 429})
#: HTTP statuses that mean the API key is wrong or lacks access: no retry can fix them, the job stops.
AUTH_STATUS = (401, 403)

AUTH = "auth"
CLIENT = "client"
RATE_LIMITED = "rate_limited"
ENDPOINT = "endpoint"


@dataclass(frozen=True)
class Failure:
    """One failed attempt: `error` (one line, `describe._describe`), its `kind` (see the module
    doc), the server's `retry_after` seconds (429 only) and the exception (for the auth message)."""

    error: str
    kind: str = ENDPOINT
    retry_after: float | None = None
    exc: BaseException | None = None


def should_retry(status: int) -> bool:
    """Whether an HTTP `status` is worth another attempt: `RETRYABLE_STATUS` and every 5xx."""
    return status in RETRYABLE_STATUS or status >= 500


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a `Retry-After` header value (RFC 9110 §10.2.3): delay-seconds (`"2"`, `"0.5"`, as given)
    or an HTTP-date. None when absent or unparseable."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    date = email.utils.parsedate_tz(value)
    if date is None:
        return None
    now = time.time() if now is None else now
    return max(0.0, email.utils.mktime_tz(date) - now)


def retry_delay(attempt: int, *, base_s: float, max_s: float, retry_after: float | None, jitter: float) -> float:
    """Seconds to sleep before retry `attempt` (1 = the first retry).

    Exponential backoff `min(max_s, base_s * 2**(attempt - 1))` scaled by `0.5 + 0.5 * jitter` (`jitter` in
    [0, 1), so the delay lies in [half, full] of the step), and at least the server's `retry_after` capped at `max_s`
    (`generation.retry_backoff_s` / `retry_backoff_max_s`)."""
    d = min(max_s, base_s * 2 ** (attempt - 1))
    d = d * (0.5 + 0.5 * jitter)
    if retry_after is not None:
        d = max(d, min(retry_after, max_s))
    return d


def status_failure(
    status: int, error: str, retry_after_header: str | None = None, exc: BaseException | None = None
) -> Failure:
    """The `Failure` of an HTTP error answer (`status`, its one-line `error`, its
    `Retry-After` header value, read for 429 only)."""
    if status in AUTH_STATUS:
        return Failure(error, AUTH, exc=exc)
    if not should_retry(status):
        return Failure(error, CLIENT, exc=exc)
    if status == 429:
        return Failure(error, RATE_LIMITED, retry_after=parse_retry_after(retry_after_header), exc=exc)
    return Failure(error, ENDPOINT, exc=exc)
