"""What the hf feature server (`.server`) accepts: its limits (`features serve` flags, `Limits`),
the checks of one request (`Content-Length`, the JSON body, the token ids: `RequestRefused` with the
HTTP status to answer) and the byte budget of the answer files nobody has read yet (`ScratchBudget`).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Bytes of a request body besides its token ids (model name, sampling fields, whitespace).
BODY_OVERHEAD_BYTES = 64 << 10


class RequestRefused(Exception):
    """A request the server refuses with `status` (4xx/503); the message names the field or limit."""

    status = 400

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status


class BadRequest(RequestRefused, ValueError):
    """A request the server refuses (HTTP 400): the message names the field."""


def max_body_bytes(max_len: int, vocab_size: int) -> int:
    """The largest request body accepted: `max_len` token ids of the vocabulary's widest decimal
    spelling, each with a separator (`", "`), plus `BODY_OVERHEAD_BYTES` (bytes)."""
    return int(max_len) * (len(str(max(int(vocab_size) - 1, 0))) + 2) + BODY_OVERHEAD_BYTES


def content_length(value: str | None, cap: int) -> int:
    """The body size a `Content-Length` header announces. Raises RequestRefused: 411 without one, 400 when it
    is not a non-negative decimal integer, 413 when it exceeds `cap` bytes."""
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
    """Token ids int64 [T] of a request body (`prompt`: a list of ints, or a one-element list of such a list, as the
    OpenAI API allows). Raises BadRequest naming the field."""
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
    """The answer files this server wrote and nobody has read yet: those older than `max_age_s` are
    deleted, and a new answer is admitted only while the files still there and it fit `max_bytes`.

    Only files this server wrote are ever deleted. Thread-safe."""

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
        """Raise RequestRefused (503) when an answer of `size` bytes would take the files held past
        `max_bytes`."""
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
    """What one server accepts (`features serve` flags): `request_timeout_s` (seconds for a request's headers and body,
    and for an idle keep-alive connection), `max_connections` (served at once; more get 503), `scratch_max_bytes` /
    `scratch_max_age_s` (`ScratchBudget`)."""

    request_timeout_s: float = 30.0
    max_connections: int = 64
    scratch_max_bytes: int = 16 << 30
    scratch_max_age_s: float = 600.0
