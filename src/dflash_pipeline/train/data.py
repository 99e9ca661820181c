"""Training data for the drafter: memory-mapped token records and target features from feature shards.

`train.target_features: online`: token records come from a token index (each token shard's flat
`input_ids` / `loss_mask` + offsets in a safetensors file under `<run>/token_index/`, memory-mapped);
the trainer runs the target per batch. `shards`: ids, masks and features come from the feature shards
(checked against their token shards: count, lengths, sha256); only the target's embedding and LM head
are read. The dataset holds open mappings and a per-record index of the records with ≥
`MIN_LOSS_TOKENS` supervised tokens, so resident memory does not grow with the dataset.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from dflash_pipeline.core.config import schema_defaults
from dflash_pipeline.features import FeatureLayout, FeatureShard, FeatureShardError, FeatureShardWriter

#: Supervised (loss-mask) tokens a record needs to be trained on: an anchor is a supervised position and its
#: block's labels are the supervised tokens after it (reference/dflash.md §4.1), so a record with fewer has
#: no anchor with anything to predict.
MIN_LOSS_TOKENS = 2


def token_index_path(token_shard: str | Path, cache_dir: str | Path) -> Path:
    """Where the token index of `token_shard` lives: keyed by its path, size and mtime (a rebuilt token
    shard gets a new index)."""
    import hashlib

    st = os.stat(token_shard)
    key = hashlib.sha256(f"{Path(token_shard).resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{Path(token_shard).parent.name}-{Path(token_shard).stem}-{key}.safetensors"


def build_token_index(token_shard: str | Path, out: str | Path) -> Path:
    """Write the token index of one token shard (flat ids / mask / offsets; atomic). Returns `out`."""
    from dflash_pipeline.core.contracts import FEATURE_SCHEMA_VERSION
    from dflash_pipeline.features import read_token_arrays

    ids, mask, lengths = read_token_arrays(token_shard)
    meta = {
        "schema_version": FEATURE_SCHEMA_VERSION,
        "token_shard": Path(token_shard).name,
        "kind": "token_index",
        "num_records": int(len(lengths)),
        "num_tokens": int(lengths.sum()),
    }
    w = FeatureShardWriter(out, FeatureLayout(lengths, 0, 0, "bfloat16", False, meta), ids, mask)
    w.commit(len(lengths))
    return w.finish()


class MappedRecords(torch.utils.data.Dataset):
    """Records of several mapped shards (token indexes or feature shards), filtered by supervised tokens.

    `__getitem__` returns `(input_ids int32 [S], loss_mask uint8 [S])`, or with `features=True`
    `(input_ids, loss_mask, features bfloat16 [S, K*H])`, and with `last_hidden=True` also the last
    decoder layer's output before the final norm, bfloat16 [S, H] (`kl`'s teacher input).

    Raises:
        FeatureShardError: `features` / `last_hidden` asked of a shard without that tensor.
    """

    def __init__(
        self,
        paths: Sequence[str | Path],
        *,
        features: bool = False,
        last_hidden: bool = False,
        min_loss_tokens: int = MIN_LOSS_TOKENS,
    ):
        self.paths = [str(p) for p in paths]
        self.features = features
        self.last_hidden = last_hidden
        self._shards: Optional[list[FeatureShard]] = None
        sel_s, sel_r = [], []
        self.num_tokens = 0
        for s, shard in enumerate(self._open()):
            keep = np.nonzero(shard.num_loss_tokens >= min_loss_tokens)[0]
            sel_s.append(np.full(len(keep), s, dtype=np.int32))
            sel_r.append(keep.astype(np.int64))
            self.num_tokens += int(shard.offsets[-1])
            if features and not shard.has_features:
                raise FeatureShardError(f"{shard.path}: no features tensor")
            if last_hidden and "last_hidden" not in shard.arrays:
                raise FeatureShardError(
                    f"{shard.path}: no last_hidden tensor (train.loss: kl reads it); extract the feature shards "
                    "again with it (features.last_hidden: true, or rerun extract_features with train.loss: kl)"
                )
        self.shard_of = np.concatenate(sel_s) if sel_s else np.zeros(0, np.int32)
        self.record_of = np.concatenate(sel_r) if sel_r else np.zeros(0, np.int64)

    def _open(self) -> list[FeatureShard]:
        if self._shards is None:
            self._shards = [FeatureShard(p) for p in self.paths]
        return self._shards

    def __len__(self) -> int:
        return len(self.record_of)

    def lengths(self) -> np.ndarray:
        """int64 [len(self)]: each record's token count, from the shards' offsets (no record is read)."""
        out = np.zeros(len(self), dtype=np.int64)
        for s, shard in enumerate(self._open()):
            sel = self.shard_of == s
            out[sel] = np.diff(shard.offsets)[self.record_of[sel]]
        return out

    def __getitem__(self, i: int):
        shard = self._open()[int(self.shard_of[i])]
        r = int(self.record_of[i])
        ids, mask = shard.tokens(r)
        if not self.features:
            return ids, mask
        if self.last_hidden:
            return ids, mask, shard.features(r), shard.last_hidden(r)
        return ids, mask, shard.features(r)

    def __getstate__(self):  # DataLoader workers reopen the mappings
        d = dict(self.__dict__)
        d["_shards"] = None
        return d


def collate(batch, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad records to `input_ids` long / `loss_mask` uint8 / `attention_mask` long [b, S_max],
    plus `features` [b, S_max, K*H] (bfloat16, zero padding) when the records carry them, and
    `target_last_hidden` [b, S_max, H] (pre-norm, zero padding) when they carry a fourth tensor."""
    s = max(len(x[0]) for x in batch)
    b = len(batch)
    ids = torch.full((b, s), pad_id, dtype=torch.long)
    lm = torch.zeros((b, s), dtype=torch.uint8)
    am = torch.zeros((b, s), dtype=torch.long)
    feats = torch.zeros((b, s, batch[0][2].shape[-1]), dtype=batch[0][2].dtype) if len(batch[0]) > 2 else None
    last = torch.zeros((b, s, batch[0][3].shape[-1]), dtype=batch[0][3].dtype) if len(batch[0]) > 3 else None
    for r, rec in enumerate(batch):
        n = len(rec[0])
        ids[r, :n] = torch.from_numpy(rec[0].astype(np.int64))
        lm[r, :n] = torch.from_numpy(rec[1])
        am[r, :n] = 1
        if feats is not None:
            feats[r, :n] = rec[2]
        if last is not None:
            last[r, :n] = rec[3]
    out = {"input_ids": ids, "loss_mask": lm, "attention_mask": am}
    if feats is not None:
        out["features"] = feats
    if last is not None:
        out["target_last_hidden"] = last
    return out


