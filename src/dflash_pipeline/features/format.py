"""Feature shard file format: a safetensors file with an offsets index, memory-mapped on read.

One feature shard per token shard (`results/features/{dataset}/{shard}.safetensors`). All records of the
token shard, in row order, are concatenated along the token axis; `offsets` [R+1] int64 gives record
`r` the token rows `offsets[r]:offsets[r+1]`. Tensors (safetensors names, dtypes, shapes; N = tokens):

- `offsets`        I64  [R+1]
- `num_loss_tokens` I32 [R]         supervised tokens per record
- `input_ids`      I32  [N]         the token shard's `input_ids`, concatenated
- `loss_mask`      U8   [N]
- `features`       BF16 or F8_E4M3 [N, K*H]: the outputs of target decoder layers `target_layer_ids`
  concatenated along the last axis, `torch.cat([h_l for l in ids], -1)`, as `train.target_features` builds
- `feature_scale`  F32  [N, K]      fp8 only: `x = fp8 * scale`, `scale = max|x| / 448` over the token's H
  values of that layer (e4m3's largest finite value); schema 1 shards have one scale per token [N]
- `last_hidden`    BF16 or F8_E4M3 [N, H] (optional): the last decoder layer's output before its final norm
- `last_hidden_scale` F32 [N]       fp8 and last_hidden only

`__metadata__["dflash"]` is canonical JSON: `schema_version` (`FEATURE_SCHEMA_VERSION`),
`token_shard` (file name), `token_shard_sha256`, `num_records`, `num_tokens`, `target_layer_ids`,
`hidden_size`, `dtype` (`bfloat16` | `float8_e4m3`), `last_hidden`, `backend` and provenance.
`FeatureShard` refuses a shard whose metadata `dtype` is missing or disagrees with the tensor header.
Tensors are laid out widest element first, so every view is aligned.

Writes are resumable and atomic (`FeatureShardWriter`): the file is allocated up front in a hidden
`.<name>.partial` (a full disk fails before any compute), records are written in order and committed to
`.<name>.progress` after an `fsync`; a rerun with the same header continues after the last committed
record. Only numpy at import time, so the module loads in the vLLM environment and at planning.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from dflash_pipeline.core.contracts import FEATURE_SCHEMA_VERSION, canonical_json

#: Storage dtypes of `features.dtype` → (safetensors dtype, bytes per value).
STORAGE_DTYPES = {"bfloat16": ("BF16", 2), "float8_e4m3": ("F8_E4M3", 1)}
#: Largest finite float8 e4m3fn value (the per-token scale maps each token's max |x| onto it).
FP8_E4M3_MAX = 448.0
_ST_ITEMSIZE = {"I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F8_E4M3": 1, "U8": 1}
#: safetensors dtype of the `features` tensor → `features.dtype` name.
_STORAGE_OF_ST = {st: name for name, (st, _) in STORAGE_DTYPES.items()}
#: `schema_version` values this code reads (1: fp8 scale per token; 2: per token per layer).
READABLE_SCHEMA_VERSIONS = (1, FEATURE_SCHEMA_VERSION)
_ST_NUMPY = {
    "I64": np.int64,
    "F32": np.float32,
    "I32": np.int32,
    "BF16": np.uint16,
    "F8_E4M3": np.uint8,
    "U8": np.uint8,
}


class FeatureShardError(ValueError):
    """A feature shard that does not match its token shard or the expected layout (message names both)."""


def bytes_per_token(num_layers: int, hidden_size: int, dtype: str = "bfloat16", last_hidden: bool = False) -> int:
    """Bytes one token takes in a feature shard: `K*H` values (+ `H` for `last_hidden`) at the storage
    dtype, + 4 B per scale (fp8: one per layer, one for `last_hidden`), + 5 B for its input id and loss-mask byte.

    Example (Kimi K2.6, K=5, H=7168, bf16): 5 * 7168 * 2 + 5 = 71,685 B ≈ 72 KB.
    """
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"features.dtype {dtype!r}: expected one of {sorted(STORAGE_DTYPES)}")
    size = STORAGE_DTYPES[dtype][1]
    n = num_layers * hidden_size * size + (4 * num_layers if size == 1 else 0)
    if last_hidden:
        n += hidden_size * size + (4 if size == 1 else 0)
    return n + 4 + 1


@dataclass
class FeatureLayout:
    """Shapes of one feature shard (see the module docstring). `lengths` [R] are the records' token counts."""

    lengths: np.ndarray
    num_layers: int
    hidden_size: int
    dtype: str = "bfloat16"
    last_hidden: bool = False
    metadata: dict = field(default_factory=dict)

    @property
    def num_records(self) -> int:
        return int(len(self.lengths))

    @property
    def num_tokens(self) -> int:
        return int(np.asarray(self.lengths, dtype=np.int64).sum())

    def tensors(self) -> list[tuple[str, str, list[int]]]:
        """`(name, safetensors dtype, shape)` in file order (widest element first)."""
        st, _ = STORAGE_DTYPES[self.dtype]
        n, r, kh, h = self.num_tokens, self.num_records, self.num_layers * self.hidden_size, self.hidden_size
        out = [("offsets", "I64", [r + 1])]
        if st == "F8_E4M3":
            out.append(("feature_scale", "F32", [n, self.num_layers]))
            if self.last_hidden:
                out.append(("last_hidden_scale", "F32", [n]))
        out += [("num_loss_tokens", "I32", [r]), ("input_ids", "I32", [n])]
        if kh:
            out.append(("features", st, [n, kh]))
        if self.last_hidden:
            out.append(("last_hidden", st, [n, h]))
        out.append(("loss_mask", "U8", [n]))
        return out

    def header(self) -> bytes:
        """The safetensors header (8-byte length + JSON, padded with spaces to 8 bytes)."""
        hdr: dict[str, Any] = {"__metadata__": {"dflash": canonical_json(self.metadata)}}
        pos = 0
        for name, st, shape in self.tensors():
            nbytes = int(np.prod(shape, dtype=np.int64)) * _ST_ITEMSIZE[st]
            hdr[name] = {"dtype": st, "shape": shape, "data_offsets": [pos, pos + nbytes]}
            pos += nbytes
        raw = json.dumps(hdr, separators=(",", ":"), sort_keys=True).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw

    def file_size(self) -> int:
        hdr = self.header()
        *_, (name, st, shape) = self.tensors()
        return len(hdr) + json.loads(hdr[8:])[name]["data_offsets"][1]


