"""`train.target_features: stream`: the trainer's target features from running feature servers.

The record set, held-out split and batch order are those of a `shards` run on the same token shards.
`FeatureStream` sits between the loader and the step: it requests up to `features.stream.prefetch_batches`
batches ahead from the servers (`features.FeatureClient`) and hands each batch on, in
loader order, with `features` [b, S, K*H] bf16 zero-padded, as `.data.collate` builds from feature shards
(packed rows get each record's features at its segment). At most `max_inflight_bytes` of features are in
flight or in memory (one oversized batch still goes alone). The trainer never loads the target.
"""

from __future__ import annotations

import math
import shutil
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dflash_pipeline.features import FLEET_KEYS, window_bytes
from dflash_pipeline.train.data import MIN_LOSS_TOKENS


def row_spans(batch: dict) -> list[list[tuple[int, int]]]:
    """Token spans `[(start, end)]` of the records in each row of a collated batch: one span per row
    (`attention_mask`'s length), or one per segment of a packed row (`segment_ids` ≥ 0)."""
    am = batch["attention_mask"].cpu()
    if "segment_ids" not in batch:
        return [[(0, int(n))] for n in am.sum(dim=1).tolist()]
    out = []
    for seg in batch["segment_ids"].cpu().tolist():
        spans, start = [], 0
        for t in range(1, len(seg) + 1):
            if t == len(seg) or seg[t] != seg[start]:
                if seg[start] >= 0:
                    spans.append((start, t))
                start = t
        out.append(spans)
    return out


def check_scratch(scratch_dir: str | Path, need: int) -> int:
    """Free bytes of the filesystem of `scratch_dir` (created if missing); raises OSError (ENOSPC) when fewer
    than `need`, and an OSError naming `features.stream.scratch_dir` when it cannot be created."""
    import errno

    p = Path(scratch_dir)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, f"features.stream.scratch_dir {p}: cannot be created ({exc.strerror})") from exc
    free = shutil.disk_usage(p).free
    if free < need:
        raise OSError(
            errno.ENOSPC,
            f"features.stream: the scratch directory {p} has {free:,} B free, the stream "
            f"window needs {need:,} B (features.stream.prefetch_batches / max_inflight_bytes); "
            "free space, lower them, or point features.stream.scratch_dir elsewhere",
        )
    return free


@dataclass
class _Pending:
    batch: dict
    spans: list
    tokens: int
    est: int
    futures: list = field(default_factory=list)
    #: per record: (token ids [T], streamed: True when it went to a server, False when the cache had it)
    records: list = field(default_factory=list)


