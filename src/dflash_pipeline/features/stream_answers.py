"""The trust checks on a feature server's answer (`.stream_client`): a named file is read only when its
real path lies under the client's `scratch_dir`, it is a regular file and its size is the one the record's
shape gives; anything else is an `UntrustedAnswer` (not retried, nothing deleted). A header naming
another shape is an `AnswerMismatch`; a malformed one a ValueError (an ordinary failed attempt).
"""

from __future__ import annotations

import fcntl
import json
import os
import stat


class AnswerMismatch(ValueError):
    """An answer for other token ids or of another shape than the client was told to expect: the server taps other
    layers, or serves another target. The same request gets the same answer, so it is never retried."""


class UntrustedAnswer(AnswerMismatch):
    """An answer the client refuses to act on: a path outside the scratch directory, a symlink, a device or FIFO, a
    file or body larger than its record's shape allows. Nothing is read past the check and nothing is deleted; never
    retried."""


#: Largest safetensors header accepted (two tensors and a few metadata keys take about 300 bytes).
MAX_HEADER_BYTES = 1 << 16
#: Largest `/completions` JSON answer read (it names a file; the features are not in it).
MAX_JSON_ANSWER_BYTES = 1 << 20
#: Bytes per value of the tensors an answer may hold (safetensors dtype names).
_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4}
_HIDDEN_DTYPES = ("F32", "BF16", "F16")
_TOKEN_DTYPES = ("I64", "I32")


def max_answer_bytes(num_tokens: int, n_aux: int, hidden: int) -> int:
    """The largest answer file or body of a record of `num_tokens` tokens: `hidden_states` float32
    [T, n_aux, H], `token_ids` int64 [T], the 8-byte length and a header of at most
    `MAX_HEADER_BYTES` (bytes)."""
    return 8 + MAX_HEADER_BYTES + num_tokens * (n_aux * hidden * 4 + 8)


def check_answer_header(raw: bytes, total: int, want: tuple[int, int, int], hint: str = "") -> int:
    """Check the safetensors header at the start of `raw` against the expected `hidden_states` shape
    `want` ([T, n_aux, H]) and the answer's `total` size in bytes; returns the header's end offset.

    `raw` holds at least the 8-byte length (and the header, when that fits `MAX_HEADER_BYTES`);
    `hint` ends a shape mismatch's message. Raises AnswerMismatch (another shape: the server taps other layers),
    UntrustedAnswer (a size the shape
    does not give), ValueError (a malformed header)."""
    if len(raw) < 8:
        raise ValueError(f"an answer of {total} bytes has no safetensors header")
    n = int.from_bytes(raw[:8], "little")
    if n > MAX_HEADER_BYTES or 8 + n > total:
        raise ValueError(f"a safetensors header of {n} bytes in an answer of {total} (at most {MAX_HEADER_BYTES})")
    if len(raw) < 8 + n:
        raise ValueError(f"a safetensors header of {n} bytes, only {len(raw) - 8} read")
    header = json.loads(raw[8 : 8 + n])
    if not isinstance(header, dict):
        raise ValueError("the safetensors header is not a JSON object")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if set(tensors) != {"hidden_states", "token_ids"} or not all(isinstance(v, dict) for v in tensors.values()):
        raise ValueError(f"the answer holds tensors {sorted(tensors)}, expected hidden_states and token_ids")
    hs, tok = tensors["hidden_states"], tensors["token_ids"]
    if not isinstance(hs.get("shape"), list) or tuple(hs["shape"]) != tuple(want):
        raise AnswerMismatch(f"hidden_states {tuple(hs.get('shape') or ())}, expected {tuple(want)}{hint}")
    if tok.get("shape") != [want[0]]:
        raise AnswerMismatch(f"token_ids of shape {tok.get('shape')}, expected [{want[0]}]")
    if hs.get("dtype") not in _HIDDEN_DTYPES or tok.get("dtype") not in _TOKEN_DTYPES:
        raise ValueError(f"hidden_states {hs.get('dtype')} / token_ids {tok.get('dtype')}: unexpected dtypes")
    data = want[0] * want[1] * want[2] * _ITEMSIZE[hs["dtype"]] + want[0] * _ITEMSIZE[tok["dtype"]]
    if total != 8 + n + data:
        raise UntrustedAnswer(
            f"an answer of {total} bytes; hidden_states {hs['dtype']} {list(want)} and {want[0]} token ids give "
            f"{8 + n + data}"
        )
    return 8 + n


