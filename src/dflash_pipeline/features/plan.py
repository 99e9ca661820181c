"""Disk before compute: what the feature shards of a run will take, stated and checked at plan time
(`rules/features.smk`; imports no torch). Bytes per token: `format.bytes_per_token` (Kimi K2.6 bf16:
5 × 7168 × 2 B ≈ 72 KB). Tokens: exact for tokenized shards, their mean times the prompt count for the
rest, or `tokens.max_length` per prompt before any token shard exists.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .format import bytes_per_token


@dataclass
class FeaturePlan:
    """Feature-disk arithmetic of a run (see `plan_features`)."""

    num_layers: int
    hidden_size: int
    dtype: str
    last_hidden: bool
    bytes_per_token: int
    tokens: Optional[int]  # best estimate of all tokens (None: unknown before the prompts checkpoint)
    tokens_kind: str  # "exact" | "estimated" | "upper bound" | "unknown"
    total_bytes: Optional[int]
    missing_bytes: Optional[int]  # of shards not extracted yet
    free_bytes: int
    fs_bytes: int

    def describe(self) -> str:
        """One line for the plan, e.g. `features: 5 x 7168 x 2 B = 71,685 B/token; 1.2e9 tokens (exact) -> 86.0 TB;
        ...`."""
        per = STORAGE_NAMES.get(self.dtype, self.dtype)
        s = (
            f"features: {self.num_layers} layers x {self.hidden_size} x {per} (+ids/mask{', +last hidden' if self.last_hidden else ''}) "
            f"= {self.bytes_per_token:,} B/token"
        )
        if self.tokens is None:
            s += "; total known after the prompts checkpoint"
        else:
            s += f"; {self.tokens:,} tokens ({self.tokens_kind}) -> {human(self.total_bytes)} in feature shards"
            s += f", {human(self.missing_bytes)} still to write"
        return s + f"; free on the results filesystem: {human(self.free_bytes)} of {human(self.fs_bytes)}"

    def shortfall(self, min_free_fraction: float) -> Optional[str]:
        """Why the results filesystem cannot take the missing shards (None when it can, or when the total is
        only an upper bound: then it only warns)."""
        if self.missing_bytes is None or self.tokens_kind in ("upper bound", "unknown"):
            return None
        need = self.missing_bytes + int(min_free_fraction * self.fs_bytes)
        if need <= self.free_bytes:
            return None
        return (
            f"the feature shards need {human(self.missing_bytes)} more (+ features.min_free_fraction "
            f"{min_free_fraction:g} of the filesystem = {human(need)}) but only {human(self.free_bytes)} is free; "
            f"free space, point results_dir elsewhere, or use features.dtype: float8_e4m3 (about half)"
        )


STORAGE_NAMES = {"bfloat16": "2 B", "float8_e4m3": "1 B + 4 B scale"}


def human(n: Optional[int]) -> str:
    """`n` bytes as a short decimal string (`71.7 kB`, `86.0 TB`)."""
    if n is None:
        return "?"
    x = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(x) < 1000 or unit == "PB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1000
    return f"{x:.1f} PB"


def _existing(path: Path) -> Optional[Path]:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def plan_features(
    *,
    num_layers: int,
    hidden_size: int,
    dtype: str,
    last_hidden: bool,
    results_dir: str | os.PathLike,
    shards: Optional[Sequence[tuple[str, str]]],
    max_length: int,
    prompt_counts: Optional[dict] = None,
) -> FeaturePlan:
    """Plan the feature disk of a run. `shards`: the `(dataset, shard)` pairs of the prompts manifest
    (None before the checkpoint); `prompt_counts`: prompts per `(dataset, shard)` when known.

    Token shards are read at `<results_dir>/tokens/<dataset>/<shard>.parquet`, feature shards at
    `<results_dir>/features/<dataset>/<shard>.safetensors`.
    """
    bpt = bytes_per_token(num_layers, hidden_size, dtype, last_hidden)
    results = Path(results_dir)
    usage = shutil.disk_usage(_existing(results.resolve()))
    if shards is None:
        return FeaturePlan(
            num_layers, hidden_size, dtype, last_hidden, bpt, None, "unknown", None, None, usage.free, usage.total
        )
    import pyarrow.parquet as pq

    exact, n_exact_rows, missing_tok, pending = 0, 0, 0, []
    for d, s in shards:
        tok = results / "tokens" / d / f"{s}.parquet"
        feat = results / "features" / d / f"{s}.safetensors"
        if tok.is_file():
            n = pq.read_table(tok, columns=["num_tokens"]).column("num_tokens").to_numpy()
            t = int(n.sum())
            exact += t
            n_exact_rows += int((prompt_counts or {}).get((d, s), len(n)))  # prompts behind these tokens
            if not feat.is_file():
                missing_tok += t
        else:
            pending.append((d, s))
    counts = prompt_counts or {}
    n_pending_prompts = sum(int(counts.get(k, 0)) for k in pending)
    if not pending:
        kind, est_pending = "exact", 0
    elif n_exact_rows:
        kind, est_pending = "estimated", int(round(n_pending_prompts * exact / n_exact_rows))
    else:
        kind, est_pending = "upper bound", n_pending_prompts * int(max_length)
    tokens = exact + est_pending
    return FeaturePlan(
        num_layers,
        hidden_size,
        dtype,
        last_hidden,
        bpt,
        tokens,
        kind,
        tokens * bpt,
        (missing_tok + est_pending) * bpt,
        usage.free,
        usage.total,
    )


def prompt_counts_from_manifest(manifest_path: str | os.PathLike) -> dict:
    """`{(dataset, shard): prompts}` from the prompts manifest (its per-shard `rows`/`count` when present)."""
    m = json.loads(Path(manifest_path).read_text(encoding="utf-8"))
    out = {}
    for name, ds in m.get("datasets", {}).items():
        for s in ds.get("shards", []):
            n = s.get("rows", s.get("count", s.get("num_prompts", s.get("prompts"))))
            if n is not None:
                out[(name, s["name"])] = int(n)
    return out


def window_bytes(
    prefetch_batches: int, batch_size: int, max_record_tokens: int, wire_bytes_per_token: int, max_inflight_bytes: int
) -> int:
    """Bytes the stream may hold at once: `prefetch_batches` full batches of the longest record at the wire
    size, capped by `max_inflight_bytes` (but never below one batch, which is always requested)."""
    one = batch_size * max_record_tokens * wire_bytes_per_token
    return max(one, min(prefetch_batches * one, int(max_inflight_bytes)))


def scratch_problem(scratch_dir: str | os.PathLike) -> Optional[str]:
    """Why `features.stream.scratch_dir` cannot hold the servers' answer files, or None: the nearest existing path of
    it is not a directory, is not writable by this user, or sits on a filesystem of no size. Touches nothing (plan
    time)."""
    p = Path(scratch_dir)
    existing = _existing(p)
    if not existing.is_dir():
        return f"{existing} is a file, not a directory" + ("" if existing == p else f" (on the way to {p})")
    if not os.access(existing, os.W_OK | os.X_OK) or shutil.disk_usage(existing).total == 0:
        return f"{existing} is not a writable directory on a disk" + ("" if existing == p else f" (to create {p} in)")
    return None
