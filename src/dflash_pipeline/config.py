"""Config loading with the same JSON Schema (and defaults) the Snakefile validates against."""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any, Mapping

import jsonschema
import yaml

from .errors import ConfigError, strip_url_credentials

SCHEMA_PATH = Path(__file__).parent / "schemas" / "config.schema.yaml"


def _with_defaults(validator_cls):
    validate_props = validator_cls.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for key, sub in properties.items():
                if "default" in sub and key not in instance:
                    instance[key] = copy.deepcopy(sub["default"])
        yield from validate_props(validator, properties, instance, schema)

    def additional_defaults(validator, additional, instance, schema):
        # defaults inside `additionalProperties` schemas (datasets.<name>, eval.sets.<name>)
        if isinstance(instance, dict) and isinstance(additional, dict):
            declared = set(schema.get("properties", {}))
            for key, value in instance.items():
                if key not in declared:
                    yield from validator.descend(value, additional, path=key)
        elif additional is False and isinstance(instance, dict):
            yield from validator_cls.VALIDATORS["additionalProperties"](validator, additional, instance, schema)

    return jsonschema.validators.extend(
        validator_cls, {"properties": set_defaults, "additionalProperties": additional_defaults}
    )


def load_schema() -> dict:
    """Return the config JSON Schema (a dict)."""
    with open(SCHEMA_PATH, "r", encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def _describe(err: jsonschema.ValidationError) -> str:
    """One line for one schema error: the dotted key path and what is wrong, with a close-match hint for
    an unknown key."""
    where = ".".join(str(p) for p in err.absolute_path)
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        known = sorted((err.schema.get("properties") or {}))
        lines = []
        for key in sorted(set(err.instance) - set(known), key=str):
            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean `{near[0]}`?" if near else f"known keys: {', '.join(known)}"
            lines.append(f"`{where + '.' if where else ''}{key}`: unknown key ({hint})")
        return "; ".join(lines)
    if err.validator == "required":
        return f"`{where or '<top level>'}`: {err.message}"
    value = strip_url_credentials(repr(err.instance))
    value = value if len(value) <= 60 else value[:57] + "..."
    msg = err.message if len(err.message) <= 200 else err.message[:197] + "..."
    expect = {"type": "type", "enum": "one of", "minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">",
              "exclusiveMaximum": "<", "pattern": "a match of", "minLength": "length >="}.get(str(err.validator))
    if expect is not None:
        msg = f"{value} is not valid: expected {expect} {err.validator_value!r}"
    return f"`{where or '<top level>'}`: {msg}"


def schema_problems(config: Mapping[str, Any]) -> list[str]:
    """Every schema violation of ``config`` as one short line each (dotted key path first), sorted by key path.

    The Snakefile calls this before Snakemake's ``validate`` (which prints the whole schema and only its
    first error), so a typo reads ``token: unknown key (did you mean tokens?)`` (key paths in backticks).
    """
    cfg = copy.deepcopy(dict(config))
    validator = _with_defaults(jsonschema.Draft202012Validator)(load_schema())
    return sorted({line for e in validator.iter_errors(cfg) for line in _describe(e).split("; ")})


def _is_number_schema(sub: Mapping[str, Any]) -> bool:
    t = sub.get("type")
    return t == "number" or (isinstance(t, list) and "number" in t and "integer" not in t)


def normalize_numbers(config: dict, schema: Mapping[str, Any] | None = None) -> dict:
    """Write every ``number`` field the way its schema default is written, in place: ``temperature: 0``
    becomes ``0.0`` (default ``0.0``), ``epochs: 6.0`` becomes ``6`` (default ``6``); without a default,
    ints become floats. Snakemake's params trigger compares ``repr``s, so otherwise ``0`` and ``0.0``
    would regenerate every shard. Returns ``config``."""
    schema = load_schema() if schema is None else schema

    def walk(node: Any, sch: Mapping[str, Any]) -> None:
        if not isinstance(node, dict):
            return
        props = sch.get("properties") or {}
        extra = sch.get("additionalProperties")
        for key, value in node.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if not isinstance(sub, dict):
                continue
            if _is_number_schema(sub) and isinstance(value, (int, float)) and not isinstance(value, bool):
                default = sub.get("default")
                if isinstance(default, int) and not isinstance(default, bool) and float(value).is_integer():
                    node[key] = int(value)
                elif not isinstance(default, int) or isinstance(default, bool):
                    node[key] = float(value)
            else:
                walk(value, sub)

    walk(config, schema)
    return config


def validate_config(config: Mapping[str, Any]) -> dict:
    """Validate ``config`` against the schema and return a deep copy with every default filled in.

    Raises:
        ConfigError: naming the offending key path and the schema's complaint, or (by key) a language code
            the language filter does not know (:func:`dflash_pipeline.prompts.language_problems`).
    """
    problems = schema_problems(config)
    if problems:
        raise ConfigError(f"config problems (schema: {SCHEMA_PATH}): " + "; ".join(problems))
    cfg = copy.deepcopy(dict(config))
    _with_defaults(jsonschema.Draft202012Validator)(load_schema()).validate(cfg)  # fills the defaults
    normalize_numbers(cfg)
    if cfg["prompts"].get("languages") or any(
        src.get("languages") is not None or src.get("min_language_confidence") is not None
        for src in cfg["datasets"].values()
    ):  # language codes the schema's pattern lets through (imported only when a language filter is set)
        from .prompts import language_problems

        problems = language_problems(cfg["prompts"], cfg["datasets"])
        if problems:
            raise ConfigError("; ".join(problems))
    return cfg


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> dict:
    """Load a YAML config (default: an empty one), deep-merge ``overrides`` and validate with defaults."""
    cfg: dict = {}
    if path is not None:
        with open(path, "r", encoding="utf-8") as fh:
            cfg = yaml.safe_load(fh) or {}
    if overrides:
        cfg = deep_merge(cfg, overrides)
    return validate_config(cfg)


def deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict:
    """Recursively merge ``update`` into a copy of ``base`` (mappings merge, everything else replaces)."""
    out = copy.deepcopy(dict(base))
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
