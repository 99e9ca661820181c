"""Config probe: what the drafter needs to know about a target, read from its metadata only.

`probe_target` reads `config.json` (cross-checked with `AutoConfig` when it loads), the tokenizer and
`generation_config.json`, never weights (only the safetensors header that states the embedding's shape).
The result is the probe record of DESIGN.md §2 (`results/probe/<run>.json`), validated against
`schemas/probe.schema.json`.

Canonical layer ids are 0-based indices of the decoder layer whose *output* feeds the drafter; the HF
`output_hidden_states` index of layer `l` is `l + 1` (`hf_hidden_state_index`, the one place that converts).

Modules, in the order `probe_target` runs them: `.config`, `.tokenizer`, `.drafter` (sizing), `.checks`
(plan-time refusals), `.record` (schema, validation, atomic write).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Sequence

from dflash_pipeline.core.contracts import PROBE_SCHEMA_VERSION
from dflash_pipeline.core.errors import ConfigError, ProbeError
from dflash_pipeline.core.shards import write_json  # noqa: F401  (re-exported)
from dflash_pipeline.target.chat import TOKENIZER_FILES, _tokenizer_auto_map, tokenizer_files_missing  # noqa: F401  (re-exported)
from dflash_pipeline.target.layer_ids import build_target_layer_ids, hf_hidden_state_index, validate_target_layer_ids  # noqa: F401

from .checks import _check_drafter_config, _preflight_tokenizer, _probe_loader

# the helpers below are re-exported under the names the single-module probe had
from .config import (  # noqa: F401
    _ALIASES,
    _NON_TEXT_HINTS,
    EXPERT_COUNT_KEYS,
    EXPERTS_PER_TOKEN_KEYS,
    TEXT_CONFIG_KEYS,
    _attention_facts,
    _auto_text_config,
    _derive_layer_types,
    _embedding_facts,
    _embedding_rows,
    _eos_list,
    _find_text_config,
    _first,
    _first_key,
    _generation_eos,
    _moe_facts,
    _probe_config,
    _read_config_json,
    _rope_facts,
    _tie_facts,
    _try_autoconfig,
    text_hidden_size,
)
from .drafter import (  # noqa: F401
    _check_drafter_sizes,
    _choose_mask_token_id,
    _choose_target_layer_ids,
    _drafter_record,
    resolve_mask_token_id,
    target_feature_count,
)
from .record import SCHEMA_PATH, load_probe_schema, summary, validate_probe, write_probe  # noqa: F401
from .tokenizer import (  # noqa: F401
    PROBE_ENV_FILE,
    THINK_MARKERS,
    _backend,
    _check_sentencepiece_deps,
    _probe_tokenizer,
    _tokenizer_error,
    _tokenizer_facts,
    _vocab_file,
    _vocab_file_kind,
)


def probe_target(
    target_dir: str | os.PathLike,
    *,
    block_size: int,
    num_draft_layers: int,
    num_target_features: int | None = None,
    target_layer_ids: Sequence[int] | None = None,
    mask_token_id: int | None = None,
    trust_remote_code: bool = False,
    chat_template: str | os.PathLike | None = None,
    strict: bool = True,
) -> dict:
    """Probe a target model directory and return the probe record (DESIGN.md §2, probe.schema.json).

    Args:
        target_dir: directory with `config.json` and (normally) tokenizer files; weights optional.
        block_size: drafter block size B (≥ 2).
        num_draft_layers: drafter decoder layers L (≥ 1).
        num_target_features: K target layers fused by the drafter (default L).
        target_layer_ids: canonical (0-based, layer-output) ids overriding the formula.
        mask_token_id: explicit mask token id (`resolve_mask_token_id`).
        trust_remote_code: allow the target's own tokenizer/config code.
        chat_template: a .jinja file overriding the tokenizer's chat template.
        strict: True (the pipeline rule): a missing tokenizer or chat template is an error. False (the CLI):
            `tokenizer.present = false` and a null `drafter.mask_token_id` with the reason; a missing
            template is a warning.

    Raises:
        ProbeRefusal: a target the drafter cannot be built for, with the reason (`checks.REASONS`).
        ProbeError: missing/unusable config.json, a tokenizer that cannot load (names the package or key),
            missing tokenizer (strict).
        ConfigError: no chat template and no override (strict); bad drafter settings (layer ids, mask id,
            block_size < 2, ...), naming the `drafter.*` key."""
    t0 = time.perf_counter()
    target_dir = Path(target_dir)
    if not target_dir.is_dir():
        raise ProbeError(f"target directory {target_dir} does not exist; check `target.path`")
    _check_drafter_sizes(block_size, num_draft_layers)

    cfg, warnings, auto_cfg = _probe_config(target_dir, trust_remote_code)
    cfg["target_loader"] = _probe_loader(target_dir, trust_remote_code, strict=strict, warnings=warnings)
    cfg.update(_embedding_facts(target_dir, cfg["vocab_size"], warnings))
    tok = _tokenizer_facts(
        target_dir,
        trust_remote_code=trust_remote_code,
        chat_template=chat_template,
        config=auto_cfg,
        strict=strict,
        warnings=warnings,
    )
    _preflight_tokenizer(target_dir, tok, cfg["embedding_rows"], strict=strict, warnings=warnings)
    gen_eos = _generation_eos(target_dir)

    ids, ids_src = _choose_target_layer_ids(
        cfg["num_hidden_layers"],
        num_draft_layers=num_draft_layers,
        num_target_features=num_target_features,
        target_layer_ids=target_layer_ids,
    )
    mid, mid_src = _choose_mask_token_id(mask_token_id, tok, cfg["embedding_rows"])
    if cfg["target_loader"]["error"] is None:
        _check_drafter_config(target_dir, trust_remote_code, block_size, num_draft_layers, ids, mid)

    return {
        "schema_version": PROBE_SCHEMA_VERSION,
        "target_dir": str(target_dir),
        **cfg,
        "generation_config_eos_token_ids": gen_eos,
        "eos_token_ids": _merged_eos_ids(tok.get("eos_token_ids_tokenizer", []), gen_eos, cfg["config_eos_token_ids"]),
        "tokenizer": tok,
        "trust_remote_code": bool(trust_remote_code),
        "drafter": _drafter_record(block_size, num_draft_layers, ids, ids_src, mid, mid_src),
        "warnings": warnings,
        "probe_seconds": round(time.perf_counter() - t0, 3),
    }


def check_target_config(
    target_dir: str | os.PathLike,
    *,
    block_size: int,
    num_draft_layers: int,
    num_target_features: int | None = None,
    target_layer_ids: Sequence[int] | None = None,
    trust_remote_code: bool = False,
    **_ignored,
) -> None:
    """Every check of `probe_target` that reads only `config.json` (no tokenizer, no weights): the architecture
    (`architecture_refusal`), the config class and the causal-LM class it loads with, the target layers, and the drafter
    sized from the config. Extra keyword arguments (`mask_token_id` …, the other `drafter` keys) are accepted and
    ignored.

    Raises:
        ProbeRefusal: the target cannot get a drafter (`reason` says why).
        ProbeError: a missing or unreadable config.json.
        ConfigError: drafter settings the target cannot take (layer ids out of range …).
    """
    from dflash_pipeline.target.loading import check_loadable

    target_dir = Path(target_dir)
    _check_drafter_sizes(block_size, num_draft_layers)
    cfg, _, _ = _probe_config(target_dir, trust_remote_code)
    check_loadable(target_dir, trust_remote_code=trust_remote_code)
    try:
        ids, _ = _choose_target_layer_ids(
            cfg["num_hidden_layers"],
            num_draft_layers=num_draft_layers,
            num_target_features=num_target_features,
            target_layer_ids=target_layer_ids,
        )
    except ConfigError:  # the architecture's refusal first: no drafter setting fixes that one
        _check_drafter_config(target_dir, trust_remote_code, block_size, num_draft_layers, [0], None)
        raise
    _check_drafter_config(target_dir, trust_remote_code, block_size, num_draft_layers, ids, None)


def _merged_eos_ids(*sources: Sequence[int]) -> list[int]:
    """The eos ids of `sources` in order, each once (tokenizer, generation_config.json, config.json)."""
    eos_ids: list[int] = []
    for src in sources:
        eos_ids += [i for i in src if i not in eos_ids]
    return eos_ids


def main(argv: Sequence[str] | None = None) -> int:
    """CLI `dflash-probe DIR`: print a readable summary, then the record as JSON (or write it with -o)."""
    ap = argparse.ArgumentParser(prog="dflash-probe", description="Probe a target model directory for DFlash.")
    ap.add_argument("target_dir")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-draft-layers", type=int, default=5)
    ap.add_argument("--num-target-features", type=int, default=None)
    ap.add_argument(
        "--target-layer-ids",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="comma-separated canonical ids, e.g. 1,9,17,25,33",
    )
    ap.add_argument("--mask-token-id", type=int, default=None)
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument("--chat-template", default=None)
    ap.add_argument("-o", "--output", default=None, help="write the JSON record here instead of stdout")
    ap.add_argument("--json", action="store_true", help="print only the JSON record")
    probe_args = vars(ap.parse_args(argv))  # every flag but -o and --json is probe_target's argument of its dest
    output, json_only = probe_args.pop("output"), probe_args.pop("json")
    try:
        rec = probe_target(**probe_args, strict=False)
    except (ProbeError, ConfigError) as exc:
        print(f"dflash-probe: error: {exc}", file=sys.stderr)
        return 2
    if not json_only:
        print(summary(rec), file=sys.stderr if output is None else sys.stdout)
    if output:
        write_probe(rec, output)
    else:
        print(json.dumps(rec, indent=2, sort_keys=True))
    return 0
