"""Tokenizer loading and chat-template rendering shared by generation, tokenization and eval.

One place maps a run's settings onto the chat template, so generation and training render alike
(reference/dflash.md §4.8.5: a train/serve template mismatch is the #1 cause of low acceptance):
`template_kwargs` (thinking mode → `enable_thinking` and `thinking`), `template_messages` (completion
messages → what a template sees) and `render` / `render_many` (exactly
`apply_chat_template(tokenize=False)`, without its per-call overhead;
`tests/unit/target/test_templates.py` checks the equality on every real template).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from dflash_pipeline.core.errors import ConfigError

#: Files that carry a tokenizer's vocabulary (`tokenizer_config.json` alone does not: transformers then
#: builds an empty tokenizer). A `tokenizer_config.json` with `auto_map` (remote code) also counts.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def _tokenizer_auto_map(target_dir: Path) -> Any:
    """`auto_map["AutoTokenizer"]` of tokenizer_config.json (remote tokenizer code), else None."""
    try:
        tc = json.loads((target_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        return (tc.get("auto_map") or {}).get("AutoTokenizer") if isinstance(tc, dict) else None
    except (OSError, ValueError, AttributeError):
        return None


def tokenizer_files_missing(target_dir: Path) -> str | None:
    """None when the directory holds a loadable tokenizer's files, else why not (for the record)."""
    if any((target_dir / f).is_file() for f in TOKENIZER_FILES) or any(target_dir.glob("*.tiktoken")):
        return None
    tc = target_dir / "tokenizer_config.json"
    if tc.is_file():
        if _tokenizer_auto_map(target_dir):
            return None
        return (
            f"tokenizer_config.json without a vocabulary file ({', '.join(TOKENIZER_FILES)}, *.tiktoken) "
            f"in {target_dir}"
        )
    return f"no tokenizer files ({', '.join(TOKENIZER_FILES)}, *.tiktoken) in {target_dir}"


#: thinking mode -> extra kwargs passed to the chat template (`chat_template_kwargs` on servers).
THINKING_TEMPLATE_KWARGS: dict[str, dict[str, Any]] = {
    "none": {},
    "save": {"enable_thinking": True, "thinking": True},
    "disable": {"enable_thinking": False, "thinking": False},
}


def template_kwargs(thinking: str) -> dict[str, Any]:
    """Template kwargs for a thinking mode (`none|save|disable`).

    Raises:
        ConfigError: unknown mode (names the config key `generation.thinking`).
    """
    try:
        return dict(THINKING_TEMPLATE_KWARGS[thinking])
    except KeyError:
        raise ConfigError(
            f"generation.thinking: unknown mode {thinking!r}; use one of {sorted(THINKING_TEMPLATE_KWARGS)}"
        ) from None


def template_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict]:
    """Messages as the chat template sees them: `{role, content}` (`None` content -> `""`), plus
    `thinking` and `reasoning_content` on assistant turns whose reasoning is non-empty (gpt-oss
    templates read `thinking`, Qwen3-style ones `reasoning_content`), `tool_calls` on assistant turns
    that called tools and `tool_call_id` / `name` on `tool` results (`tool_calls_of`). Other keys
    are dropped.

    An assistant turn without reasoning whose content contains `</think>` (an answer that explains chat
    templates) gets `reasoning_content: ""`: Qwen3/3.5/3.6 and GLM templates otherwise take everything
    before that `</think>` for reasoning and drop it from the answer; with an empty string they render
    the turn exactly as one without reasoning, content verbatim."""
    out = []
    for m in messages:
        msg = {"role": m["role"], "content": m.get("content") or ""}
        rc = m.get("reasoning_content")
        if m["role"] == "assistant" and isinstance(rc, str) and rc.strip():
            msg = {"thinking": rc, **msg, "reasoning_content": rc}  # the key order transformers uses
        elif m["role"] == "assistant" and "</think>" in msg["content"]:
            msg["reasoning_content"] = ""
        calls = tool_calls_of(m) if m["role"] == "assistant" else None
        if calls:
            msg["tool_calls"] = calls
        if m["role"] == "tool":
            for key in ("tool_call_id", "name"):
                if m.get(key):
                    msg[key] = m[key]
        out.append(msg)
    return out