class FeatureStream:
    """Features for the loader's batches from a `FeatureClient` (module doc).

    `wire_bytes_per_token`: `n_aux * H * itemsize` of the servers' answers (the in-flight estimate).
    `cache`: a `train.stream_cache.FeatureCache` (`features.stream.cache:
    first_epoch`): records it holds are read from it instead of requested, streamed ones are handed to it.
    Counters since the last `window_stats`: seconds the step waited for features, tokens delivered.
    """

    def __init__(
        self,
        client,
        *,
        prefetch_batches: int,
        max_inflight_bytes: int,
        wire_bytes_per_token: int,
        num_servers: int = 1,
        cache=None,
    ):
        self.client = client
        self.cache = cache
        self.prefetch = max(1, int(prefetch_batches))
        self.max_bytes = int(max_inflight_bytes)
        self.bpt = int(wire_bytes_per_token)
        self.num_servers = num_servers
        self.inflight = 0
        self.peak_inflight = 0
        self.wait_s = 0.0
        self.tokens = 0
        self.total_wait_s = 0.0
        self.total_tokens = 0
        self._t0 = time.perf_counter()
        self._run_t0 = self._t0

    def _plan(self, batch: dict) -> _Pending:
        spans = row_spans(batch)
        tokens = sum(e - s for row in spans for s, e in row)
        return _Pending(batch, spans, tokens, tokens * self.bpt)

    def _submit(self, p: _Pending) -> None:
        import concurrent.futures

        ids = p.batch["input_ids"].cpu().numpy()
        for r, row in enumerate(p.spans):
            for s, e in row:
                rec = ids[r, s:e]
                hit = self.cache.get(rec) if self.cache is not None else None
                if hit is None:
                    p.futures.append(self.client.submit(rec))
                else:
                    p.futures.append(concurrent.futures.Future())
                    p.futures[-1].set_result(hit)
                p.records.append((rec, hit is None))
        self.inflight += p.est
        self.peak_inflight = max(self.peak_inflight, self.inflight)

    def _assemble(self, p: _Pending, results: list) -> dict:
        ids = p.batch["input_ids"]
        b, s = ids.shape
        feats = torch.zeros((b, s, results[0].features.shape[-1]), dtype=results[0].features.dtype) if results else None
        has_last = bool(results) and results[0].last_hidden is not None
        last = (
            torch.zeros((b, s, results[0].last_hidden.shape[-1]), dtype=results[0].last_hidden.dtype)
            if has_last
            else None
        )
        it = iter(results)
        for r, row in enumerate(p.spans):
            for a, e in row:
                got = next(it)
                feats[r, a:e] = got.features
                if has_last:
                    last[r, a:e] = got.last_hidden
        out = dict(p.batch)
        if feats is not None:
            out["features"] = feats.to(ids.device)
        if has_last:  # pre-norm, zero padding: what data.collate builds from feature shards
            out["target_last_hidden"] = last.to(ids.device)
        return out

    def batches(self, it: Iterator[dict], *, cache_writes: bool = True) -> Iterator[dict]:
        """The batches of `it` in order, each with its `features` (see the module docstring). Raises what
        the client raises (`features.StreamError` once every server is gone).
        `cache_writes`: hand streamed records to the cache (not for the held-out batches, fetched once)."""
        queue: deque[_Pending] = deque()
        held: _Pending | None = None
        done = False
        try:
            while True:
                while not done and len(queue) < self.prefetch:
                    if held is None:
                        try:
                            held = self._plan(next(it))
                        except StopIteration:
                            done = True
                            break
                    if queue and self.inflight + held.est > self.max_bytes:
                        break
                    self._submit(held)
                    queue.append(held)
                    held = None
                if not queue:
                    return
                p = queue.popleft()
                t0 = time.perf_counter()
                results = [f.result() for f in p.futures]
                dt = time.perf_counter() - t0
                self.wait_s += dt
                self.total_wait_s += dt
                self.inflight -= p.est
                self.tokens += p.tokens
                self.total_tokens += p.tokens
                if self.cache is not None and cache_writes:
                    for (rec, streamed), got in zip(p.records, results):
                        if streamed:
                            self.cache.put(rec, got)
                yield self._assemble(p, results)
        finally:
            for p in queue:
                for f in p.futures:
                    f.cancel()
            self.inflight = 0
            if self.cache is not None:  # the epoch's end (or an error): what is buffered becomes a shard
                self.cache.flush()

    def fill(self, batches: Sequence[dict]) -> list[dict]:
        """`batches` (e.g. the held-out ones) with their features, fetched now."""
        return list(self.batches(iter(batches), cache_writes=False))

    def window_stats(self) -> dict:
        """Supply and demand since the last call (then reset): `stream_wait_fraction` of the wall time the
        step waited for features, `trainer_tokens_per_s` consumed, `server_tokens_per_s` received (all
        servers, since the start), peak in-flight and scratch bytes."""
        now = time.perf_counter()
        wall = max(1e-9, now - self._t0)
        rec = {
            "stream_wait_fraction": self.wait_s / wall,
            "trainer_tokens_per_s": self.tokens / wall,
            "server_tokens_per_s": self.client.server_tokens_per_s(),
            "stream_inflight_peak_bytes": self.peak_inflight,
            "stream_peak_scratch_bytes": self.client.stats["peak_scratch_bytes"],
            "stream_retries": self.client.stats["retries"],
        }
        self.wait_s, self.tokens, self._t0 = 0.0, 0, now
        return rec

    def summary(self) -> dict:
        """Whole-run figures and the suggested split (servers per trainer rank) for the next run: the
        servers needed so that supply meets the trainer's demand when it never waits."""
        wall = max(1e-9, time.perf_counter() - self._run_t0)
        busy = max(1e-9, wall - self.total_wait_s)
        demand = self.total_tokens / busy  # tokens/s the trainer would consume if features were free
        supply = self.client.server_tokens_per_s()
        per_server = supply / self.num_servers if supply else None
        suggest = math.ceil(demand / per_server) if per_server else None
        return {
            "wait_fraction": self.total_wait_s / wall,
            "trainer_tokens_per_s": self.total_tokens / wall,
            "trainer_demand_tokens_per_s": demand,
            "server_tokens_per_s": supply,
            "servers": self.num_servers,
            "suggested_servers_per_rank": suggest,
            "peak_inflight_bytes": self.peak_inflight,
            "peak_scratch_bytes": self.client.stats["peak_scratch_bytes"],
            "retries": self.client.stats["retries"],
            "requests": self.client.stats["requests"],
            **(self.cache.stats() if self.cache is not None else {}),
        }

    def describe(self) -> str:
        s = self.summary()
        sup = f"{s['server_tokens_per_s']:.0f}" if s["server_tokens_per_s"] else "?"
        return (
            f"[stream] servers={s['servers']} server tokens/s {sup} trainer tokens/s {s['trainer_tokens_per_s']:.0f} "
            f"(demand {s['trainer_demand_tokens_per_s']:.0f}) waiting {100 * s['wait_fraction']:.1f}% of the time; "
            f"suggested servers per trainer rank: {s['suggested_servers_per_rank']}; peak in flight "
            f"{s['peak_inflight_bytes']:,} B, peak scratch {s['peak_scratch_bytes']:,} B, retries {s['retries']}"
            + (
                f"; cache {s['cache_records']} records, {s['cache_bytes']:,} B, {s['cache_hits']} hits"
                if self.cache is not None
                else ""
            )
        )

    def close(self, *, finished: bool = False) -> None:
        """Close the client (and the cache; `finished`: the run is over, the cache is deleted)."""
        self.client.close()
        if self.cache is not None:
            self.cache.close(delete=finished)


