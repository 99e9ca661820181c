"""Drafter sizing: the decisions the probe records under `drafter` (DESIGN.md §2): the block size and
drafter depth checked, the target layers the drafter reads (`target_layer_ids`, reference/dflash.md
§3.1) and the mask token id (§4.7).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from dflash_pipeline.core.errors import ConfigError, ProbeError
from dflash_pipeline.drafter.block_size import check_block_size
from dflash_pipeline.target.layer_ids import build_target_layer_ids, hf_hidden_state_index, validate_target_layer_ids


def _check_drafter_sizes(block_size: int, num_draft_layers: int) -> None:
    """Raise ConfigError (naming the `drafter.*` key) for `block_size < 2`
    (`check_block_size`) or `num_draft_layers < 1`."""
    check_block_size(block_size, key="drafter.block_size")
    if num_draft_layers < 1:
        raise ConfigError(f"drafter.num_draft_layers must be >= 1, got {num_draft_layers}")


def target_feature_count(drafter_cfg: Mapping[str, Any]) -> int:
    """K, the number of target layers the drafter fuses, as the probe chooses it from the validated `drafter` config
    section: the length of `target_layer_ids` when given, else `num_target_features`, else `num_draft_layers`
    (reference/dflash.md §3.1)."""
    if drafter_cfg["target_layer_ids"]:
        return len(drafter_cfg["target_layer_ids"])
    k = drafter_cfg["num_target_features"]
    return int(k if k is not None else drafter_cfg["num_draft_layers"])


def _choose_target_layer_ids(
    n_layers: int, *, num_draft_layers: int, num_target_features: int | None, target_layer_ids: Sequence[int] | None
) -> tuple[list[int], str]:
    """`(target_layer_ids, source)`: the explicit ids (validated) or the reference formula for
    K = `num_target_features` (default `num_draft_layers`) of `n_layers` (reference/dflash.md §3.1).

    Raises:
        ConfigError: ids out of range, repeated or unordered, K that does
            not match the explicit ids, or a K the formula cannot place.
    """
    k = num_target_features if num_target_features is not None else num_draft_layers
    if target_layer_ids is None:
        return build_target_layer_ids(n_layers, k), f"reference formula (N={n_layers}, K={k}), reference/dflash.md §3.1"
    ids = validate_target_layer_ids(target_layer_ids, n_layers)
    if num_target_features is not None and num_target_features != len(ids):
        raise ConfigError(
            f"drafter.num_target_features={num_target_features} but drafter.target_layer_ids has {len(ids)} ids"
        )
    return ids, "explicit (drafter.target_layer_ids)"


def resolve_mask_token_id(
    *, explicit: int | None, tokenizer: Mapping[str, Any], embedding_rows: int
) -> tuple[int, str]:
    """Choose the drafter's mask token id (reference/dflash.md §4.7, pitfall §4.8.6).

    Order: `explicit` (`drafter.mask_token_id`) → the tokenizer's mask token → the first embedding
    row past the real tokens (`len(tokenizer)`, when `embedding_rows > len(tokenizer)`) → error.
    The id always indexes an existing row of the target embedding (`0 <= id < embedding_rows`).

    Returns `(mask_token_id, explanation)`.

    Raises:
        ConfigError: an explicit id outside the embedding (names `drafter.mask_token_id`).
        ProbeError: no tokenizer to decide from, or no free row and no mask token (names the key to set).
    """
    if explicit is not None:
        if not 0 <= explicit < embedding_rows:
            raise ConfigError(
                f"drafter.mask_token_id={explicit} is outside the target embedding (rows 0..{embedding_rows - 1})"
            )
        return explicit, "explicit (drafter.mask_token_id)"
    if not tokenizer.get("present"):
        raise ProbeError(
            f"cannot choose mask_token_id: {tokenizer.get('missing_reason')}; add the tokenizer files to the "
            "target directory or set `drafter.mask_token_id`"
        )
    mid = tokenizer.get("mask_token_id")
    if mid is not None and 0 <= mid < embedding_rows:
        return int(mid), f"tokenizer mask token {tokenizer.get('mask_token')!r}"
    n = int(tokenizer["len"])
    if embedding_rows > n:
        return n, (
            f"first embedding row past the real tokens: len(tokenizer)={n} < {embedding_rows} rows "
            "(an untrained padding row of the frozen embedding)"
        )
    raise ProbeError(
        f"cannot choose mask_token_id: the tokenizer has no mask token and all {embedding_rows} embedding rows "
        f"are real tokens (len(tokenizer)={n}); set `drafter.mask_token_id` to an unused token id "
        f"(e.g. a reserved special token) in 0..{embedding_rows - 1}"
    )


def _choose_mask_token_id(
    explicit: int | None, tokenizer: Mapping[str, Any], embedding_rows: int
) -> tuple[int | None, str]:
    """`resolve_mask_token_id` when there is a tokenizer or an explicit id; else `(None, reason)`
    (a lenient probe of a directory without tokenizer files)."""
    if tokenizer.get("present") or explicit is not None:
        return resolve_mask_token_id(explicit=explicit, tokenizer=tokenizer, embedding_rows=embedding_rows)
    return None, f"unresolved: {tokenizer['missing_reason']}; set `drafter.mask_token_id` or add the tokenizer"


def _drafter_record(
    block_size: int, num_draft_layers: int, ids: list[int], ids_src: str, mask_token_id: int | None, mask_token_src: str
) -> dict:
    """The record's `drafter` section, with the HF `hidden_states` index of each target layer."""
    return {
        "block_size": int(block_size),
        "num_draft_layers": int(num_draft_layers),
        "num_target_features": len(ids),
        "target_layer_ids": ids,
        "target_layer_ids_source": ids_src,
        "hf_hidden_state_indices": [hf_hidden_state_index(i) for i in ids],
        "mask_token_id": mask_token_id,
        "mask_token_source": mask_token_src,
    }
