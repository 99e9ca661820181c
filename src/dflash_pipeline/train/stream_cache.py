"""`features.stream.cache: first_epoch`: what epoch 0 streamed, kept in feature shards for later epochs.

The first epoch this job runs writes each streamed record's features into feature shards
(`FeatureShardWriter`: a killed job leaves only whole shards) under `features.stream.cache_dir`, up to
`cache_max_bytes`; later epochs read cached records and stream only the rest. Records are keyed by the
BLAKE2b of their int32 ids (a hit is checked against the stored ids) and are the streamed ones bit for
bit (bf16, also for an fp8 stream). Records are buffered up to `FLUSH_BYTES` (counted in the budget);
shards of another layer set or hidden size are ignored.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np

from dflash_pipeline.features import FeatureLayout, Features, FeatureShard, FeatureShardWriter, bytes_per_token

#: Bytes of buffered records written as one cache shard (the extra memory the cache holds at most).
FLUSH_BYTES = 64 * 2**20
#: Bytes reserved for each shard's header (tensor table + metadata, about 1 KiB) in the budget, and per
#: record for its offset (8 B) and loss-token count (4 B): the budget bounds the files' sizes, not an estimate.
HEADER_RESERVE, RECORD_OVERHEAD = 4096, 12


def record_key(ids) -> bytes:
    """The cache key of a record: BLAKE2b-128 of its token ids as int32 bytes."""
    return hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.int32).tobytes(), digest_size=16).digest()


class FeatureCache:
    """The first epoch's features on disk (module docstring).

    `num_layers` (K), `hidden_size` (H), `last_hidden` describe the records (`features` [T, K*H],
    `last_hidden` [T, H] bf16); `max_bytes` (None = no cap) bounds the shards' bytes on disk.
    Counters: `hits` (records read from the cache), `bytes` (on disk), `records` (cached).
    """

    def __init__(
        self,
        cache_dir: str | Path,
        *,
        num_layers: int,
        hidden_size: int,
        last_hidden: bool,
        max_bytes: int | None,
        target_layer_ids: list,
        flush_bytes: int = FLUSH_BYTES,
    ):
        self.dir = Path(cache_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.k, self.h, self.last_hidden = int(num_layers), int(hidden_size), bool(last_hidden)
        self.max_bytes = max_bytes
        self.flush_bytes = int(flush_bytes)
        self.bpt = bytes_per_token(self.k, self.h, "bfloat16", self.last_hidden)
        self.meta = {
            "kind": "stream_cache",
            "target_layer_ids": list(target_layer_ids),
            "hidden_size": self.h,
            "dtype": "bfloat16",
            "last_hidden": self.last_hidden,
        }
        self._shards: list[FeatureShard] = []
        self._index: dict[bytes, tuple[int, int]] = {}
        self._pending: dict[bytes, tuple[np.ndarray, Features]] = {}
        self._pending_bytes = 0
        self.bytes = 0
        self.hits = 0
        self.full = False
        for p in sorted(self.dir.glob("cache-*.safetensors")):
            self._open(p)

    def _open(self, path: Path) -> None:
        shard = FeatureShard(path)
        meta = shard.metadata
        if any(meta.get(k) != v for k, v in self.meta.items()):
            shard.close()
            print(f"[stream] cache: {path} is of another configuration ({meta}); not read", flush=True)
            return
        s = len(self._shards)
        self._shards.append(shard)
        ids = np.asarray(shard.arrays["input_ids"])
        for r in range(len(shard)):
            self._index.setdefault(record_key(ids[shard.offsets[r] : shard.offsets[r + 1]]), (s, r))
        self.bytes += path.stat().st_size

    @property
    def records(self) -> int:
        return len(self._index)

    def get(self, ids) -> Features | None:
        """The cached features of the record with token ids `ids` [T], or None."""
        key = record_key(ids)
        if key in self._pending:
            self.hits += 1
            return self._pending[key][1]
        at = self._index.get(key)
        if at is None:
            return None
        shard, r = self._shards[at[0]], at[1]
        if not np.array_equal(shard.tokens(r)[0], np.asarray(ids, dtype=np.int32)):
            return None  # a hash collision: stream it
        self.hits += 1
        return Features(shard.features(r), shard.last_hidden(r) if self.last_hidden else None, 0, 0)

    def put(self, ids, got: Features) -> None:
        """Keep a streamed record (until the budget is reached; a record already kept is skipped)."""
        key = record_key(ids)
        if self.full or key in self._index or key in self._pending:
            return
        need = len(ids) * self.bpt + RECORD_OVERHEAD + (0 if self._pending else HEADER_RESERVE)
        if self.max_bytes is not None and self.bytes + self._pending_bytes + need > self.max_bytes:
            self.full = True  # first epoch order: the records that fit are the first streamed
            return
        self._pending[key] = (np.asarray(ids, dtype=np.int32).copy(), got)
        self._pending_bytes += need
        if self._pending_bytes >= self.flush_bytes:
            self.flush()

    def flush(self) -> None:
        """Write the buffered records as one cache shard (atomic) and index it."""
        if not self._pending:
            return
        recs = list(self._pending.values())
        lengths = np.array([len(i) for i, _ in recs], dtype=np.int64)
        path = self.dir / f"cache-{len(self._shards):05d}.safetensors"
        layout = FeatureLayout(
            lengths,
            self.k,
            self.h,
            "bfloat16",
            self.last_hidden,
            {**self.meta, "schema_version": _schema_version(), "num_records": len(recs)},
        )
        flat = np.concatenate([i for i, _ in recs])
        w = FeatureShardWriter(path, layout, flat, np.zeros(len(flat), dtype=np.uint8))
        try:
            for r, (_, got) in enumerate(recs):
                w.write(r, got.features, got.last_hidden)
            w.commit(len(recs))
            w.finish()
        finally:
            w.close()
        self._pending.clear()
        self._pending_bytes = 0
        self._open(path)
        if self.max_bytes is not None and self.bytes > self.max_bytes:  # header overhead: stop here
            self.full = True

    def close(self, *, delete: bool = False) -> None:
        """Close the shards; `delete`: remove the cache directory (the run is over)."""
        for s in self._shards:
            s.close()
        self._shards, self._index = [], {}
        if delete:
            shutil.rmtree(self.dir, ignore_errors=True)
            try:  # the cache_dir itself once the last rank's directory is gone
                self.dir.parent.rmdir()
            except OSError:
                pass

    def stats(self) -> dict:
        return {"cache_hits": self.hits, "cache_records": self.records, "cache_bytes": self.bytes}


def _schema_version() -> int:
    from dflash_pipeline.core.contracts import FEATURE_SCHEMA_VERSION

    return FEATURE_SCHEMA_VERSION
