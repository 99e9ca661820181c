"""Target layer ids: the canonical convention, the reference choice, validation, and the one conversion.

Canonical id `l`: the 0-based decoder layer whose *output* feeds the drafter (`dflash_config.target_layer_ids`). HF
`output_hidden_states` index = `l + 1` (`hf_hidden_state_index`, the only conversion in the package; vLLM's aux
hidden-state ids use the same numbering, `reference/feasibility.md` §9).
"""

from __future__ import annotations

from typing import Sequence

from dflash_pipeline.core.errors import ConfigError


def build_target_layer_ids(num_layers: int, k: int) -> list[int]:
    """Reference choice of `k` target layers out of `num_layers` (reference/dflash.md §3.1).

    `k == 1` → `[num_layers // 2]`; `k >= 2` → `round(1 + i * (num_layers - 4) / (k - 1))` for
    `i = 0..k-1` (Python `round`, i.e. banker's rounding), evenly spaced from layer 1 to layer
    `num_layers - 3`. Example: `(36, 5) → [1, 9, 17, 25, 33]`.

    Raises:
        ConfigError: `num_layers < 4` (the formula needs it, as SGLang), `k < 1`, or `k` so large
            that ids repeat (names `drafter.num_target_features` / `drafter.target_layer_ids`).
    """
    if k < 1:
        raise ConfigError(f"drafter.num_target_features must be >= 1, got {k}")
    if num_layers < 4:
        raise ConfigError(
            f"target has {num_layers} decoder layers; the target_layer_ids formula needs >= 4. "
            "Set `drafter.target_layer_ids` explicitly"
        )
    if k == 1:
        return [num_layers // 2]
    ids = [int(round(1 + i * (num_layers - 4) / (k - 1))) for i in range(k)]
    if len(set(ids)) != len(ids):
        raise ConfigError(
            f"{k} target features from {num_layers} layers give repeated ids {ids}; lower "
            "`drafter.num_target_features` or set `drafter.target_layer_ids` explicitly"
        )
    return ids


def hf_hidden_state_index(layer_id: int) -> int:
    """HF `output_hidden_states` index holding the output of canonical target layer `layer_id`.

    Index 0 of `outputs.hidden_states` is the embedding output, index `l + 1` the output of decoder layer `l`. This is
    the only conversion between the two conventions in the package.
    """
    if layer_id < 0:
        raise ValueError(f"layer id must be >= 0, got {layer_id}")
    return layer_id + 1


def aux_hidden_state_ids(target_layer_ids: Sequence[int], num_hidden_layers: int, last_hidden: bool) -> list[int]:
    """The HF `hidden_states` indices a feature server taps, in order: `hf_hidden_state_index` of each canonical
    target layer, then, with `last_hidden`, `num_hidden_layers` (the last decoder layer's output; the server sends it
    before the final norm). Raises ValueError on a negative layer id."""
    aux = [hf_hidden_state_index(int(i)) for i in target_layer_ids]
    return aux + [int(num_hidden_layers)] if last_hidden else aux


def validate_target_layer_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    """Check user-given canonical layer ids: integers in `[0, num_layers - 2]`, distinct, ascending.

    Why each rule: vLLM and SGLang capture the listed layers and concatenate them in *layer order*, so an
    unsorted list would feed the served drafter a permuted `fc` input (τ collapses while our own eval,
    which concatenates in list order, looks fine); the last layer `num_layers - 1` is refused because
    HF's `hidden_states[num_layers]` is taken after the final norm while the engines feed the raw layer
    output, so training and serving would see different features.

    Raises:
        ConfigError: naming `drafter.target_layer_ids`, the offending ids, the valid range and the reason.
    """
    ids = list(ids)
    last = num_layers - 1
    if not ids:
        raise ConfigError("drafter.target_layer_ids is empty; give at least one layer id or leave it null")
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i <= last]
    if bad:
        raise ConfigError(
            f"drafter.target_layer_ids {ids}: {bad} out of range; valid ids are 0..{last - 1} "
            f"(0-based decoder layers of a {num_layers}-layer target, the last one excluded)"
        )
    if last in ids:
        raise ConfigError(
            f"drafter.target_layer_ids {ids}: {last} is the last decoder layer; valid ids are 0..{last - 1}. "
            f"HF's hidden_states[{num_layers}] is after the final norm while vLLM/SGLang feed the drafter the raw "
            "layer output, so the drafter would be trained on other features than it is served with"
        )
    dups = sorted({i for i in ids if ids.count(i) > 1})
    if dups:
        raise ConfigError(f"drafter.target_layer_ids {ids}: duplicated ids {dups}; give distinct ids in 0..{last - 1}")
    if ids != sorted(ids):
        raise ConfigError(
            f"drafter.target_layer_ids {ids}: not in ascending order; use {sorted(ids)}. vLLM and SGLang "
            "concatenate the captured layers in layer order, so another order permutes the served drafter's "
            "fc input (τ collapses silently)"
        )
    return ids
