"""Retry policy of the openai backend (completions/retry.py): pure functions, no server."""

from __future__ import annotations

import email.utils

import pytest

from dflash_pipeline.completions import retry
from dflash_pipeline.completions.retry import parse_retry_after, retry_delay, should_retry, status_failure


@pytest.mark.parametrize("status", [408, 409, 425, 429, 500, 502, 503, 504, 599])
def test_retried_statuses(status):
    assert should_retry(status)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 422])
def test_client_errors_are_not_retried(status):
    assert not should_retry(status)


def test_retry_after_seconds_and_http_date():
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after("0.5") == 0.5
    now = 1_700_000_000.0
    date = email.utils.formatdate(now + 7, usegmt=True)  # "Tue, 14 Nov 2023 22:13:27 GMT"
    assert parse_retry_after(date, now=now) == pytest.approx(7.0)
    assert parse_retry_after(email.utils.formatdate(now - 60, usegmt=True), now=now) == 0.0  # passed: no wait
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None


def test_retry_delay_is_exponential_capped_and_jittered():
    kw = dict(base_s=1.0, max_s=8.0, retry_after=None)
    assert [retry_delay(a, jitter=0.999999, **kw) for a in (1, 2, 3, 4, 5)] == pytest.approx([1, 2, 4, 8, 8], rel=1e-5)
    assert retry_delay(3, jitter=0.0, **kw) == 2.0  # jitter scales into [half, full] of the step
    lo, hi = retry_delay(2, jitter=0.0, **kw), retry_delay(2, jitter=0.999999, **kw)
    assert lo == 1.0 and hi == pytest.approx(2.0, rel=1e-5)


def test_retry_delay_honours_retry_after_up_to_the_cap():
    assert retry_delay(1, base_s=0.1, max_s=8.0, retry_after=3.0, jitter=0.5) == 3.0
    assert retry_delay(1, base_s=0.1, max_s=8.0, retry_after=60.0, jitter=0.5) == 8.0  # capped
    assert retry_delay(4, base_s=1.0, max_s=8.0, retry_after=0.1, jitter=0.999999) == pytest.approx(8.0, rel=1e-5)


def test_status_failure_kinds():
    assert status_failure(401, "HTTP 401: no").kind == retry.AUTH
    assert status_failure(403, "HTTP 403: no").kind == retry.AUTH
    assert status_failure(400, "HTTP 400: bad").kind == retry.CLIENT
    limited = status_failure(429, "HTTP 429: slow down", "1.5")
    assert limited.kind == retry.RATE_LIMITED and limited.retry_after == 1.5
    assert status_failure(503, "HTTP 503: busy", "9").kind == retry.ENDPOINT
    assert status_failure(503, "HTTP 503: busy", "9").retry_after is None  # Retry-After is read on 429 only
