"""Which chat template each zoo family's twin renders (its own from the corpus, else a sibling's):
shared by :mod:`dflash_pipeline.testing.zoo` and :mod:`dflash_pipeline.testing.zoo_extra`."""

from __future__ import annotations

from pathlib import Path

#: Families whose own chat template is not in the corpus render this sibling's.
TEMPLATE_FROM = {
    "DeepSeek-V3": "DeepSeek-V3.1",
    "Kimi-K2.5": "Kimi-K2-Thinking",
    "Meta-Llama-3.1-8B": "Llama-3.1-8B-Instruct",
    "MiniMax-M2.7": "MiniMax-M2",
    "Qwen2.5-7B": "Qwen2.5-7B-Instruct",
    "Qwen3-Next-80B-A3B-Thinking": "Qwen3-30B-A3B",
    "Qwen3-VL-32B-Instruct": "Qwen3-VL-2B-Instruct",
    "gemma-4-26B-A4B": "gemma-3-4b-it",  # gemma-4's own template is not in the corpus
}


def family_template(models_dir: str | Path, family: str) -> Path:
    """The chat template file a family's twin renders (its own, else :data:`TEMPLATE_FROM`).

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
