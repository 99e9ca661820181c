"""Normalization of raw source records into prompt messages (`[{role, content}]`, system and user turns, and
the tool turns of a conversation with tool calls): format detection, per-source field `mapping`, role
aliases, and the policy rejections counted as drop reasons (`RejectedRecord`).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from dflash_pipeline.core.contracts import canonical_json
from dflash_pipeline.core.errors import ConfigError, DataError

#: Record formats understood by `normalize_record` (`auto` detects per record).
FORMATS = ("auto", "sharegpt", "openai", "alpaca", "prompt", "mt_bench")
#: Separator between an Alpaca instruction and its non-empty input (as the DFlash authors' alpaca eval).
ALPACA_INPUT_SEPARATOR = "\n\nInput:\n"

#: Source role names -> normalized role (ShareGPT `from` and OpenAI `role` values, lower-cased).
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
#: Source role names of tool turns -> normalized role: `tool` results (OpenAI `tool`, its legacy `function`,
#: ShareGPT `observation` as LLaMA-Factory writes it, Llama 3.1's `ipython`), and ShareGPT `function_call`
#: (an assistant turn whose `value` is the JSON of one call `{name, arguments}` or of a list of them).
TOOL_ROLE_ALIASES = {
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "ipython": "tool",
    "function_call": "function_call",
}
#: Canonical field names a per-source `mapping` may redirect to other source fields.
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
    "tools",
    "tool_calls",
)
#: Stands for an absent field in type checks (an absent field is reported as missing, not as null).
_MISSING = object()


class RejectedRecord(DataError):
    """A well-formed record that the prompt policy rejects (`reason` is the manifest's drop reason).

    `build_prompt_shards` counts these instead of failing, whatever `strict` says.
    """

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _bad_tools(where: str, detail: str) -> RejectedRecord:
    """The drop of a record whose tools or tool turns cannot be used (`bad_tool_turns`; names the field)."""
    return RejectedRecord("bad_tool_turns", f"`{where}` {detail}")


def _tool_schemas(value: Any, where: str) -> str | None:
    """A record's `tools` as the canonical JSON text of the OpenAI `tools` list: `[{type: function, function: {name,
    description?, parameters?}}]`; a bare function schema `{name, ...}` is wrapped. None when empty or absent.

    Raises:
        RejectedRecord: `bad_tool_turns`: not JSON, not a list, or an entry without a function name.
    """
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise _bad_tools(where, f"is not JSON ({exc})") from None
        if not value:
            return None
    if not isinstance(value, list):
        raise _bad_tools(where, f"must be a list of function schemas, got {type(value).__name__}")
    out = []
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) and "function" in tool else tool
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad_tools(f"{where}[{i}]", "is no function schema with a `name`")
        out.append({"type": (tool.get("type") if fn is not tool else None) or "function", "function": fn})
    return canonical_json(out)


def _tool_calls(value: Any, where: str) -> list[dict]:
    """Tool calls of a source turn as the OpenAI list `[{id?, type: function, function: {name, arguments}}]`
    (`arguments` as the source wrote it: JSON text or an object). `value`: the OpenAI `tool_calls` list, a legacy
    `function_call` object, a ShareGPT `function_call` value, or the JSON text of any of these.

    Raises:
        RejectedRecord: `bad_tool_turns`: not JSON, or a call without a function name.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise _bad_tools(where, f"is not JSON ({exc})") from None
    calls = value if isinstance(value, list) else [value]
    if not calls:
        raise _bad_tools(where, "holds no call")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) and isinstance(call.get("function"), dict) else call
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad_tools(
                f"{where}[{i}]" if len(calls) > 1 or isinstance(value, list) else where,
                "is no call with a function `name`",
            )
        args = fn.get("arguments", fn.get("parameters", {}))
        entry: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call, dict) and isinstance(call.get("id"), str) and call["id"]:
            entry = {"id": call["id"], **entry}
        out.append(entry)
    return out


class MissingField(DataError):
    """A field the record's format needs is absent (the message names the field and the fields present)."""


def _type_error(
    where: str, value: Any, expected: str, container: Mapping[str, Any] | None = None, what: str = "record"
) -> DataError:
    """The error for field `where` holding `value` instead of `expected`: `MissingField`
    when `value` is `_MISSING` (listing the fields `container`, a `what`, does have)."""
    if value is _MISSING:
        have = f" (the {what} has fields {sorted(map(str, container))[:20]})" if container is not None else ""
        return MissingField(f"field `{where}` is missing{have}; expected {expected}")
    return DataError(f"field `{where}`: expected {expected}, got {'null' if value is None else type(value).__name__}")


def _field(mapping: Mapping[str, str] | None, name: str) -> str:
    return (mapping or {}).get(name, name)


def detect_format(record: Mapping[str, Any], mapping: Mapping[str, str] | None = None) -> str:
    """Record shape by its fields, first match wins: `conversations` -> sharegpt, `messages` -> openai,
    `turns` -> mt_bench, `instruction` -> alpaca, `prompt`/`question`/`problem` -> prompt.

    Raises:
        RejectedRecord: `no_prompt_field` when none of them is present (set `format`/`mapping`).
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
        role = role_map.get(raw_role, ROLE_ALIASES.get(raw_role.lower(), TOOL_ROLE_ALIASES.get(raw_role.lower())))
        if role is None:
            raise RejectedRecord(
                "unsupported_role",
                f"`{where}.{role_key}` is {raw_role!r} (map it to system/user/assistant/tool with `mapping.roles`)",
            )
        if role in ("assistant", "function_call"):
            if not seen_user:
                raise RejectedRecord("starts_with_assistant", f"`{where}` is an assistant turn before any user turn")
            calls = _source_calls(msg, role, where, content_key)
            if calls is None:
                continue  # a text answer: regenerated by the target
            if out[-1]["role"] == "assistant":  # parallel calls written as consecutive turns
                out[-1]["tool_calls"] = canonical_json(json.loads(out[-1]["tool_calls"]) + calls)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": canonical_json(calls)})
            continue
        if content_key not in msg:
            raise _type_error(f"{where}.{content_key}", _MISSING, "a string", msg, "message")
        if role == "tool":
            if not out or out[-1]["role"] not in ("assistant", "tool"):
                raise _bad_tools(where, "is a tool result that answers no tool call of an assistant turn before it")
            out.append(_tool_result(msg, where, content_key))
            continue
        content = _text_content(msg[content_key], f"{where}.{content_key}")
        if role == "system" and not content.strip():
            continue  # an empty system slot carries nothing the user wrote
        if role == "user" and out and out[-1]["role"] == "assistant":
            raise _bad_tools(
                f"{list_field}[{i - 1}]", "calls tools, but no tool result follows before the next user turn"
            )
        seen_user = seen_user or role == "user"
        out.append({"role": role, "content": content})
    return out


def _source_calls(msg: Mapping[str, Any], role: str, where: str, content_key: str) -> list[dict] | None:
    """The tool calls of a source assistant turn (OpenAI `tool_calls` or legacy `function_call`; a ShareGPT
    `function_call` turn's value), None for a text answer. Raises RejectedRecord (`bad_tool_turns`)."""
    if role == "function_call":
        return _tool_calls(msg.get(content_key), f"{where}.{content_key}")
    for key in ("tool_calls", "function_call"):
        value = msg.get(key)
        if value not in (None, "", []):
            return _tool_calls(value, f"{where}.{key}")
    return None


def _tool_result(msg: Mapping[str, Any], where: str, content_key: str) -> dict:
    """A normalized `tool` message: `content` (text; an object or list as its JSON text), and
    `tool_call_id` and `name` when the source gives them."""
    value = msg[content_key]
    if isinstance(value, (dict, list)) and not (
        isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value)
    ):
        content = json.dumps(value, ensure_ascii=False)
    else:
        content = _text_content(value, f"{where}.{content_key}")
    out: dict[str, Any] = {"role": "tool", "content": content}
    for key in ("tool_call_id", "name"):
        v = msg.get(key)
        if v is not None:
            if not isinstance(v, str):
                raise _type_error(f"{where}.{key}", v, "a string")
            out[key] = v
    return out


def normalize_record(
    record: Mapping[str, Any], *, fmt: str = "auto", mapping: Mapping[str, Any] | None = None
) -> list[dict]:
    """Normalize one source record to prompt messages `[{role, content}]` (system and user turns, and
    the tool turns below).

    Formats (`fmt`; `auto` uses `detect_format`): `sharegpt` (`conversations` of `{from, value}` or
    `{role, content}`), `openai` (`messages`; `content` may be a list of text parts), `mt_bench` (`turns`),
    `alpaca` (`instruction` plus `"\\n\\nInput:\\n" + input` when non-empty), `prompt` (one user turn from
    `prompt`, `question` or `problem`). A top-level `system` string becomes a leading system message.

    `mapping` redirects canonical field names to the source's (e.g. `{"prompt": "query"}`);
    `mapping["roles"]` maps role values. Text is never rewritten; assistant turns and empty system messages
    are dropped. An assistant turn that called tools is kept as `{role: assistant, content: "", tool_calls}`
    (consecutive ones merged) and tool results as `{role: tool, content, tool_call_id?, name?}`; the
    record's `tools` come from `record_tools`.

    Raises:
        RejectedRecord: with `.reason` `empty`, `starts_with_assistant`, `multimodal`, `unsupported_role`,
            `no_prompt_field` or `bad_tool_turns` (names the field).
        DataError: a field has the wrong type (names it, e.g. `conversations[2].value`); `MissingField`
            when a field the format needs is absent (names it and the fields present)."""
    return _normalize(record, fmt, mapping)[0]


def record_tools(record: Mapping[str, Any], *, mapping: Mapping[str, Any] | None = None) -> str | None:
    """The canonical JSON text of a record's `tools` (the OpenAI `tools` list, see `_tool_schemas`), or
    None. Raises RejectedRecord (`bad_tool_turns`)."""
    name = _field({k: v for k, v in (mapping or {}).items() if k != "roles"}, "tools")
    return _tool_schemas(record.get(name), name)


def _normalize(record: Mapping[str, Any], fmt: str, mapping: Mapping[str, Any] | None) -> tuple[list[dict], str]:
    """`normalize_record` that also returns the format used (after `auto` detection)."""
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
    """JSON string of the record's fields that did not become messages, plus `_source` (file relative to
    the source path, and line/record/row number). Deterministic (sorted keys); non-JSON values via str()."""
    mapping = {k: v for k, v in (mapping or {}).items() if k != "roles"}
    if fmt == "auto":
        fmt = detect_format(record, mapping)
    consumed = _consumed_fields(record, fmt, mapping)
    if record_tools(record, mapping=mapping) is not None:  # an empty `tools` field stays metadata, as it always was
        consumed.add(_field(mapping, "tools"))
    meta = {k: v for k, v in record.items() if k not in consumed}
    meta["_source"] = source
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