def stream_settings(stream: dict) -> dict:
    """`stream` (the job's stream settings: `features.stream` plus `dtype`, `last_hidden` and the `fleet` knobs) with
    every key it lacks from the config schema's defaults."""
    from dflash_pipeline.core.config import load_schema

    props = load_schema()["properties"]
    feats = props["features"]["properties"]
    out = {k: v["default"] for k, v in feats["stream"]["properties"].items() if "default" in v}
    out.update(dtype=feats["dtype"]["default"], last_hidden=feats["last_hidden"]["default"])
    gen = props["generation"]["properties"]
    fleet = {k: gen[k]["default"] for k in FLEET_KEYS}
    out = {**out, **stream}
    out["fleet"] = {**fleet, **(stream.get("fleet") or {})}
    ep_defaults = {
        k: v["default"]
        for k, v in feats["stream"]["properties"]["endpoints"]["items"]["properties"].items()
        if "default" in v
    }
    out["endpoints"] = [{**ep_defaults, **e} for e in out.get("endpoints") or []]
    return out


def _cache(st: dict, out_dir, probe: dict, k: int, h: int, last: bool):
    """The `FeatureCache` of `features.stream.cache: first_epoch`, else None."""
    if st["cache"] == "none":
        return None
    import os

    from dflash_pipeline.train.stream_cache import FeatureCache

    base = Path(st.get("cache_dir") or Path(out_dir) / "stream_cache")
    cache = FeatureCache(
        base / f"rank{int(os.environ.get('RANK', '0'))}",  # each rank caches the records of its own batches
        num_layers=k,
        hidden_size=h,
        last_hidden=last,
        max_bytes=st.get("cache_max_bytes"),
        target_layer_ids=probe["drafter"]["target_layer_ids"],
    )
    cap = f"{cache.max_bytes:,} B" if cache.max_bytes is not None else "no cap"
    print(f"[stream] cache first_epoch in {cache.dir} ({cap}; {cache.records} records already cached)", flush=True)
    return cache