def tool_calls_of(message: Mapping[str, Any]) -> list[dict] | None:
    """A message's tool calls in the OpenAI shape `[{"id", "type": "function", "function": {"name", "arguments"}}]`
    with `arguments` parsed into an object. `tool_calls` may be a list or its JSON text (the shard column); None when
    the message has none.

    Raises:
        ValueError: `tool_calls` is not a list of calls with a function name (names the field).
    """
    calls = message.get("tool_calls")
    if isinstance(calls, str):
        calls = json.loads(calls) if calls.strip() else None
    if not calls:
        return None
    if not isinstance(calls, list):
        raise ValueError(f"field `tool_calls`: expected a list of calls, got {type(calls).__name__}")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"field `tool_calls[{i}]`: expected {{function: {{name, arguments}}}}, got {call!r}")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # not JSON: the text the model wrote, rendered as it is
        entry = {"type": call.get("type") or "function", "function": {"name": fn["name"], "arguments": args}}
        if call.get("id"):
            entry = {"id": call["id"], **entry}
        out.append(entry)
    return out


def tools_of(value: Any) -> list[dict] | None:
    """The function schemas offered to the model (`tools` of a record: a list or its JSON text), or None."""
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else None
    return list(value) if value else None


def load_tokenizer(target_dir: str | Path, *, chat_template: str | Path | None = None, trust_remote_code: bool = False):
    """Load the target's tokenizer offline; `chat_template` (a .jinja file) overrides its template.

    Raises:
        ConfigError: the tokenizer has no chat template and none was given (names `target.chat_template`).
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=trust_remote_code)
    except AttributeError:  # a config.json transformers cannot read (e.g. remote-code kimi_k2): tokenizer files decide
        from transformers import PretrainedConfig

        tok = AutoTokenizer.from_pretrained(
            str(target_dir), trust_remote_code=trust_remote_code, config=PretrainedConfig()
        )
    if chat_template is not None:
        tok.chat_template = Path(chat_template).read_text(encoding="utf-8")
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"{target_dir}: tokenizer has no chat template; set `target.chat_template` to a .jinja file")
    return tok


def _compiled_template(tokenizer):
    """`(compiled template, special-token variables)` for the tokenizer's current template, cached on the tokenizer;
    None when the fast path does not apply (several named templates, or a transformers without the compiler), then
    callers use `apply_chat_template`."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    specials = dict(tokenizer.special_tokens_map)
    cached = getattr(tokenizer, "_dflash_compiled_template", None)
    if cached is not None and cached[0] == template and cached[2] == specials:
        return cached[1], cached[2]
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # transformers moved its compiler: fall back to apply_chat_template
        return None
    compiled = _compile_jinja_template(template)  # transformers' sandboxed environment, lru-cached
    try:
        tokenizer._dflash_compiled_template = (template, compiled, specials)
    except AttributeError:
        pass
    return compiled, specials


def render_many(
    tokenizer,
    conversations: Sequence[Sequence[Mapping[str, Any]]],
    *,
    thinking: str,
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[str]:
    """Render each conversation with the tokenizer's own chat template, messages passed through `template_messages`,
    `tools` (function schemas, the same for every conversation) as the template's `tools` variable."""
    kwargs = template_kwargs(thinking)
    tools = list(tools) if tools else None
    fast = _compiled_template(tokenizer)
    if fast is None:
        return [
            tokenizer.apply_chat_template(
                template_messages(c),
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
            for c in conversations
        ]
    compiled, specials = fast
    variables = {**specials, **kwargs}  # as apply_chat_template: kwargs override special tokens
    return [
        compiled.render(
            messages=template_messages(c),
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        for c in conversations
    ]


def render(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    thinking: str,
    add_generation_prompt: bool,
    tokenize: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
):
    """Render `messages` with the tokenizer's own chat template (see `render_many`).

    Returns the rendered string (`tokenize=False`) or a list of token ids (`tokenize=True`, no extra
    special tokens are added beyond what the template writes).
    """
    text = render_many(
        tokenizer, [messages], thinking=thinking, add_generation_prompt=add_generation_prompt, tools=tools
    )[0]
    if not tokenize:
        return text
    return tokenizer(text, add_special_tokens=False)["input_ids"]
