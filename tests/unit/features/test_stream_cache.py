"""``features.stream.cache: first_epoch``: epoch 0 writes what it streamed into feature shards, epoch 1
reads them and streams only what is not cached; the run is the uncached run bit for bit. Requests are
counted by the server itself (its ``GET /health`` counter), not by the client."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
import torch
from test_features import token_shard
from test_stream import FAST_FLEET, KEY, KEY_ENV, _key_env, _log, _train, server, setup  # noqa: F401 - fixtures

from dflash_pipeline.features import FeatureShard
from dflash_pipeline.features.extract import read_token_arrays


def _served(url: str) -> int:
    req = urllib.request.Request(url.removesuffix("/v1") + "/health", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:  # the counters come with the key only
        return int(json.loads(r.read())["requests"])


def _weights(run_dir):
    from safetensors.torch import load_file

    return load_file(run_dir / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def distinct(setup):  # noqa: F811
    """The setup's target with one token shard of 30 distinct records (hits then come from epoch 0 only)."""
    root, probe, _, _ = setup
    tokens = [token_shard(root / "distinct.parquet", 30, 2)]
    ids, _, lengths = read_token_arrays(tokens[0])
    recs = [tuple(x) for x in np.split(ids, np.cumsum(lengths)[:-1])]
    assert len(set(recs)) == len(recs)
    return root, probe, tokens, ()


def test_first_epoch_cache_equals_uncached_and_epoch_two_streams_the_rest(distinct, server, tmp_path):  # noqa: F811
    """TRAIN_CFG has 2 epochs. Uncached: the server computes every held-out record once and every training
    record twice. Cached without a cap: epoch 1 sends nothing (each training record computed once, epoch
    1's records all cache hits). With a cap: the cache stays under it and epoch 1 streams exactly the
    records it could not keep. Losses and final weights equal the uncached run's in every case."""
    data = distinct
    base = {
        "endpoints": [{"base_url": server.url, "api_key_env": KEY_ENV}],
        "scratch_dir": str(server.scratch),
        "fleet": FAST_FLEET,
    }

    n0 = _served(server.url)
    plain = _train(data, tmp_path / "plain", "stream", stream=base)
    n1 = _served(server.url)
    cached = _train(data, tmp_path / "cached", "stream", stream={**base, "cache": "first_epoch"})
    n2 = _served(server.url)
    train_n, held = plain["records"], plain["heldout_records"]
    assert n1 - n0 == held + 2 * train_n
    assert n2 - n1 == held + train_n
    assert cached["stream"]["cache_hits"] == train_n and cached["stream"]["cache_records"] == train_n
    assert [r["loss"] for r in _log(tmp_path / "cached")] == [r["loss"] for r in _log(tmp_path / "plain")]
    a, b = _weights(tmp_path / "plain"), _weights(tmp_path / "cached")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "cached" / "stream_cache").exists()  # deleted once the run is over

    cap = cached["stream"]["cache_bytes"] // 2
    capped = _train(
        data,
        tmp_path / "capped",
        "stream",
        stream={**base, "cache": "first_epoch", "cache_max_bytes": cap, "cache_dir": str(tmp_path / "cache")},
    )
    n3 = _served(server.url)
    kept = capped["stream"]["cache_records"]
    assert 0 < kept < train_n and 0 < capped["stream"]["cache_bytes"] <= cap
    assert n3 - n2 == held + train_n + (train_n - kept) and capped["stream"]["cache_hits"] == kept
    assert [r["loss"] for r in _log(tmp_path / "capped")] == [r["loss"] for r in _log(tmp_path / "plain")]


def test_cache_shards_are_feature_shards_read_back_bit_for_bit(setup, server, tmp_path):  # noqa: F811
    """A cache shard is today's feature-shard format; a record read back equals what the server sent."""
    from test_stream import _client

    from dflash_pipeline.train.stream_cache import FeatureCache

    c = _client([server.url], scratch=server.scratch)
    try:
        recs = [np.arange(3, 3 + n) % 80 for n in (5, 17, 9)]
        got = c.fetch_all(recs)
    finally:
        c.close()
    cache = FeatureCache(
        tmp_path, num_layers=2, hidden_size=32, last_hidden=False, max_bytes=None, target_layer_ids=[1, 2]
    )
    for r, g in zip(recs, got):
        cache.put(r, g)
    cache.flush()
    cache.close()
    (path,) = tmp_path.glob("cache-*.safetensors")
    assert FeatureShard(path).metadata["kind"] == "stream_cache"
    again = FeatureCache(
        tmp_path, num_layers=2, hidden_size=32, last_hidden=False, max_bytes=None, target_layer_ids=[1, 2]
    )
    for r, g in zip(recs, got):
        assert torch.equal(again.get(r).features, g.features)
    assert again.get(np.arange(7)) is None and again.hits == 3
    other = FeatureCache(
        tmp_path, num_layers=2, hidden_size=32, last_hidden=False, max_bytes=None, target_layer_ids=[0, 2]
    )
    assert other.records == 0  # another layer set: not read
