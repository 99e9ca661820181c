"""Plan-time checks of the probe: the target loads as a causal LM, the drafter can be sized from its
config, and the tokenizer has a chat template and fits the embedding. Each reads metadata only (no
weights), so a target the pipeline cannot use is refused when the workflow is planned, with the reason,
rather than at completions or training step 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from dflash_pipeline.core.errors import ConfigError, ProbeRefusal
from dflash_pipeline.probe.architecture import NO_CONTEXT_LENGTH, NOT_SERVABLE, SUBLAYERS, UNSIZABLE


def _preflight_tokenizer(
    target_dir: Path, tok: Mapping[str, Any], embedding_rows: int, *, strict: bool, warnings: list[str]
) -> None:
    """A present tokenizer has a chat template (``strict``: else an error; lenient: a warning) and its
    ``len`` fits the embedding (else a warning). A missing tokenizer is left alone.

    Raises:
        ConfigError: no chat template and no override (``strict``; names ``target.chat_template``).
    """
    if not tok.get("present"):
        return
    if not tok["chat_template"]:
        msg = f"{target_dir}: the tokenizer has no chat template; set `target.chat_template` to a .jinja file"
        if strict:
            raise ConfigError(msg)
        warnings.append(msg)
    if tok["len"] > embedding_rows:
        warnings.append(f"len(tokenizer)={tok['len']} exceeds the {embedding_rows} embedding rows")


def _probe_loader(target_dir: Path, trust_remote_code: bool, *, strict: bool, warnings: list[str]) -> dict:
    """How train/eval/completions will load the target (:func:`dflash_pipeline.target.loading.check_loadable`,
    no weights read): ``{class, config_class, error}``. A target that cannot load is refused here, at plan
    time, with the reason (strict), or recorded with a warning (CLI)."""
    from dflash_pipeline.target.loading import TargetLoadError, check_loadable

    try:
        info = check_loadable(target_dir, trust_remote_code=trust_remote_code)
        return {"class": info["class"], "config_class": info["config_class"], "error": None}
    except TargetLoadError as exc:
        if strict:
            raise
        warnings.append(f"the target cannot be loaded as a causal LM: {exc}")
        return {"class": None, "config_class": None, "error": str(exc)}


def _check_drafter_config(
    target_dir: Path,
    trust_remote_code: bool,
    block_size: int,
    num_draft_layers: int,
    ids: Sequence[int],
    mask_token_id: int | None,
) -> None:
    """Build the drafter config train will build from this target's config (no weights), so a target the
    drafter cannot be sized from fails here with the reason, not at training step 1.

    Raises:
        ProbeRefusal: naming the target and transformers' / the drafter's complaint (``reason``
            ``sublayer count``, ``drafter cannot be sized`` or ``rotary not servable``).
    """
    from dflash_pipeline.drafter.config import DFlashConfig
    from dflash_pipeline.drafter.rope import DFlashRotaryEmbedding, servable_rope_problems
    from dflash_pipeline.target.loading import load_target_config, text_config

    tc = text_config(load_target_config(target_dir, trust_remote_code=trust_remote_code))
    depth = getattr(tc, "num_layers", None)
    if isinstance(depth, int) and depth != tc.num_hidden_layers:  # LongCat-Flash: two attention sublayers a layer
        raise ProbeRefusal(
            SUBLAYERS,
            f"{target_dir}: config num_hidden_layers {tc.num_hidden_layers} counts sublayers of "
            f"{depth} decoder layers (num_layers; {tc.model_type}'s double-attention layers); the target "
            "returns one hidden state per decoder layer, so canonical target_layer_ids cannot be "
            "placed: not supported",
        )
    from dflash_pipeline.drafter.config import target_context_length

    try:
        target_context_length(tc)
    except ValueError as exc:
        raise ProbeRefusal(
            NO_CONTEXT_LENGTH, f"{target_dir}: {NO_CONTEXT_LENGTH} ({tc.model_type!r}): {exc}; not supported"
        ) from None
    try:
        cfg = DFlashConfig.from_target(
            tc,
            block_size=block_size,
            num_draft_layers=num_draft_layers,
            target_layer_ids=list(ids),
            mask_token_id=mask_token_id if mask_token_id is not None else 0,
        )
        problems = servable_rope_problems(cfg.rope_parameters, int(cfg.head_dim))
        if not problems:
            DFlashRotaryEmbedding(cfg)  # the rotary training builds (rope init formulas)
    except Exception as exc:  # noqa: BLE001 - any failure here would otherwise surface at training step 1
        raise ProbeRefusal(
            UNSIZABLE,
            f"{target_dir}: the drafter cannot be sized from this target's config: "
            f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
        ) from exc
    if problems:  # what vLLM's DFlash drafter would refuse or serve differently (dflash_pipeline.drafter.rope)
        raise ProbeRefusal(
            NOT_SERVABLE,
            f"{target_dir}: vLLM cannot serve the drafter this target gets: {'; '.join(problems)}; "
            f"rope_parameters {cfg.rope_parameters}",
        )