@dataclass
class TrainingData:
    """What the trainer gets from `open_training_data`."""

    dataset: MappedRecords
    collate: Callable
    from_shards: bool
    #: `shards` / `stream`: the frozen embedding / LM head and the target's (text) config; None when online.
    embed: Any = None
    lm_head: Any = None
    target_config: Any = None
    #: `stream` only: the `train.stream.FeatureStream` that fills each batch's
    #: features (`from_shards` is then True too: the target is never loaded).
    stream: Any = None
    #: `shards` / `stream` with a teacher loss (`kl`): the target's final norm, which turns the
    #: carried pre-norm last hidden state into the LM head's input
    #: (`features.weights.load_final_norm`).
    final_norm: Any = None


class ConfigOnly:
    """Stands in for the target where only `.config` is read (`drafter.build.build_drafter`)."""

    def __init__(self, config):
        self.config = config


def needs_teacher(cfg: dict) -> bool:
    """Whether `train.loss` reads the target's last hidden state (`kl`, DSpark's `dspark_tv`)."""
    return {**schema_defaults("train"), **cfg}["loss"] in ("kl", "dspark_tv")


def final_norm(target_dir, config, target_dtype: str, device):
    """The target's final norm in the target dtype (`features.weights.load_final_norm`)."""
    from dflash_pipeline.features import load_final_norm
    from dflash_pipeline.target.loading import resolve_dtype

    return load_final_norm(target_dir, config, dtype=resolve_dtype(target_dtype, device), device=device)


def frozen_head(target_dir, probe: dict, target_dtype: str, device) -> tuple:
    """`(embedding, LM head, target config)` read from the target's safetensors and config, without
    instantiating the target (`features.weights`)."""
    from dflash_pipeline.features import load_embed_and_head
    from dflash_pipeline.target.loading import load_target_config, resolve_dtype

    # the target loader's config reading (kimi_k2 without remote code: its architectures' native class)
    config = load_target_config(target_dir, trust_remote_code=bool(probe.get("trust_remote_code")))
    embed, lm_head = load_embed_and_head(
        target_dir,
        tie_word_embeddings=probe.get("tie_word_embeddings"),
        dtype=resolve_dtype(target_dtype, device),
        device=device,
    )
    return embed, lm_head, config


