"""``train.packing`` with ``train.target_features: shards``: a packed row carries each record's own features
from its feature shard (computed by the target alone, so no isolation check is needed); the run is the
stream run with packing bit for bit and the online packed run to bf16 storage."""

from __future__ import annotations

import torch
from test_stream import FAST_FLEET, KEY_ENV, _key_env, _log, _train, server, setup  # noqa: F401 - fixtures

from dflash_pipeline.train import packing as P

PACK = {"packing": True, "pack_max_tokens": 80, "validation_fraction": 0.2, "validation_every_steps": 4}


def test_collate_packed_places_each_records_features_at_its_segment():
    recs = [
        (
            torch.arange(3).numpy(),
            torch.ones(3, dtype=torch.uint8).numpy(),
            torch.full((3, 2), 1.0),
            torch.full((3, 1), 5.0),
        ),
        (
            torch.arange(2).numpy(),
            torch.ones(2, dtype=torch.uint8).numpy(),
            torch.full((2, 2), 2.0),
            torch.full((2, 1), 6.0),
        ),
    ]
    out = P.collate_packed([recs, recs[1:]])
    assert out["features"].shape == (2, 5, 2) and out["target_last_hidden"].shape == (2, 5, 1)
    assert out["features"][0, :, 0].tolist() == [1, 1, 1, 2, 2]
    assert out["features"][1, :, 0].tolist() == [2, 2, 0, 0, 0]  # padding stays zero
    assert out["target_last_hidden"][0, :, 0].tolist() == [5, 5, 5, 6, 6]
    assert "features" not in P.collate_packed([[r[:2] for r in recs]])


def test_shards_with_packing_equal_stream_and_online(setup, server, tmp_path):  # noqa: F811
    """shards + packing == stream + packing bit for bit (same rows, same bf16 features; tolerance 0:
    losses, validation and final weights); both end where online + packing ends (fp32 vs bf16 features:
    each value within 2^-9 relative: the first and last losses within 1e-2 relative; measured 2e-5 / 4e-4)."""
    from safetensors.torch import load_file

    sh = _train(setup, tmp_path / "shards", "shards", **PACK)
    st = _train(
        setup,
        tmp_path / "stream",
        "stream",
        **PACK,
        stream={
            "endpoints": [{"base_url": server.url, "api_key_env": KEY_ENV}],
            "scratch_dir": str(server.scratch),
            "fleet": FAST_FLEET,
        },
    )
    on = _train(setup, tmp_path / "online", "online", **PACK)
    ls, lt, lo = ([r["loss"] for r in _log(tmp_path / d)] for d in ("shards", "stream", "online"))
    assert sh["steps"] == st["steps"] == on["steps"] and sh["rows"] < sh["records"], sh
    assert ls == lt
    assert (tmp_path / "shards" / "val_log.jsonl").read_text() == (tmp_path / "stream" / "val_log.jsonl").read_text()
    a, b = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("shards", "stream"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    print(
        f"[figures] relative difference to online: first {abs(ls[0] - lo[0]) / lo[0]:.2e}, last {abs(ls[-1] - lo[-1]) / lo[-1]:.2e}"
    )
    assert abs(ls[0] - lo[0]) <= 1e-2 * lo[0] and abs(ls[-1] - lo[-1]) <= 1e-2 * lo[-1], (ls, lo)