def _parse_header(buf: bytes | mmap.mmap, path: Path) -> tuple[dict, int]:
    if len(buf) < 8:
        raise FeatureShardError(f"{path}: {len(buf)} bytes, not a safetensors file")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > 100_000_000 or 8 + n > len(buf):
        raise FeatureShardError(f"{path}: header length {n} does not fit the file ({len(buf)} B)")
    return json.loads(bytes(buf[8 : 8 + n])), 8 + n


def _storage_dtype(path: Path, header: dict, meta: dict) -> Optional[str]:
    """The storage dtype of a shard's `features`/`last_hidden` tensors, read from the tensor header;
    None for a shard without them (a token index).

    Raises:
        FeatureShardError: a tensor dtype this format does not store, metadata `dtype` missing or not the
            header's, or a `feature_scale` whose shape is neither [N] nor [N, K].
    """
    names = [n for n in ("features", "last_hidden") if n in header]
    if not names:
        return None
    sts = {header[n]["dtype"] for n in names}
    if len(sts) != 1 or next(iter(sts)) not in _STORAGE_OF_ST:
        raise FeatureShardError(
            f"{path}: tensor dtypes {sorted(sts)} of {names}; a feature shard stores one of {sorted(_STORAGE_OF_ST)}"
        )
    dtype = _STORAGE_OF_ST[next(iter(sts))]
    if meta.get("dtype") != dtype:
        raise FeatureShardError(
            f"{path}: metadata dtype {meta.get('dtype')!r} but the tensors are {next(iter(sts))} "
            f"({dtype}); the shard is damaged or was written by other code: rebuild it"
        )
    if dtype != "bfloat16" and "features" in header:
        n, kh = header["features"]["shape"]
        shape = header.get("feature_scale", {}).get("shape")
        per_layer = (
            isinstance(shape, list) and len(shape) == 2 and shape[0] == n and shape[1] > 0 and kh % shape[1] == 0
        )
        if shape != [n] and not per_layer:
            raise FeatureShardError(
                f"{path}: feature_scale shape {shape}, expected [{n}] (schema 1) or [{n}, K] "
                f"with K dividing the features' {kh} values per token"
            )
    return dtype


