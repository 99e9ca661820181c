"""Feature shards through the stream client: one set of feature servers for many shards.

`extract_shards` writes every shard of a job through one `.stream_client.FeatureClient` to feature
servers that stay up for the whole job: its own (`.colocate.start_servers`) or running ones
(`stream["endpoints"]`). Each shard is written by `.extract.extract_shard`; the client hands the values
over unrounded and the writer stores them as `features.dtype` says, so a shard equals the one
`features.backend: hf` writes. CLI: `python -m dflash_pipeline.features extract-many`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from dflash_pipeline.core.errors import strip_url_credentials as redact_url


class StreamExtractor:
    """An extractor (the `.hf_backend.HFExtractor` interface) over a started FeatureClient: every
    record of a chunk is submitted at once, the results come back in record order."""

    def __init__(self, client):
        self.client = client

    def run(self, records: Sequence[int], token_ids: Sequence) -> object:
        futs = [self.client.submit(ids) for ids in token_ids]
        for r, f in zip(records, futs):
            got = f.result()
            yield r, got.features, got.last_hidden

    def close(self) -> None:  # the client belongs to extract_shards
        pass


def extract_shards(
    pairs: Sequence[tuple[str | os.PathLike, str | os.PathLike]],
    stream: dict,
    *,
    probe: dict,
    target_dir: str | os.PathLike,
    dtype: str = "bfloat16",
    last_hidden: bool = False,
    chunk_tokens: int = 32768,
    target_dtype: str = "auto",
    trust_remote_code: bool = False,
) -> list[dict]:
    """Write the feature shard of every `(token shard, out)` of `pairs` through one client; returns
    each shard's stats (`.extract.extract_shard`) with `server_requests` (records sent).

    `stream`: the stream settings (`features.stream` + `fleet`; the shape of
    `train.stream.stream_settings`). Without `endpoints` the job starts `stream["servers"]` servers once
    (with `last_hidden`
    when asked) and stops them at the end, also on error.

    Raises:
        StreamError: the servers cannot deliver (breaker open, a refused record); what extract_shard raises.
    """
    from dflash_pipeline.target.layer_ids import aux_hidden_state_ids

    from .colocate import start_servers, stop
    from .extract import extract_shard
    from .stream_client import FeatureClient, fleet_config

    procs, eps = [], list(stream.get("endpoints") or [])
    if not eps:
        procs, eps = start_servers(
            {**stream, "last_hidden": last_hidden},
            probe=probe,
            target=str(target_dir),
            target_dtype=target_dtype,
            trust_remote_code=trust_remote_code,
        )
    print(
        f"[features] extract-many: {len(pairs)} shard(s) through {len(eps)} feature server(s) "
        f"({'started once by this job' if procs else 'running'}: {', '.join(redact_url(e['base_url']) for e in eps)})",
        flush=True,
    )
    try:
        client = FeatureClient(
            eps,
            fleet_config(stream["fleet"], None),
            num_layers=len(probe["drafter"]["target_layer_ids"]),
            hidden_size=int(probe["hidden_size"]),
            last_hidden=last_hidden,
            dtype=None,
            aux_layer_ids=aux_hidden_state_ids(
                probe["drafter"]["target_layer_ids"], probe["num_hidden_layers"], last_hidden
            ),
            scratch_dir=stream.get("scratch_dir"),
        )
        client.start()
        try:
            out = []
            for tokens, path in pairs:
                before = client.stats["requests"]
                st = extract_shard(
                    tokens,
                    path,
                    target_dir=target_dir,
                    target_layer_ids=probe["drafter"]["target_layer_ids"],
                    hidden_size=probe["hidden_size"],
                    num_hidden_layers=probe["num_hidden_layers"],
                    backend="stream",
                    dtype=dtype,
                    last_hidden=last_hidden,
                    chunk_tokens=chunk_tokens,
                    engine=StreamExtractor(client),
                )
                out.append({**st, "server_requests": client.stats["requests"] - before})
            return out
        finally:
            client.close()
    finally:
        stop(procs)
