"""Extract one feature shard from one token shard with a backend (`hf` or `vllm`), resumably.

`extract_shard` reads the shard's flat `input_ids` / `loss_mask`, hands pending records to the backend in
chunks of about `chunk_tokens` tokens, writes and commits each chunk (`FeatureShardWriter`) and renames
the finished shard into place. Canonical layer `l` is HF `hidden_states` index and vLLM aux id `l + 1`
(reference/feasibility.md §9; `probe.hf_hidden_state_index`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from dflash_pipeline.core.contracts import FEATURE_SCHEMA_VERSION

from .format import FeatureLayout, FeatureShardWriter, bytes_per_token, sha256_file

BACKENDS = ("hf", "vllm")


def read_token_arrays(token_shard: str | os.PathLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(input_ids int32 [N], loss_mask uint8 [N], lengths int64 [R])` of a token shard, flat, from the
    Arrow list buffers (never Python lists)."""
    import pyarrow.parquet as pq

    t = pq.read_table(token_shard, columns=["input_ids", "loss_mask"])
    ids = t.column("input_ids").combine_chunks()
    mask = t.column("loss_mask").combine_chunks()
    off = ids.offsets.to_numpy().astype(np.int64)
    flat_ids = ids.values.to_numpy()[off[0] : off[-1]].astype(np.int32, copy=False)
    moff = mask.offsets.to_numpy().astype(np.int64)
    flat_mask = mask.values.to_numpy()[moff[0] : moff[-1]].astype(np.uint8, copy=False)
    if not np.array_equal(np.diff(off), np.diff(moff)):
        raise ValueError(f"{token_shard}: input_ids and loss_mask lengths differ in some record")
    return flat_ids, flat_mask, np.diff(off)


def chunks(lengths: np.ndarray, start: int, chunk_tokens: int) -> Iterator[list[int]]:
    """Consecutive record indices from `start`, about `chunk_tokens` tokens per chunk (≥ 1 record)."""
    cur, n = [], 0
    for r in range(start, len(lengths)):
        cur.append(r)
        n += int(lengths[r])
        if n >= chunk_tokens:
            yield cur
            cur, n = [], 0
    if cur:
        yield cur


def _shard_meta(token_shard, lengths, layer_ids, hidden_size, dtype, last_hidden, backend, num_hidden_layers) -> dict:
    """The feature shard's metadata (`.format`): the token shard it was extracted from (name, sha256), its
    records and tokens (`lengths`: tokens per record), the layers, width, stored dtype and the backend."""
    return {
        "schema_version": FEATURE_SCHEMA_VERSION,
        "token_shard": Path(token_shard).name,
        "token_shard_sha256": sha256_file(token_shard),
        "num_records": int(len(lengths)),
        "num_tokens": int(lengths.sum()),
        "target_layer_ids": layer_ids,
        "hidden_size": int(hidden_size),
        "dtype": dtype,
        "last_hidden": bool(last_hidden),
        "backend": backend,
        "last_hidden_layer": int(num_hidden_layers) - 1 if last_hidden else None,
    }


def _engine(backend: str):
    """The extractor class of `backend` (`hf`: `.hf_backend.HFExtractor`, `vllm`:
    `.vllm_backend.VLLMExtractor`), imported only when a shard has records left to extract."""
    if backend == "hf":
        from .hf_backend import HFExtractor

        return HFExtractor
    from .vllm_backend import VLLMExtractor

    return VLLMExtractor


def _extract_records(engine, writer: FeatureShardWriter, lengths, start: int, chunk_tokens: int) -> None:
    """Run `engine` over the records from `start` in chunks of about `chunk_tokens` tokens (`chunks`),
    writing each record's features and committing after every chunk (the resume point)."""
    for recs in chunks(lengths, start, chunk_tokens):
        todo_recs = [r for r in recs if lengths[r] > 0]  # empty records have nothing to write
        for r, feats, last in engine.run(todo_recs, [writer.record_tokens(r) for r in todo_recs]):
            writer.write(r, feats, last)
        writer.commit(recs[-1] + 1)