def safetensors_metadata(raw: bytes) -> dict:
    """The `__metadata__` of a safetensors file's bytes ({} when it has none): the header is an 8-byte
    little-endian length, then that many bytes of JSON (safetensors format spec). Raises ValueError on bytes
    too short for their header."""
    if len(raw) < 8:
        raise ValueError(f"a safetensors file of {len(raw)} bytes has no header")
    n = int.from_bytes(raw[:8], "little")
    if len(raw) < 8 + n:
        raise ValueError(f"a safetensors header of {n} bytes in a file of {len(raw)}")
    return json.loads(raw[8 : 8 + n]).get("__metadata__") or {}


def _under(path: str, root: str) -> bool:
    return path != root and os.path.commonpath([path, root]) == root


def open_scratch_answer(path, scratch_dir: str | os.PathLike, max_bytes: int) -> tuple[int, int]:
    """Open the answer file `path` a server named, after checking it may be trusted: `(fd, size)`.

    Accepted only when `path` is a non-empty string whose real path lies under the real path of `scratch_dir`, that
    names a regular file (not a symlink, device, FIFO or directory) of at most `max_bytes` bytes, and the file opened is
    that one.

    Raises:
        UntrustedAnswer: any check fails (nothing has been read or deleted).
        FileNotFoundError: a path under the scratch directory that is not there (an answer that expired, or
            a scratch directory this machine does not see): an ordinary failed attempt.
    """
    if not isinstance(path, str) or not path or "\x00" in path:
        raise UntrustedAnswer(f"hidden_states_path {path!r} is not a file path")
    root = os.path.realpath(scratch_dir)
    real = os.path.realpath(path)
    if not _under(real, root):
        raise UntrustedAnswer(
            f"the answer names {path} (real path {real}), outside the scratch directory {root} "
            "(features.stream.scratch_dir): refused, nothing read or deleted"
        )
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise UntrustedAnswer(f"the answer names {path}, which is not a regular file (a symlink, device or FIFO)")
    if st.st_size > max_bytes:
        raise UntrustedAnswer(
            f"the answer names {path} of {st.st_size:,} bytes; its record's shape allows at most {max_bytes:,}: "
            "refused before reading"
        )
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        fst = os.fstat(fd)
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(fst.st_mode):
            raise UntrustedAnswer(f"{path} changed between its check and its opening")
        proc = f"/proc/self/fd/{fd}"
        if os.path.islink(proc) and not _under(os.readlink(proc), root):
            raise UntrustedAnswer(f"{path} opened as {os.readlink(proc)}, outside the scratch directory {root}")
    except BaseException:
        os.close(fd)
        raise
    return fd, fst.st_size


def _wait_for_writer(lock: str) -> None:
    """Wait on `lock` (shared flock, as vLLM's `load_hidden_states`) when it is a regular file; anything
    else there (a symlink, a FIFO) is not waited on."""
    try:
        if not stat.S_ISREG(os.lstat(lock).st_mode):
            return
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # sleeps until the writer releases LOCK_EX
    finally:
        os.close(fd)


def read_scratch_file(
    path: str,
    on_size=None,
    *,
    scratch_dir: str | os.PathLike,
    want: tuple[int, int, int],
    hint: str = "",
) -> tuple[bytes, int]:
    """Read a server's answer file and delete it (and its `.lock`): `(safetensors bytes, size in bytes)`.

    `want`: the record's `hidden_states` shape [T, n_aux, H]. The file (`open_scratch_answer`) and its header
    (`check_answer_header`: that shape and exactly its size) are checked before the data is read; a
    `<path>.lock` (vLLM's connector) is waited on. `on_size(n)` gets the size once open and `-n` once deleted.

    Raises:
        UntrustedAnswer: the path or the size cannot be trusted (nothing read or deleted).
        AnswerMismatch: the header names another shape (the file is deleted).
        ValueError: a malformed header (the file is deleted). OSError: the file is not there."""
    max_bytes = max_answer_bytes(*want)
    if isinstance(path, str) and _under(os.path.realpath(path), os.path.realpath(scratch_dir)):
        _wait_for_writer(path + ".lock")
    fd, size = open_scratch_answer(path, scratch_dir, max_bytes)  # raises before anything is read or deleted
    checked = False
    try:
        if on_size:
            on_size(size)
        with os.fdopen(fd, "rb") as fh:
            fd = -1
            head = fh.read(min(size, 8 + MAX_HEADER_BYTES))
            checked = True  # the path passed: a real answer in scratch, deleted whatever its contents
            check_answer_header(head, size, want, hint)
            data = head + fh.read(size - len(head)) if len(head) < size else head
            if len(data) != size:
                raise ValueError(f"{path}: read {len(data)} of {size} bytes (truncated while read)")
    finally:
        if fd >= 0:
            os.close(fd)
        if checked:
            for p in (path + ".lock", path):
                try:
                    os.remove(p)
                except (FileNotFoundError, IsADirectoryError, PermissionError):
                    pass
        if on_size and size:
            on_size(-size)
    return data, size
