"""Tokenizer probing: load the target's tokenizer as the pipeline will (fast, sentencepiece, tiktoken or
remote code) and record its facts. A tokenizer that cannot load is refused with the fix: the package to
install (and add to `PROBE_ENV_FILE`) or `target.trust_remote_code`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from dflash_pipeline.core.errors import ProbeError
from dflash_pipeline.target.chat import _tokenizer_auto_map, tokenizer_files_missing

THINK_MARKERS = ("<think>", "</think>")
#: conda env of the probe rule (named in "install X" errors).
PROBE_ENV_FILE = "envs/probe.yaml"


def _tokenizer_error(target_dir: Path, exc: Exception, trust_remote_code: bool) -> ProbeError:
    msg = " ".join(str(exc).split())
    low = msg.lower()
    if isinstance(exc, ImportError) or "no module named" in low or ("requires the" in low and "librar" in low):
        missing = getattr(exc, "name", None) or (
            "tiktoken" if "tiktoken" in low else "sentencepiece" if "sentencepiece" in low else None
        )
        pkg = missing or "the missing package"
        return ProbeError(
            f"{target_dir}: loading the tokenizer needs the Python package `{pkg}` ({msg[:200]}); "
            f"install it (`pip install {pkg}`, or `pip install dflash-pipeline[tiktoken]`) and add it to "
            f"{PROBE_ENV_FILE}"
        )
    if "trust_remote_code" in low and not trust_remote_code:
        return ProbeError(
            f"{target_dir}: the tokenizer is defined by code shipped with the model (auto_map in "
            "tokenizer_config.json); review it and set `target.trust_remote_code: true` "
            f"(CLI: --trust-remote-code) to allow it ({msg[:200]})"
        )
    return ProbeError(f"{target_dir}: AutoTokenizer failed: {type(exc).__name__}: {msg[:400]}")


def _vocab_file_kind(path: Path) -> str | None:
    """`"tiktoken"` for a tiktoken BPE ranks file (lines `<base64 token> <rank>`), `"sentencepiece"`
    for a binary sentencepiece model (a protobuf), None when unreadable. Both are often named `*.model`."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return None
    if not head:
        return None
    first = head.split(b"\n", 1)[0]
    if re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+\r?", first):
        return "tiktoken"
    return "sentencepiece"


def _vocab_file(tok: Any, target_dir: Path) -> Path | None:
    """The file the tokenizer's vocabulary came from: `tokenizer.json` when present, else the class's
    `vocab_file` (`tokenizer.model`, `tiktoken.model`, `vocab.json` ...)."""
    if (target_dir / "tokenizer.json").is_file():
        return target_dir / "tokenizer.json"
    vf = getattr(tok, "vocab_file", None) or (getattr(tok, "init_kwargs", None) or {}).get("vocab_file")
    if isinstance(vf, (str, os.PathLike)) and Path(vf).is_file():
        return Path(vf)
    return None


def _backend(tok: Any, vocab_file: Path | None) -> str:
    """Where the tokenization rules come from: `tiktoken`, `sentencepiece`, `fast` (`tokenizer.json`), `python` (any
    other slow tokenizer)."""
    mods = type(tok).__module__ + " " + " ".join(type(v).__module__ for v in vars(tok).values() if v is not None)
    if "tiktoken" in mods:
        return "tiktoken"
    if getattr(tok, "sp_model", None) is not None or "sentencepiece" in mods:
        return "sentencepiece"
    if vocab_file is not None and vocab_file.name != "tokenizer.json" and vocab_file.suffix in (".model", ".tiktoken"):
        kind = _vocab_file_kind(vocab_file)
        if kind is not None:
            return kind
    return "fast" if getattr(tok, "is_fast", False) else "python"


def _check_sentencepiece_deps(target_dir: Path) -> None:
    """A sentencepiece `tokenizer.model` without `tokenizer.json` is converted by transformers, which
    needs `sentencepiece` and `protobuf`; without them it silently falls back to a tiktoken parser and
    fails with an unrelated message. Say what to install instead."""
    if (target_dir / "tokenizer.json").is_file() or _tokenizer_auto_map(target_dir):
        return
    model = next(
        (
            target_dir / n
            for n in ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
            if (target_dir / n).is_file()
        ),
        None,
    )
    if model is None or _vocab_file_kind(model) != "sentencepiece":
        return
    missing = []
    for module, pkg in (("sentencepiece", "sentencepiece"), ("google.protobuf", "protobuf")):
        try:
            __import__(module)
        except ImportError:
            missing.append(pkg)
    if missing:
        pkgs = " ".join(missing)
        raise ProbeError(
            f"{model}: a sentencepiece model without tokenizer.json; loading it needs the Python package(s) "
            f"{', '.join(f'`{m}`' for m in missing)}; install them (`pip install {pkgs}`, or "
            f"`pip install dflash-pipeline[sentencepiece]`) and add them to {PROBE_ENV_FILE}"
        )