def token_records(
    token_shards, out_dir, *, is_main: bool, barrier: Callable[[], None], min_loss_tokens: int
) -> MappedRecords:
    """The token records of `token_shards` from their token indexes under `<out_dir>/token_index/`
    (the main process writes missing ones, then `barrier()`)."""
    cache = Path(out_dir) / "token_index"
    paths = [token_index_path(t, cache) for t in token_shards]
    if is_main:
        for t, p in zip(token_shards, paths):
            if not p.is_file():
                build_token_index(t, p)
    barrier()
    return MappedRecords(paths, min_loss_tokens=min_loss_tokens)


def open_training_data(
    cfg: dict,
    token_shards: Sequence[str | Path],
    feature_shards: Sequence[str | Path],
    *,
    target_dir: str | Path,
    out_dir: str | Path,
    probe: dict,
    device,
    target_dtype: str = "auto",
    is_main: bool = True,
    barrier: Callable[[], None] = lambda: None,
    min_loss_tokens: int = MIN_LOSS_TOKENS,
) -> TrainingData:
    """The dataset, collate function and (`shards`) embedding / LM head for `cfg["target_features"]`.



    `online`: the main process writes missing token indexes under `<out_dir>/token_index/`, then
    `barrier()`. `shards`: `feature_shards[i]` belongs to `token_shards[i]` and is checked against it;
    its `target_layer_ids` and `hidden_size` must equal the probe's.

    Raises:
        FeatureShardError: feature / token shard mismatch (names both files), or other layer ids than the probe's.
        ValueError: no record with `min_loss_tokens` supervised tokens.
    """
    mode = {**schema_defaults("train"), **cfg}["target_features"]  # a partial config (tests, direct calls)
    if mode == "shards":
        if len(feature_shards) != len(token_shards):
            raise FeatureShardError(
                f"train.target_features: shards needs one feature shard per token shard; got "
                f"{len(feature_shards)} feature and {len(token_shards)} token shards"
            )
        want = list(probe["drafter"]["target_layer_ids"])
        if is_main:
            for f, t in zip(feature_shards, token_shards):
                fs = FeatureShard(f)
                if (
                    fs.metadata.get("target_layer_ids") != want
                    or fs.metadata.get("hidden_size") != probe["hidden_size"]
                ):
                    raise FeatureShardError(
                        f"{f}: target_layer_ids {fs.metadata.get('target_layer_ids')} / hidden_size {fs.metadata.get('hidden_size')}, "
                        f"the probe says {want} / {probe['hidden_size']}; rebuild the feature shards"
                    )
                fs.check_tokens(t)
                fs.close()
        barrier()
        teacher = needs_teacher(cfg)
        ds = MappedRecords(feature_shards, features=True, last_hidden=teacher, min_loss_tokens=min_loss_tokens)
        data = TrainingData(ds, collate, True, *frozen_head(target_dir, probe, target_dtype, device))
        if teacher:
            data.final_norm = final_norm(target_dir, data.target_config, target_dtype, device)
    else:
        data = TrainingData(
            token_records(token_shards, out_dir, is_main=is_main, barrier=barrier, min_loss_tokens=min_loss_tokens),
            collate,
            False,
        )
    if len(data.dataset) == 0:
        raise ValueError(f"no token record with ≥{min_loss_tokens} supervised tokens in {len(token_shards)} shard(s)")
    return data


def record_prompt_ids(token_shards: Sequence[str | Path], dataset: MappedRecords) -> list[str]:
    """`prompt_id` of every record of `dataset` (its order), for the held-out split (`train.heldout.heldout_mask`).
    Reads only the `prompt_id` column of each token shard; a shard without the column gives `<path>:<row>`."""
    import pyarrow.parquet as pq

    per_shard = []
    for p in token_shards:
        names = pq.read_schema(p).names
        per_shard.append(
            pq.read_table(p, columns=["prompt_id"]).column("prompt_id").to_pylist() if "prompt_id" in names else None
        )
    return [
        str(per_shard[s][r]) if per_shard[s] is not None else f"{token_shards[s]}:{r}"
        for s, r in zip(dataset.shard_of.tolist(), dataset.record_of.tolist())
    ]
