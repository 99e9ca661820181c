"""Tokenizer loading and chat-template rendering shared by generation, tokenization and eval.

One place decides how a thinking mode maps to template kwargs, so generation and training render alike
(reference/dflash.md §4.8.5: a train/serve template mismatch is the #1 cause of low acceptance).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .errors import ConfigError

#: thinking mode -> extra kwargs passed to ``apply_chat_template`` (``chat_template_kwargs`` on servers).
THINKING_TEMPLATE_KWARGS: dict[str, dict[str, Any]] = {
    "none": {},
    "save": {"enable_thinking": True},
    "disable": {"enable_thinking": False},
}


def template_kwargs(thinking: str) -> dict[str, Any]:
    """Template kwargs for a thinking mode (``none|save|disable``).

    Raises:
        ConfigError: unknown mode (names the config key ``generation.thinking``).
    """
    try:
        return dict(THINKING_TEMPLATE_KWARGS[thinking])
    except KeyError:
        raise ConfigError(
            f"generation.thinking: unknown mode {thinking!r}; use one of {sorted(THINKING_TEMPLATE_KWARGS)}"
        ) from None


def load_tokenizer(target_dir: str | Path, *, chat_template: str | Path | None = None, trust_remote_code: bool = False):
    """Load the target's tokenizer offline; ``chat_template`` (a .jinja file) overrides its template.

    Raises:
        ConfigError: the tokenizer has no chat template and none was given (names ``target.chat_template``).
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=trust_remote_code)
    if chat_template is not None:
        tok.chat_template = Path(chat_template).read_text(encoding="utf-8")
    if not getattr(tok, "chat_template", None):
        raise ConfigError(
            f"{target_dir}: tokenizer has no chat template; set `target.chat_template` to a .jinja file"
        )
    return tok


def render(
    tokenizer,
    messages: Sequence[dict],
    *,
    thinking: str,
    add_generation_prompt: bool,
    tokenize: bool = False,
):
    """Render ``messages`` with the tokenizer's own chat template.

    Returns the rendered string (``tokenize=False``) or a list of token ids (``tokenize=True``, no extra
    special tokens are added beyond what the template writes).
    """
    msgs = [{k: v for k, v in m.items() if v is not None} for m in messages]
    text = tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs(thinking)
    )
    if not tokenize:
        return text
    return tokenizer(text, add_special_tokens=False)["input_ids"]
