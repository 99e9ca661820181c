"""Normalization of raw source records into prompt messages (``[{role, content}]``, system and user
turns only): format detection (ShareGPT, OpenAI messages, Alpaca, plain prompt, MT-Bench), per-source
field ``mapping``, role aliases, and the policy rejections counted as drop reasons
(:class:`RejectedRecord`)."""

from __future__ import annotations

import json
from typing import Any, Mapping

from dflash_pipeline.core.errors import ConfigError, DataError

#: Record formats understood by :func:`normalize_record` (``auto`` detects per record).
FORMATS = ("auto", "sharegpt", "openai", "alpaca", "prompt", "mt_bench")
#: Separator between an Alpaca instruction and its non-empty input (as the DFlash authors' alpaca eval).
ALPACA_INPUT_SEPARATOR = "\n\nInput:\n"

#: Source role names -> normalized role (ShareGPT ``from`` and OpenAI ``role`` values, lower-cased).
ROLE_ALIASES = {
    "system": "system",
    "developer": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "bot": "assistant",
}
#: Canonical field names a per-source ``mapping`` may redirect to other source fields.
MAPPABLE_FIELDS = (
    "conversations",
    "messages",
    "turns",
    "instruction",
    "input",
    "prompt",
    "question",
    "problem",
    "system",
    "from",
    "value",
    "role",
    "content",
)
#: Stands for an absent field in type checks (an absent field is reported as missing, not as null).
_MISSING = object()


class RejectedRecord(DataError):
    """A well-formed record that the prompt policy rejects (``reason`` is the manifest's drop reason).

    :func:`build_prompt_shards` counts these instead of failing, whatever ``strict`` says.
    """

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class MissingField(DataError):
    """A field the record's format needs is absent (the message names the field and the fields present)."""


def _type_error(
    where: str, value: Any, expected: str, container: Mapping[str, Any] | None = None, what: str = "record"
) -> DataError:
    """The error for field ``where`` holding ``value`` instead of ``expected``: :class:`MissingField`
    when ``value`` is :data:`_MISSING` (listing the fields ``container``, a ``what``, does have)."""
    if value is _MISSING:
        have = f" (the {what} has fields {sorted(map(str, container))[:20]})" if container is not None else ""
        return MissingField(f"field `{where}` is missing{have}; expected {expected}")
    return DataError(f"field `{where}`: expected {expected}, got {'null' if value is None else type(value).__name__}")


def _field(mapping: Mapping[str, str] | None, name: str) -> str:
    return (mapping or {}).get(name, name)


def detect_format(record: Mapping[str, Any], mapping: Mapping[str, str] | None = None) -> str:
    """Record shape by its fields, first match wins: ``conversations`` -> sharegpt, ``messages`` -> openai,
    ``turns`` -> mt_bench, ``instruction`` -> alpaca, ``prompt``/``question``/``problem`` -> prompt.

    Raises:
        RejectedRecord: ``no_prompt_field`` when none of them is present (set ``format``/``mapping``).
    """
    for name, fmt in (
        ("conversations", "sharegpt"),
        ("messages", "openai"),
        ("turns", "mt_bench"),
        ("instruction", "alpaca"),
        ("prompt", "prompt"),
        ("question", "prompt"),
        ("problem", "prompt"),
    ):
        if _field(mapping, name) in record:
            return fmt
    raise RejectedRecord(
        "no_prompt_field",
        f"none of the fields conversations/messages/turns/instruction/prompt/question/problem is present "
        f"(fields: {sorted(record)[:10]}); set the source's `format` and `mapping`",
    )


def _consumed_fields(record: Mapping[str, Any], fmt: str, mapping) -> set[str]:
    names = {
        "sharegpt": ["conversations"],
        "openai": ["messages"],
        "mt_bench": ["turns"],
        "alpaca": ["instruction", "input"],
    }.get(fmt)
    if names is None:  # prompt
        names = [next(n for n in ("prompt", "question", "problem") if _field(mapping, n) in record)]
    return {_field(mapping, n) for n in names + ["system"]}


