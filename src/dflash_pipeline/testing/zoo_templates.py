"""Which chat template each zoo family's twin renders (its own from the corpus, else a sibling's):
shared by `testing.zoo` and `testing.zoo_extra`."""

from __future__ import annotations

from pathlib import Path

#: Families whose own chat template is not in the corpus render this sibling's.
TEMPLATE_FROM = {
    "DeepSeek-V3": "DeepSeek-V3.1",
    "Kimi-K2.5": "Kimi-K2-Thinking",
    "Meta-Llama-3.1-8B": "Llama-3.1-8B-Instruct",
    "MiniMax-M2.7": "MiniMax-M2",
    "Qwen2.5-7B": "Qwen2.5-7B-Instruct",
    "Qwen3-Next-80B-A3B-Thinking": "Qwen3-30B-A3B",  # edited: TEMPLATE_EDITS
    "Qwen3-VL-32B-Instruct": "Qwen3-VL-2B-Instruct",
    "gemma-4-26B-A4B": "gemma-3-4b-it",  # gemma-4's own template is not in the corpus
}


#: Qwen3's generation prompt: pre-fills an empty think block when `enable_thinking` is false.
_QWEN3_GENERATION_PROMPT = """{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
#: The Qwen3 "Thinking" (2507) generation prompt, which Qwen3-Next-80B-A3B-Thinking's own template has: it
#: always opens the think block (`<think>\\n`), so the model never emits that token itself.
_QWEN3_THINKING_GENERATION_PROMPT = """{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n<think>\\n' }}
{%- endif %}"""

#: Families whose sibling template (`TEMPLATE_FROM`) differs from the real one in a known place:
#: `[(text in the sibling's template, the family's own text), ...]`, each replaced exactly once.
TEMPLATE_EDITS: dict[str, list[tuple[str, str]]] = {
    "Qwen3-Next-80B-A3B-Thinking": [(_QWEN3_GENERATION_PROMPT, _QWEN3_THINKING_GENERATION_PROMPT)],
}


def family_template_text(models_dir: str | Path, family: str) -> str:
    """The chat template a family's twin renders: `family_template`'s text with the family's
    `TEMPLATE_EDITS` applied.

    Raises:
        FileNotFoundError: no template for the family. ValueError: an edit's text is not in the sibling's
            template exactly once.
    """
    path = family_template(models_dir, family)
    text = path.read_text(encoding="utf-8")
    for old, new in TEMPLATE_EDITS.get(family, []):
        if text.count(old) != 1:
            raise ValueError(f"{path}: TEMPLATE_EDITS[{family!r}] expects {old[:60]!r}... exactly once")
        text = text.replace(old, new)
    return text


def family_template(models_dir: str | Path, family: str) -> Path:
    """The chat template file a family's twin renders (its own, else `TEMPLATE_FROM`).

    Raises:
        FileNotFoundError: no template for the family (names the directories looked in).
    """
    root = Path(models_dir)
    for d in (family, TEMPLATE_FROM.get(family)):
        if d is None:
            continue
        for name in ("chat_template.jinja", "chat_template.current.jinja"):
            if (root / d / name).is_file():
                return root / d / name
    raise FileNotFoundError(f"no chat template for {family} in {root / family} or TEMPLATE_FROM")
