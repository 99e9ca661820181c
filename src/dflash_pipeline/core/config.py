"""Config loading with the same JSON Schema (and defaults) the Snakefile validates against."""

from __future__ import annotations

import copy
import difflib
import functools
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import jsonschema
import yaml

from dflash_pipeline.core.errors import ConfigError, strip_url_credentials

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
    """Return the config JSON Schema (a dict; a copy: mutating it changes nothing). The file is parsed once
    per process (`_schema`): the Snakefile's checks ask for it several times per plan."""
    return copy.deepcopy(_schema())


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
    expect = {
        "type": "type",
        "enum": "one of",
        "minimum": ">=",
        "maximum": "<=",
        "exclusiveMinimum": ">",
        "exclusiveMaximum": "<",
        "pattern": "a match of",
        "minLength": "length >=",
    }.get(str(err.validator))
    if expect is not None:
        msg = f"{value} is not valid: expected {expect} {err.validator_value!r}"
    return f"`{where or '<top level>'}`: {msg}"


def schema_problems(config: Mapping[str, Any]) -> list[str]:
    """Every schema violation of `config` as one short line each (dotted key path first), sorted by key path.

    The Snakefile calls this before Snakemake's `validate` (which prints the whole schema and only its
    first error), so a typo reads `token: unknown key (did you mean tokens?)` (key paths in backticks).
    """
    cfg = copy.deepcopy(dict(config))
    validator = _with_defaults(jsonschema.Draft202012Validator)(_schema())
    return sorted({line for e in validator.iter_errors(cfg) for line in _describe(e).split("; ")})


def _is_number_schema(sub: Mapping[str, Any]) -> bool:
    t = sub.get("type")
    return t == "number" or (isinstance(t, list) and "number" in t and "integer" not in t)


def normalize_numbers(config: dict, schema: Mapping[str, Any] | None = None) -> dict:
    """Write every `number` field the way its schema default is written, in place: `temperature: 0`
    becomes `0.0` (default `0.0`), `epochs: 6.0` becomes `6` (default `6`); without a default,
    ints become floats. Snakemake's params trigger compares `repr`s, so otherwise `0` and `0.0`
    would regenerate every shard. Returns `config`."""
    schema = _schema() if schema is None else schema

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


_NULLS = ("null", "Null", "NULL", "~")


def _typed_scalar(value: str, types: Sequence[str]) -> Any:
    """`value` as the first non-string type of `types` it spells; `value` unchanged when `types` allows a string or
    it spells none of them."""
    import re

    if "string" in types:
        return value
    if "integer" in types and re.fullmatch(r"[+-]?\d+", value.strip()):
        return int(value)
    if "number" in types:
        try:
            return float(value)
        except ValueError:
            pass
    if "boolean" in types and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if "null" in types and value.strip() in _NULLS:
        return None
    return value


def coerce_cli_strings(config: dict, schema: Mapping[str, Any] | None = None) -> dict:
    """Give the scalars that arrived as strings the type their schema field asks for, in place, and return `config`.
    Snakemake reads a nested `--config` value with YAML's BaseLoader, so in `--config "drafter={block_size: 4}"` every
    scalar is a string (`'4'`) and the schema would refuse it."""
    schema = _schema() if schema is None else schema

    def types_of(sub: Mapping[str, Any]) -> list[str]:
        t = sub.get("type")
        return list(t) if isinstance(t, list) else [t] if t else []

    def fix(value: Any, sub: Mapping[str, Any]) -> Any:
        if isinstance(value, str):
            return _typed_scalar(value, types_of(sub))
        if isinstance(value, list) and isinstance(sub.get("items"), dict):
            return [fix(v, sub["items"]) for v in value]
        if isinstance(value, dict):
            props, extra = sub.get("properties") or {}, sub.get("additionalProperties")
            for key, v in value.items():
                child = props.get(key, extra if isinstance(extra, dict) else None)
                if isinstance(child, dict):
                    value[key] = fix(v, child)
        return value

    fix(config, schema)
    return config


def validate_config(config: Mapping[str, Any]) -> dict:
    """Validate `config` against the schema and return a deep copy with every default filled in.



    Raises:
        ConfigError: naming the offending key path and the schema's complaint.
    """
    found = schema_problems(config)
    if found:
        raise ConfigError(f"config problems (schema: {SCHEMA_PATH}): " + "; ".join(found))
    return fill_defaults(config)


