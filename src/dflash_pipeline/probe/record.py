"""The probe record on disk: its JSON Schema (`schemas/probe.schema.json`), validation, the atomic write
of `results/probe/<run>.json`, and the readable summary the CLI prints."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from dflash_pipeline.core.errors import ProbeError
from dflash_pipeline.core.shards import write_json

SCHEMA_PATH = Path(__file__).parent.parent / "core" / "schemas" / "probe.schema.json"


def write_probe(record: Mapping[str, Any], path: str | os.PathLike) -> bool:
    """Validate `record` against the probe schema and write it atomically.

    `probe_seconds` is dropped from the file so equal targets give byte-identical files. Returns True when the file was
    (re)written.
    """
    rec = {k: v for k, v in record.items() if k != "probe_seconds"}
    validate_probe(rec)
    return write_json(path, rec)


def load_probe_schema() -> dict:
    """The probe record's JSON Schema (`schemas/probe.schema.json`)."""
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


def validate_probe(record: Mapping[str, Any]) -> None:
    """Raise ProbeError when `record` does not match the probe schema (names the field)."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(load_probe_schema())
    errors = sorted(validator.iter_errors(record), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        where = ".".join(str(p) for p in e.absolute_path) or "<top level>"
        raise ProbeError(f"probe record field `{where}`: {e.message} (schema {SCHEMA_PATH.name})")


def summary(record: Mapping[str, Any]) -> str:
    """A readable multi-line summary of a probe record."""
    a, moe, tok, d = record["attention"], record.get("moe"), record["tokenizer"], record["drafter"]
    lines = [
        f"target       {record['target_dir']}",
        f"model        {record.get('model_type')} {record.get('architectures')}"
        + (
            f"  → text config at `{record['text_config_path']}` ({record.get('text_model_type')})"
            if record["text_config_path"]
            else ""
        ),
        f"config       loaded by {record['config_source']['loader']}",
        f"size         hidden {record['hidden_size']}, {record['num_hidden_layers']} layers, vocab "
        f"{record['vocab_size']} ({record['embedding_rows']} embedding rows), max pos "
        f"{record.get('max_position_embeddings')}, dtype {record.get('dtype')}, tied {record.get('tie_word_embeddings')}",
        f"attention    {a['kind']}: {record.get('num_attention_heads')} heads, {record.get('num_key_value_heads')} KV "
        f"heads, head_dim {record.get('head_dim')}"
        + (f", kv_lora_rank {a.get('kv_lora_rank')}, q_lora_rank {a.get('q_lora_rank')}" if a["kind"] == "MLA" else ""),
        "moe          "
        + (
            f"{moe['num_experts']} experts ({moe['num_experts_source']}), {moe['num_experts_per_tok']} per token"
            if moe
            else "dense"
        ),
    ]
    if record.get("layer_type_counts"):
        lines.append(f"layer types  {record['layer_type_counts']} ({record['layer_types_source']})")
    if tok.get("present"):
        th = tok.get("thinking_markers") or {}
        lines.append(
            f"tokenizer    {tok['class']} (backend {tok['backend']}"
            + (f", from {tok['vocab_file']}" if tok.get("vocab_file") else "")
            + f"), len {tok['len']}, bos {tok['bos_token_id']}, "
            f"eos {record['eos_token_ids']}, pad {tok['pad_token_id']}, chat template "
            f"{'yes' if tok['chat_template'] else 'NO'}, think "
            + (f"{th['open']['id']}/{th['close']['id']}" if th else "none")
            + (", remote code" if tok.get("remote_code") else "")
        )
    else:
        lines.append(f"tokenizer    MISSING: {tok['missing_reason']}")
    lines += [
        f"drafter      block {d['block_size']}, {d['num_draft_layers']} layers, target layers "
        f"{d['target_layer_ids']} (HF hidden_states {d['hf_hidden_state_indices']})",
        f"mask token   {d['mask_token_id']}: {d['mask_token_source']}",
    ]
    lines += [f"warning      {w}" for w in record.get("warnings", [])]
    return "\n".join(lines)