def _load_tokenizer(target_dir: Path, *, trust_remote_code: bool, config: Any = None) -> Any:
    """`AutoTokenizer` of `target_dir` (offline), refused with the fix when it cannot load.

    `config` is the `AutoConfig` the probe already loaded (None when it could not): it is handed to `AutoTokenizer` so
    that a config whose own remote code is absent does not stop the tokenizer from loading.

    Raises:
        ProbeError: remote tokenizer code without `trust_remote_code`, a missing package (names it and
            `PROBE_ENV_FILE`), any other load failure, or a tokenizer of under 16 tokens (incomplete files).
    """
    auto_map = _tokenizer_auto_map(target_dir)
    if auto_map and not trust_remote_code:
        # transformers 5 does not refuse here: it silently builds an empty tokenizer instead
        raise ProbeError(
            f"{target_dir}: the tokenizer is defined by code shipped with the model (tokenizer_config.json "
            f"auto_map AutoTokenizer={auto_map}); review that code and set `target.trust_remote_code: true` "
            "(CLI: --trust-remote-code) to allow it"
        )
    _check_sentencepiece_deps(target_dir)
    try:
        from transformers import AutoTokenizer, PretrainedConfig

        tok = AutoTokenizer.from_pretrained(
            str(target_dir),
            trust_remote_code=trust_remote_code,
            local_files_only=True,
            config=config if config is not None else PretrainedConfig(),
        )
    except Exception as exc:  # noqa: BLE001 - translated into a message that names the fix
        raise _tokenizer_error(target_dir, exc, trust_remote_code) from exc
    if len(tok) < 16:
        raise ProbeError(
            f"{target_dir}: AutoTokenizer built a tokenizer with only {len(tok)} tokens — the tokenizer files are "
            "incomplete (copy tokenizer.json or the vocabulary file from the model repository)"
        )
    return tok


def _chat_template(tok: Any, chat_template: str | os.PathLike | None) -> tuple[str | None, str | None]:
    """`(template text, source)`: the `chat_template` override file when given, else the tokenizer's
    own template (source `"tokenizer"`); `(None, None)` when there is neither."""
    template, template_src = (
        getattr(tok, "chat_template", None),
        "tokenizer" if getattr(tok, "chat_template", None) else None,
    )
    if chat_template is not None:
        template, template_src = Path(chat_template).read_text(encoding="utf-8"), f"override ({chat_template})"
    return template, template_src


def _thinking_markers(vocab: dict) -> dict | None:
    """`{open: {token, id}, close: {token, id}}` of `THINK_MARKERS`, None when neither is a token."""
    markers = {}
    for name, m in zip(("open", "close"), THINK_MARKERS):
        markers[name] = {"token": m, "id": vocab.get(m)}
    return markers if any(v["id"] is not None for v in markers.values()) else None


def _probe_tokenizer(
    target_dir: Path, *, trust_remote_code: bool, chat_template: str | os.PathLike | None, config: Any = None
) -> dict:
    """Tokenizer facts; raises ProbeError (what to install / set) when the files exist but cannot load.

    `config` is the `AutoConfig` the probe already loaded (None when it could not), handed to `AutoTokenizer`."""
    tok = _load_tokenizer(target_dir, trust_remote_code=trust_remote_code, config=config)
    cls = type(tok)
    remote = not cls.__module__.startswith("transformers.")
    template, template_src = _chat_template(tok, chat_template)
    vocab = tok.get_vocab()
    vocab_file = _vocab_file(tok, target_dir)
    return {
        "present": True,
        "missing_reason": None,
        "class": cls.__name__,
        "module": cls.__module__,
        "backend": _backend(tok, vocab_file),
        "runtime": "tokenizers" if getattr(tok, "is_fast", False) else "python",
        "vocab_file": vocab_file.name if vocab_file is not None else None,
        "len": len(tok),
        "base_vocab_size": getattr(tok, "vocab_size", None),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "eos_token_ids_tokenizer": [tok.eos_token_id] if tok.eos_token_id is not None else [],
        "pad_token_id": tok.pad_token_id,
        "unk_token_id": tok.unk_token_id,
        "mask_token": tok.mask_token if getattr(tok, "mask_token", None) else None,
        "mask_token_id": vocab.get(str(tok.mask_token)) if getattr(tok, "mask_token", None) else None,
        "chat_template": template is not None,
        "chat_template_source": template_src,
        "template_uses_thinking": bool(template and ("enable_thinking" in template or "<think>" in template)),
        "thinking_markers": _thinking_markers(vocab),
        "remote_code": remote,
        "trust_remote_code_used": bool(trust_remote_code and remote),
        "model_max_length": (
            int(tok.model_max_length)
            if getattr(tok, "model_max_length", None) and tok.model_max_length < 1e12
            else None
        ),
    }


def _tokenizer_facts(
    target_dir: Path,
    *,
    trust_remote_code: bool,
    chat_template: str | os.PathLike | None,
    config: Any,
    strict: bool,
    warnings: list[str],
) -> dict:
    """The record's `tokenizer`: `_probe_tokenizer` when the tokenizer files are there; else
    (`strict` False) `{present: false, missing_reason}` with the reason appended to `warnings`.

    Raises:
        ProbeError: the tokenizer files are missing (`strict`), or they do not load (see `_load_tokenizer`).
    """
    missing = tokenizer_files_missing(target_dir)
    if missing is None:
        return _probe_tokenizer(
            target_dir, trust_remote_code=trust_remote_code, chat_template=chat_template, config=config
        )
    if not strict:
        warnings.append(missing)
        return {"present": False, "missing_reason": missing}
    raise ProbeError(
        f"{missing}; the pipeline renders chat templates and picks the mask token with the target's "
        "tokenizer — copy the tokenizer files into the target directory"
    )