def _views(mm: mmap.mmap | memoryview, header: dict, base: int) -> dict[str, np.ndarray]:
    out = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        a, b = spec["data_offsets"]
        dt = np.dtype(_ST_NUMPY[spec["dtype"]])
        arr = np.frombuffer(mm, dtype=dt, count=(b - a) // dt.itemsize, offset=base + a)
        out[name] = arr.reshape(spec["shape"])
    return out


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes (read in 4 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            b = fh.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def _quantize_fp8(x, groups: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
    """`x` [T, D] (torch, any float) → (e4m3 bytes uint8 [T, D], scale float32 [T, groups], or [T] when
    `groups` is None): absmax per token and per group of D/groups consecutive values (one group per layer)."""
    import torch

    xf = x.float()
    t, d = xf.shape
    g = xf.view(t, groups or 1, d // (groups or 1))
    scale = (g.abs().amax(dim=-1) / FP8_E4M3_MAX).clamp(min=1e-12)  # [T, G]
    q = (g / scale[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).view(t, d)
    return q.view(torch.uint8).numpy(), (scale if groups else scale[:, 0]).contiguous().numpy()


def _to_storage(x, dtype: str, groups: Optional[int] = None) -> tuple[np.ndarray, Optional[np.ndarray]]:
    import torch

    x = x.detach().to("cpu")
    if dtype == "bfloat16":
        return x.to(torch.bfloat16).contiguous().view(torch.uint16).numpy(), None
    return _quantize_fp8(x, groups)


class FeatureShardWriter:
    """Resumable, atomic writer of one feature shard (see the module docstring for the format).

    `input_ids` / `loss_mask` are the token shard's flat arrays and `lengths` its per-record token counts; they are
    written at open. `next_record` is where extraction continues. Call `write` for records in order, `commit` to make
    them survive a kill, `finish` to verify and rename the file into place.

    Raises:
        OSError: `ENOSPC` at open when the filesystem cannot hold the whole shard.
    """

    def __init__(self, path: str | os.PathLike, layout: FeatureLayout, input_ids: np.ndarray, loss_mask: np.ndarray):
        self.path = Path(path)
        self.layout = layout
        self.partial = self.path.with_name(f".{self.path.name}.partial")
        self.progress = self.path.with_name(f".{self.path.name}.progress")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        header = layout.header()
        self._header_sha = hashlib.sha256(header).hexdigest()
        size = layout.file_size()
        self.next_record = self._resume_point(header, size)
        fresh = self.next_record == 0
        if fresh:
            self.partial.unlink(missing_ok=True)
            self.progress.unlink(missing_ok=True)
            fd = os.open(self.partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                if size:
                    os.posix_fallocate(fd, 0, size)
                os.pwrite(fd, header, 0)
            finally:
                os.close(fd)
        hdr = json.loads(header[8:])
        self._pos = {k: len(header) + v["data_offsets"][0] for k, v in hdr.items() if k != "__metadata__"}
        self._fd = os.open(self.partial, os.O_RDWR)
        self._ids = input_ids
        self._offsets = np.zeros(layout.num_records + 1, dtype=np.int64)
        np.cumsum(np.asarray(layout.lengths, dtype=np.int64), out=self._offsets[1:])
        if fresh:
            cs = np.concatenate([[0], np.cumsum(loss_mask, dtype=np.int64)])
            self._put("offsets", 0, self._offsets)
            self._put("input_ids", 0, np.asarray(input_ids, dtype=np.int32))
            self._put("loss_mask", 0, np.asarray(loss_mask, dtype=np.uint8))
            self._put("num_loss_tokens", 0, (cs[self._offsets[1:]] - cs[self._offsets[:-1]]).astype(np.int32))
            self.commit(0)

    def _put(self, name: str, row: int, values: np.ndarray) -> None:
        """`pwrite` rows of tensor `name` starting at `row` (no mapping: the writer's memory stays flat)."""
        values = np.ascontiguousarray(values)
        row_bytes = values.nbytes // len(values) if len(values) else 0
        data = memoryview(values).cast("B")
        pos = self._pos[name] + row * row_bytes
        while len(data):
            n = os.pwrite(self._fd, data, pos)
            data, pos = data[n:], pos + n

    def _resume_point(self, header: bytes, size: int) -> int:
        try:
            prog = json.loads(self.progress.read_text())
            if prog.get("header_sha256") != self._header_sha or self.partial.stat().st_size != size:
                return 0
            with open(self.partial, "rb") as fh:
                if fh.read(len(header)) != header:
                    return 0
            return int(prog["records_done"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def record_tokens(self, r: int) -> np.ndarray:
        """Input ids int32 [T] of record `r` (a view into the file)."""
        return self._ids[self._offsets[r] : self._offsets[r + 1]]

    def write(self, r: int, features, last_hidden=None) -> None:
        """Store record `r`: `features` [T, K*H] and (when the layout has it) `last_hidden` [T, H],
        torch float tensors on any device. Raises FeatureShardError on a shape mismatch (names the record)."""
        a, b = int(self._offsets[r]), int(self._offsets[r + 1])
        kh = self.layout.num_layers * self.layout.hidden_size
        if tuple(features.shape) != (b - a, kh):
            raise FeatureShardError(
                f"{self.path}: record {r}: features {tuple(features.shape)}, expected {(b - a, kh)}"
            )
        if b == a:
            return
        vals, scale = _to_storage(features, self.layout.dtype, groups=self.layout.num_layers)
        self._put("features", a, vals)
        if scale is not None:
            self._put("feature_scale", a, scale)
        if self.layout.last_hidden:
            if last_hidden is None or tuple(last_hidden.shape) != (b - a, self.layout.hidden_size):
                got = None if last_hidden is None else tuple(last_hidden.shape)
                raise FeatureShardError(
                    f"{self.path}: record {r}: last_hidden {got}, expected {(b - a, self.layout.hidden_size)}"
                )
            vals, scale = _to_storage(last_hidden, self.layout.dtype)
            self._put("last_hidden", a, vals)
            if scale is not None:
                self._put("last_hidden_scale", a, scale)

    def commit(self, records_done: int) -> None:
        """Make records `[0, records_done)` durable: fsync the file, then record the count atomically."""
        from dflash_pipeline.core.shards import atomic_write_bytes

        os.fsync(self._fd)
        atomic_write_bytes(
            self.progress,
            json.dumps({"records_done": records_done, "header_sha256": self._header_sha}).encode(),
            skip_if_identical=False,
        )
        self.next_record = records_done

    def finish(self) -> Path:
        """Check every record was written, fsync, rename the file into place, drop the progress file."""
        if self.next_record != self.layout.num_records:
            raise FeatureShardError(
                f"{self.path}: finish() after {self.next_record} of {self.layout.num_records} records"
            )
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        os.replace(self.partial, self.path)
        self.progress.unlink(missing_ok=True)
        return self.path

    def close(self) -> None:
        """Close the file (the partial file and its progress stay for a resume)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


_DROP_MARGIN = 256 * 1024


class FeatureShard:
    """Read-only, memory-mapped view of a feature shard (or of a token index with no `features`).

    Pages are mapped, never read up front; `record` copies one record out and tells the kernel to drop
    the mapped pages it touched (`MADV_DONTNEED`), so a reader's resident memory stays flat however many
    records it goes through (the page cache, not the process, keeps them).

    Raises:
        FeatureShardError: not a feature shard, or a `schema_version` this code does not read.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fh = open(self.path, "rb")
        self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
        hdr, self._base = _parse_header(self._mm, self.path)
        meta = json.loads((hdr.get("__metadata__") or {}).get("dflash", "{}"))
        if meta.get("schema_version") not in READABLE_SCHEMA_VERSIONS:
            raise FeatureShardError(
                f"{self.path}: schema_version {meta.get('schema_version')!r}, this code reads "
                f"{list(READABLE_SCHEMA_VERSIONS)}; rebuild it (snakemake reruns extract_features)"
            )
        self.metadata = meta
        self._header = hdr
        self.dtype = _storage_dtype(self.path, hdr, meta)
        self.arrays = _views(self._mm, hdr, self._base)
        self.offsets = np.array(self.arrays["offsets"])  # small: R+1 int64, copied
        self.num_loss_tokens = np.array(self.arrays["num_loss_tokens"])
        self._page = mmap.PAGESIZE

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def has_features(self) -> bool:
        return "features" in self.arrays

    def _drop(self, name: str, a: int, b: int) -> None:
        arr = self.arrays[name]
        row = arr.strides[0]
        start = self._base + self._header[name]["data_offsets"][0] + a * row
        end = self._base + self._header[name]["data_offsets"][0] + b * row
        # the kernel maps pages around a fault too ("fault-around", 64 KiB by default), so drop a margin
        # on both sides: pages of neighbouring records are simply faulted in again from the page cache
        start = max(0, start - _DROP_MARGIN)
        start -= start % self._page
        end = min(len(self._mm), end + _DROP_MARGIN)
        if end > start:
            try:
                self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)
            except (AttributeError, OSError, ValueError):  # not on every platform; only RSS is at stake
                pass

    def _dense(self, name: str, scale_name: str, a: int, b: int):
        import torch

        raw = torch.from_numpy(np.array(self.arrays[name][a:b]))
        self._drop(name, a, b)
        if self.dtype == "bfloat16":
            return raw.view(torch.bfloat16)
        scale = torch.from_numpy(np.array(self.arrays[scale_name][a:b]))  # [T] or [T, K] (per layer)
        x = raw.view(torch.float8_e4m3fn).float()
        t, d = x.shape
        groups = scale.shape[1] if scale.dim() == 2 else 1
        return (x.view(t, groups, d // groups) * scale.view(t, groups, 1)).view(t, d).to(torch.bfloat16)

    def tokens(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """`(input_ids int32 [T], loss_mask uint8 [T])` of record `r` (copies)."""
        a, b = int(self.offsets[r]), int(self.offsets[r + 1])
        ids, mask = np.array(self.arrays["input_ids"][a:b]), np.array(self.arrays["loss_mask"][a:b])
        self._drop("input_ids", a, b)
        self._drop("loss_mask", a, b)
        return ids, mask

    def features(self, r: int):
        """Features of record `r`: torch bfloat16 [T, K*H] (fp8 shards dequantized with their scales)."""
        a, b = int(self.offsets[r]), int(self.offsets[r + 1])
        return self._dense("features", "feature_scale", a, b)

    def last_hidden(self, r: int):
        """Last-layer (pre-norm) hidden state of record `r`: torch bfloat16 [T, H]; None when not stored."""
        if "last_hidden" not in self.arrays:
            return None
        a, b = int(self.offsets[r]), int(self.offsets[r + 1])
        return self._dense("last_hidden", "last_hidden_scale", a, b)

    def check_tokens(self, token_shard: str | os.PathLike, *, hash_check: bool = True) -> None:
        """Check this shard against its token shard: same record count, same per-record lengths, and (`hash_check`) the
        token shard's sha256 recorded at extraction.

        Raises:
            FeatureShardError: naming both files and the first mismatching field / record.
        """
        import pyarrow.parquet as pq

        n = pq.read_table(token_shard, columns=["num_tokens"]).column("num_tokens").to_numpy()
        if len(n) != len(self):
            raise FeatureShardError(
                f"{self.path}: {len(self)} records, token shard {token_shard} has {len(n)}; rebuild the feature shard"
            )
        lengths = np.diff(self.offsets)
        bad = np.nonzero(lengths != n)[0]
        if len(bad):
            r = int(bad[0])
            raise FeatureShardError(
                f"{self.path}: record {r} has {int(lengths[r])} tokens, token shard {token_shard} "
                f"num_tokens {int(n[r])}; rebuild the feature shard"
            )
        if hash_check and self.metadata.get("token_shard_sha256") not in (None, sha256_file(token_shard)):
            raise FeatureShardError(
                f"{self.path}: token_shard_sha256 differs from {token_shard}'s bytes (the token "
                "shard was rebuilt after extraction); rebuild the feature shard"
            )

    def close(self) -> None:
        self.arrays.clear()
        self._mm.close()
        self._fh.close()

    def __getstate__(self):  # DataLoader workers reopen the mapping instead of pickling it
        return {"path": str(self.path)}

    def __setstate__(self, state):
        self.__init__(state["path"])