def extract_shard(
    token_shard: str | os.PathLike,
    out: str | os.PathLike,
    *,
    target_dir: str | os.PathLike,
    target_layer_ids: Sequence[int],
    hidden_size: int,
    num_hidden_layers: int,
    backend: str = "hf",
    dtype: str = "bfloat16",
    last_hidden: bool = False,
    chunk_tokens: int = 32768,
    gpus: int = 0,
    target_dtype: str = "auto",
    trust_remote_code: bool = False,
    vllm_options: Optional[dict] = None,
    engine=None,
) -> dict:
    """Write the feature shard `out` for `token_shard` (format: `.format`). Returns stats
    `{records, tokens, resumed_from, seconds, tokens_per_s, bytes}`.

    `engine`: a running extractor to use instead of starting one of `backend` (not closed here).
    `target_dtype`: the target's compute dtype (`auto` = float32 on CPU, bfloat16 on GPU); `dtype`: the
    stored one (`bfloat16` or `float8_e4m3`). `gpus`: the job's devices (0 = CPU).

    Raises:
        ValueError: unknown backend; the engine returned other token ids than the shard's (names the record).
        OSError: ENOSPC when the filesystem cannot hold the shard (before any compute)."""
    if engine is None and backend not in BACKENDS:
        raise ValueError(f"features.backend {backend!r}: expected one of {BACKENDS}")
    t0 = time.time()
    ids, mask, lengths = read_token_arrays(token_shard)
    layer_ids = [int(x) for x in target_layer_ids]
    meta = _shard_meta(token_shard, lengths, layer_ids, hidden_size, dtype, last_hidden, backend, num_hidden_layers)
    layout = FeatureLayout(lengths, len(layer_ids), int(hidden_size), dtype, bool(last_hidden), meta)
    writer = FeatureShardWriter(out, layout, ids, mask)
    start = writer.next_record
    print(
        f"[features] {token_shard} -> {out}: {layout.num_records} records, {layout.num_tokens} tokens, "
        f"{bytes_per_token(len(layer_ids), hidden_size, dtype, last_hidden)} B/token, "
        f"{'resuming at record ' + str(start) if start else 'fresh'}",
        flush=True,
    )
    todo = int(lengths[start:].sum())
    t_compute = time.time()
    if start < layout.num_records:
        own = engine is None
        engine = engine or _engine(backend)(
            target_dir,
            layer_ids,
            num_hidden_layers=num_hidden_layers,
            last_hidden=last_hidden,
            gpus=gpus,
            target_dtype=target_dtype,
            trust_remote_code=trust_remote_code,
            max_len=int(lengths.max()) if len(lengths) else 1,
            options=vllm_options or {},
            scratch_dir=Path(out).with_name(f".{Path(out).name}.engine"),
        )
        t_compute = time.time()
        try:
            _extract_records(engine, writer, lengths, start, chunk_tokens)
        finally:
            if own:
                engine.close()
    return _finish(writer, layout, backend, start=start, todo=todo, t0=t0, t_compute=t_compute)


def _finish(writer: FeatureShardWriter, layout: FeatureLayout, backend: str, *, start, todo, t0, t_compute) -> dict:
    """Finish the shard (rename it into place) and return `extract_shard`'s stats (printed as one line):
    `todo` tokens were extracted from record `start` on, since `t_compute` (`t0`: the job's start)."""
    dt = time.time() - t_compute
    path = writer.finish()
    stats = {
        "records": layout.num_records,
        "tokens": layout.num_tokens,
        "resumed_from": start,
        "seconds": time.time() - t0,
        "extract_seconds": dt,
        "tokens_per_s": todo / dt if dt > 0 else None,
        "bytes": path.stat().st_size,
        "backend": backend,
    }
    print("[features] done " + json.dumps(stats), flush=True)
    return stats