def _text_content(value: Any, where: str) -> str:
    """Content of one message as a string; OpenAI text-part lists are concatenated without separator
    (what chat templates such as Qwen3's do with them)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                ptype = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RejectedRecord("multimodal", f"`{where}[{i}]` is a {ptype!r} part (only text is supported)")
        return "".join(parts)
    if isinstance(value, dict):
        raise RejectedRecord("multimodal", f"`{where}` is an object ({sorted(value)[:5]}), not text")
    raise _type_error(where, value, "a string")


def _chat_messages(
    turns: Any, list_field: str, role_key: str, content_key: str, role_map, record: Mapping[str, Any]
) -> list[dict]:
    if not isinstance(turns, list):
        raise _type_error(list_field, turns, "a list of messages", record)
    out: list[dict] = []
    seen_user = False
    for i, msg in enumerate(turns):
        where = f"{list_field}[{i}]"
        if not isinstance(msg, dict):
            raise DataError(
                f"field `{where}`: expected an object with `{role_key}`/`{content_key}`, got {type(msg).__name__}"
            )
        raw_role = msg.get(role_key, _MISSING)
        if not isinstance(raw_role, str):
            raise _type_error(f"{where}.{role_key}", raw_role, "a role string", msg, "message")
        role = role_map.get(raw_role, ROLE_ALIASES.get(raw_role.lower()))
        if role is None:
            raise RejectedRecord(
                "unsupported_role",
                f"`{where}.{role_key}` is {raw_role!r} (tool/function turns "
                "cannot be regenerated from user turns; map it with `mapping.roles`)",
            )
        if role == "assistant":
            if not seen_user:
                raise RejectedRecord("starts_with_assistant", f"`{where}` is an assistant turn before any user turn")
            continue  # regenerated by the target
        if content_key not in msg:
            raise _type_error(f"{where}.{content_key}", _MISSING, "a string", msg, "message")
        content = _text_content(msg[content_key], f"{where}.{content_key}")
        if role == "system" and not content.strip():
            continue  # an empty system slot carries nothing the user wrote
        seen_user = seen_user or role == "user"
        out.append({"role": role, "content": content})
    return out


def normalize_record(
    record: Mapping[str, Any], *, fmt: str = "auto", mapping: Mapping[str, Any] | None = None
) -> list[dict]:
    """Normalize one source record to prompt messages ``[{role, content}]`` (system and user turns only).

    Formats (``fmt``; ``auto`` uses :func:`detect_format`):
        * ``sharegpt``: ``conversations`` of ``{from, value}`` (``human``/``gpt``/``system`` and aliases;
          ``{role, content}`` items are accepted too).
        * ``openai``: ``messages`` of ``{role, content}``; ``content`` may be a list of text parts.
        * ``mt_bench``: ``turns``, a list of user strings.
        * ``alpaca``: ``instruction`` plus, when non-empty, ``"\\n\\nInput:\\n" + input``.
        * ``prompt``: one user turn from ``prompt``, ``question`` or ``problem`` (first present);
          a ``prompt`` that is a list of messages is read as ``openai``.
        A top-level ``system`` string becomes a leading system message in every format.

    ``mapping`` redirects canonical field names to the source's (e.g. ``{"prompt": "query"}``, or
    ``{"messages": "dialog", "role": "speaker", "content": "text"}``); ``mapping["roles"]`` maps source role
    values to ``system``/``user``/``assistant``. Text is never stripped or rewritten; assistant turns are
    dropped (the target regenerates them); empty system messages are dropped.

    Raises:
        RejectedRecord: policy drops, with ``.reason``: ``empty`` (no user turn, or a blank user turn),
            ``starts_with_assistant``, ``multimodal`` (a non-text content part, an image field),
            ``unsupported_role`` (tool/function/unknown roles), ``no_prompt_field``.
        DataError: a field has the wrong type (message names the field, e.g. ``conversations[2].value``);
            :class:`MissingField` when a field the format needs is absent (names it and the fields present).
    """
    return _normalize(record, fmt, mapping)[0]


def _normalize(record: Mapping[str, Any], fmt: str, mapping: Mapping[str, Any] | None) -> tuple[list[dict], str]:
    """:func:`normalize_record` that also returns the format used (after ``auto`` detection)."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown prompt format {fmt!r}; use one of {FORMATS}")
    mapping = dict(mapping or {})
    role_map = {k: v for k, v in (mapping.pop("roles", None) or {}).items()}
    if fmt == "auto":
        fmt = detect_format(record, mapping)
    for key in ("image", "images", "audio", "video"):
        if record.get(key):
            raise RejectedRecord("multimodal", f"record has a non-empty `{key}` field")

    if fmt == "sharegpt":
        name = _field(mapping, "conversations")
        conv = record.get(name, _MISSING)
        role_key, content_key = _field(mapping, "from"), _field(mapping, "value")
        if (
            isinstance(conv, list)
            and conv
            and isinstance(conv[0], dict)
            and role_key not in conv[0]
            and "role" in conv[0]
        ):
            role_key, content_key = "role", "content"
        messages = _chat_messages(conv, name, role_key, content_key, role_map, record)
    elif fmt == "openai" or (fmt == "prompt" and isinstance(record.get(_field(mapping, "prompt")), list)):
        name = _field(mapping, "messages") if fmt == "openai" else _field(mapping, "prompt")
        messages = _chat_messages(
            record.get(name, _MISSING), name, _field(mapping, "role"), _field(mapping, "content"), role_map, record
        )
    elif fmt == "mt_bench":
        name = _field(mapping, "turns")
        turns = record.get(name, _MISSING)
        if not isinstance(turns, list):
            raise _type_error(name, turns, "a list of user strings", record)
        messages = [{"role": "user", "content": _text_content(t, f"{name}[{i}]")} for i, t in enumerate(turns)]
    elif fmt == "alpaca":
        iname, xname = _field(mapping, "instruction"), _field(mapping, "input")
        instruction = record.get(iname, _MISSING)
        if not isinstance(instruction, str):
            raise _type_error(iname, instruction, "a string", record)
        extra = record.get(xname)
        if extra is not None and not isinstance(extra, str):
            raise _type_error(xname, extra, "a string")
        text = instruction + (ALPACA_INPUT_SEPARATOR + extra if extra and extra.strip() else "")
        messages = [{"role": "user", "content": text}]
    else:  # prompt
        for candidate in ("prompt", "question", "problem"):
            name = _field(mapping, candidate)
            if name in record:
                break
        else:
            raise RejectedRecord("no_prompt_field", "none of prompt/question/problem is present; set `mapping`")
        messages = [{"role": "user", "content": _text_content(record[name], name)}]

    sname = _field(mapping, "system")
    system = record.get(sname)
    if system is not None and fmt in ("alpaca", "prompt", "mt_bench", "sharegpt", "openai"):
        if not isinstance(system, str):
            raise _type_error(sname, system, "a string")
        if system.strip() and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": system})

    users = [m for m in messages if m["role"] == "user"]
    if not users:
        raise RejectedRecord("empty", "no user turn")
    for i, m in enumerate(users):
        if not m["content"].strip():
            raise RejectedRecord("empty", f"user turn {i} is blank")
    return messages, fmt


def record_metadata(record: Mapping[str, Any], fmt: str, mapping: Mapping[str, Any] | None, source: dict) -> str:
    """JSON string of the record's fields that did not become messages, plus ``_source`` (file relative to
    the source path, and line/record/row number). Deterministic (sorted keys); non-JSON values via str()."""
    mapping = {k: v for k, v in (mapping or {}).items() if k != "roles"}
    if fmt == "auto":
        fmt = detect_format(record, mapping)
    consumed = _consumed_fields(record, fmt, mapping)
    meta = {k: v for k, v in record.items() if k not in consumed}
    meta["_source"] = source
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