def _stream_endpoints(st: dict) -> list[dict]:
    """The feature servers of `open_stream_data`: `st["endpoints"]` (`stream_settings`), else those the
    colocated launcher put in `$DFLASH_STREAM_ENDPOINTS` (JSON), each with the schema's endpoint defaults.

    Raises:
        StreamError: neither names a server.
    """
    import json
    import os

    from dflash_pipeline.features import ENDPOINTS_ENV, StreamError

    endpoints = (
        st["endpoints"]
        or stream_settings({"endpoints": json.loads(os.environ.get(ENDPOINTS_ENV) or "[]")})["endpoints"]
    )
    if not endpoints:
        raise StreamError(
            "train.target_features: stream has no feature server: set features.stream.endpoints, or "
            f"run the trainer under the colocated launcher (${ENDPOINTS_ENV})"
        )
    return endpoints


def open_stream_data(
    cfg: dict,
    token_shards: Sequence[str | Path],
    stream: dict,
    *,
    target_dir,
    out_dir,
    probe: dict,
    device,
    target_dtype: str = "auto",
    is_main: bool = True,
    barrier=lambda: None,
    min_loss_tokens: int = MIN_LOSS_TOKENS,
):
    """`train.data.TrainingData` for `train.target_features: stream`: the token
    records (token indexes, as online), the frozen embedding / LM head (as `shards`) and a started
    `FeatureStream` (every server probed; the model they serve settled).

    Endpoints: `stream["endpoints"]`, else `$DFLASH_STREAM_ENDPOINTS` (set by the colocated launcher,
    `features.colocate`). The scratch directory (`scratch_dir`, where path-transport
    servers write) must hold the window (`window_bytes`).

    Raises:
        StreamError: no endpoint, or the breaker opened while probing. OSError (ENOSPC): scratch too small.
    """
    from dflash_pipeline.features import FeatureClient, fleet_config
    from dflash_pipeline.target.layer_ids import aux_hidden_state_ids
    from dflash_pipeline.train.data import TrainingData, collate, final_norm, frozen_head, needs_teacher, token_records

    st = stream_settings(stream)
    ds = token_records(token_shards, out_dir, is_main=is_main, barrier=barrier, min_loss_tokens=min_loss_tokens)
    endpoints = _stream_endpoints(st)
    teacher = needs_teacher(cfg)  # kl: the servers send the last layer too (aux id num_hidden_layers)
    k, h = len(probe["drafter"]["target_layer_ids"]), int(probe["hidden_size"])
    last = bool(st["last_hidden"]) or teacher
    wire = (k + int(last)) * h * int(st["wire_bytes_per_value"])
    longest = max((int(np.diff(s.offsets).max()) for s in ds._open() if len(s)), default=1)
    longest = max(longest, int(cfg.get("pack_max_tokens") or 0) if cfg.get("packing") else 0)
    window = window_bytes(st["prefetch_batches"], int(cfg["batch_size"]), longest, wire, st["max_inflight_bytes"])
    free = None
    if st.get("scratch_dir") and any(e["transport"] == "path" for e in endpoints):
        free = check_scratch(st["scratch_dir"], window)
    client = FeatureClient(
        endpoints,
        fleet_config(st["fleet"], None),
        num_layers=k,
        hidden_size=h,
        last_hidden=last,
        dtype=st["dtype"],
        aux_layer_ids=aux_hidden_state_ids(probe["drafter"]["target_layer_ids"], probe["num_hidden_layers"], last),
        scratch_dir=st.get("scratch_dir"),
    )
    model = client.start()
    print(
        f"[stream] {len(endpoints)} feature server(s) serving {model!r}; window {window:,} B "
        f"({st['prefetch_batches']} batches x {cfg['batch_size']} x {longest} tokens x {wire:,} B, cap "
        f"{st['max_inflight_bytes']:,} B)" + (f"; scratch free {free:,} B" if free is not None else ""),
        flush=True,
    )
    fs = FeatureStream(
        client,
        prefetch_batches=st["prefetch_batches"],
        max_inflight_bytes=st["max_inflight_bytes"],
        wire_bytes_per_token=wire,
        num_servers=len(endpoints),
        cache=_cache(st, out_dir, probe, k, h, last),
    )
    data = TrainingData(ds, collate, True, *frozen_head(target_dir, probe, target_dtype, device), stream=fs)
    if teacher:
        data.final_norm = final_norm(target_dir, data.target_config, target_dtype, device)
    return data