def fill_defaults(config: Mapping[str, Any]) -> dict:
    """A deep copy of a schema-valid `config` with every default filled and numbers normalized."""
    cfg = copy.deepcopy(dict(config))
    _with_defaults(jsonschema.Draft202012Validator)(load_schema()).validate(cfg)  # fills the defaults
    return normalize_numbers(cfg)


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> dict:
    """Load a YAML config (default: an empty one), deep-merge `overrides` and validate with defaults."""
    cfg: dict = {}
    if path is not None:
        with open(path, "r", encoding="utf-8") as fh:
            cfg = yaml.safe_load(fh) or {}
    if overrides:
        cfg = deep_merge(cfg, overrides)
    return validate_config(cfg)


def deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict:
    """Recursively merge `update` into a copy of `base` (mappings merge, everything else replaces)."""
    out = copy.deepcopy(dict(base))
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


# --- cross-field checks: one place for the plan (Snakefile) and the library


@functools.lru_cache(maxsize=1)
def _schema() -> dict:
    """The parsed schema file, shared (never mutate it): libyaml's parser when PyYAML has it."""
    with open(SCHEMA_PATH, "r", encoding="utf-8") as fh:
        return yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _schema_node(path: Sequence[str]) -> Mapping[str, Any]:
    node: Mapping[str, Any] = _schema()
    for key in path:
        node = node["additionalProperties"] if key == "*" else node["properties"][key]
    return node


def schema_default(*path: str) -> Any:
    """The schema's default of the key at `path`, for code that compares a value with its default.

    Raises:
        KeyError: no such key, or it has no default.
    """
    return copy.deepcopy(_schema_node(path)["default"])


def schema_defaults(*path: str) -> dict:
    """`{key: default}` of every key with a default in the object at `path` (as `schema_default`), for library entry
    points that accept a partial section: they fill it from the schema rather than re-stating a default."""
    props = _schema_node(path).get("properties") or {}
    return {k: copy.deepcopy(v["default"]) for k, v in props.items() if "default" in v}


def generation_problems(
    gen: Mapping[str, Any], *, target_dir: Any, backend: str | None = None, environ: Mapping[str, str] | None = None
) -> list[str]:
    """Cross-field problems of a validated `generation` section, one line each (empty: none).

    Args:
        gen: validated `config["generation"]`.
        target_dir: the target directory (`target.path`; None when a library caller has none).
        backend: the backend to check for (default `gen["backend"]`).
        environ: where `api_key_env` variables are looked up (default `os.environ`).
    """
    environ = os.environ if environ is None else environ
    backend = gen["backend"] if backend is None else backend
    out = []
    if backend == "openai" and not gen["endpoints"]:
        out.append("generation.endpoints: the openai backend needs at least one {base_url: http://host:port/v1}")
    if backend != "openai" and gen["client_processes"] > 1:
        out.append(
            "generation.client_processes: applies to the openai backend only (transformers generates "
            "in-process); leave it at 1"
        )
    if gen["api"] == "completions":
        if backend != "openai":
            out.append(
                "generation.api: completions applies to the openai backend only (transformers renders locally anyway)"
            )
        elif target_dir is None:
            out.append(
                "generation.api: completions renders prompts locally and needs the target's tokenizer and "
                "chat template (target.path)"
            )
        if "chat_template_kwargs" in gen["extra_body"]:
            out.append(
                "generation.extra_body.chat_template_kwargs: not applied with generation.api: completions "
                "(the prompt is rendered locally; generation.thinking sets the template kwargs)"
            )
    if backend != "openai":
        if target_dir is None:
            out.append("generation.backend: transformers needs the target directory (target.path)")
        return out
    for i, ep in enumerate(gen["endpoints"]):
        env = ep.get("api_key_env")
        if env and env not in environ:
            out.append(
                f"generation.endpoints[{i}].api_key_env: ${env} (the key of "
                f"{strip_url_credentials(ep['base_url'])}) is not set; export it (the key itself never goes "
                f"into the config)"
            )
    return out


def resolve_path(path: str, base_dir: str | Path | None) -> str:
    """A relative `path` missing from the working directory but present under `base_dir` resolves there, so
    `snakemake -d elsewhere` works; any other path is returned as given."""
    p = Path(path)
    if base_dir is None or p.is_absolute() or p.exists():
        return str(path)
    shipped = Path(base_dir) / p
    return str(shipped) if shipped.exists() else str(path)
