"""``train.target_features: stream``: the trainer's target features from running feature servers.

The token records are the online path's token indexes (:mod:`.data`), so the record set, the held-out
split and the shuffled batch order are those of a ``shards`` run on the same token shards: a function of
``train.seed`` and the epoch only. :class:`FeatureStream` sits between the loader and the step
(:func:`dflash_pipeline.train.loop.run_steps`): it pulls up to ``features.stream.prefetch_batches``
batches ahead, sends every record of them to the servers (:class:`dflash_pipeline.features.FeatureClient`,
the completions fleet underneath), and hands each batch to the step, in loader order, once all its
records are back (replies that arrive out of order wait in memory). The batch then carries ``features``
[b, S, K*H] bf16 with zero padding, exactly what :func:`.data.collate` builds from feature shards; packed
rows (:mod:`dflash_pipeline.train.packing`) get each record's features at its segment, computed by the
server for the record alone (records never see each other, so packing needs no isolation check here).

Bounded: at most ``prefetch_batches`` batches are requested ahead and at most ``max_inflight_bytes`` of
their features (estimated at the wire size, ``[T, n_aux, H]`` in the servers' dtype) are in flight or in
memory; a batch larger than the budget alone is still requested (one at a time). Scratch files are deleted
as soon as they are read. The trainer never loads the target: the embedding and LM head come from its
safetensors (:mod:`dflash_pipeline.features.weights`), as with ``shards``.
"""

from __future__ import annotations

import math
import shutil
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch


def row_spans(batch: dict) -> list[list[tuple[int, int]]]:
    """Token spans ``[(start, end)]`` of the records in each row of a collated batch: one span per row
    (``attention_mask``'s length), or one per segment of a packed row (``segment_ids`` ≥ 0)."""
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


def window_bytes(prefetch_batches: int, batch_size: int, max_record_tokens: int, wire_bytes_per_token: int,
                 max_inflight_bytes: int) -> int:
    """Bytes the stream may hold at once: ``prefetch_batches`` full batches of the longest record at the wire
    size, capped by ``max_inflight_bytes`` (but never below one batch, which is always requested)."""
    one = batch_size * max_record_tokens * wire_bytes_per_token
    return max(one, min(prefetch_batches * one, int(max_inflight_bytes)))


def check_scratch(scratch_dir: str | Path, need: int) -> int:
    """Free bytes of the filesystem of ``scratch_dir``; raises OSError (ENOSPC) when fewer than ``need``."""
    import errno

    p = Path(scratch_dir)
    p.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(p).free
    if free < need:
        raise OSError(errno.ENOSPC, f"features.stream: the scratch directory {p} has {free:,} B free, the stream "
                                    f"window needs {need:,} B (features.stream.prefetch_batches / max_inflight_bytes); "
                                    "free space, lower them, or point features.stream.scratch_dir elsewhere")
    return free


@dataclass
class _Pending:
    batch: dict
    spans: list
    tokens: int
    est: int
    futures: list = field(default_factory=list)


class FeatureStream:
    """Features for the loader's batches from a :class:`~dflash_pipeline.features.FeatureClient` (module doc).

    ``wire_bytes_per_token``: ``n_aux * H * itemsize`` of the servers' answers (the in-flight estimate).
    Counters since the last :meth:`window_stats`: seconds the step waited for features, tokens delivered.
    """

    def __init__(self, client, *, prefetch_batches: int, max_inflight_bytes: int, wire_bytes_per_token: int,
                 num_servers: int = 1):
        self.client = client
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
        ids = p.batch["input_ids"].cpu().numpy()
        p.futures = [self.client.submit(ids[r, s:e]) for r, row in enumerate(p.spans) for s, e in row]
        self.inflight += p.est
        self.peak_inflight = max(self.peak_inflight, self.inflight)

    def _assemble(self, p: _Pending, results: list) -> dict:
        ids = p.batch["input_ids"]
        b, s = ids.shape
        feats = torch.zeros((b, s, results[0].features.shape[-1]), dtype=results[0].features.dtype) if results else None
        it = iter(results)
        for r, row in enumerate(p.spans):
            for a, e in row:
                feats[r, a:e] = next(it).features
        out = dict(p.batch)
        if feats is not None:
            out["features"] = feats.to(ids.device)
        return out

    def batches(self, it: Iterator[dict]) -> Iterator[dict]:
        """The batches of ``it`` in order, each with its ``features`` (see the module docstring). Raises what
        the client raises (:class:`dflash_pipeline.features.StreamError` once every server is gone)."""
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
                yield self._assemble(p, results)
        finally:
            for p in queue:
                for f in p.futures:
                    f.cancel()
            self.inflight = 0

    def fill(self, batches: Sequence[dict]) -> list[dict]:
        """``batches`` (e.g. the held-out ones) with their features, fetched now."""
        return list(self.batches(iter(batches)))

    def window_stats(self) -> dict:
        """Supply and demand since the last call (then reset): ``stream_wait_fraction`` of the wall time the
        step waited for features, ``trainer_tokens_per_s`` consumed, ``server_tokens_per_s`` received (all
        servers, since the start), peak in-flight and scratch bytes."""
        now = time.perf_counter()
        wall = max(1e-9, now - self._t0)
        rec = {"stream_wait_fraction": self.wait_s / wall, "trainer_tokens_per_s": self.tokens / wall,
               "server_tokens_per_s": self.client.server_tokens_per_s(),
               "stream_inflight_peak_bytes": self.peak_inflight,
               "stream_peak_scratch_bytes": self.client.stats["peak_scratch_bytes"],
               "stream_retries": self.client.stats["retries"]}
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
        return {"wait_fraction": self.total_wait_s / wall, "trainer_tokens_per_s": self.total_tokens / wall,
                "trainer_demand_tokens_per_s": demand, "server_tokens_per_s": supply, "servers": self.num_servers,
                "suggested_servers_per_rank": suggest, "peak_inflight_bytes": self.peak_inflight,
                "peak_scratch_bytes": self.client.stats["peak_scratch_bytes"], "retries": self.client.stats["retries"],
                "requests": self.client.stats["requests"]}

    def describe(self) -> str:
        s = self.summary()
        sup = f"{s['server_tokens_per_s']:.0f}" if s["server_tokens_per_s"] else "?"
        return (f"[stream] servers={s['servers']} server tokens/s {sup} trainer tokens/s {s['trainer_tokens_per_s']:.0f} "
                f"(demand {s['trainer_demand_tokens_per_s']:.0f}) waiting {100 * s['wait_fraction']:.1f}% of the time; "
                f"suggested servers per trainer rank: {s['suggested_servers_per_rank']}; peak in flight "
                f"{s['peak_inflight_bytes']:,} B, peak scratch {s['peak_scratch_bytes']:,} B, retries {s['retries']}")

    def close(self) -> None:
        self.client.close()
