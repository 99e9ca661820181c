"""Language filter of the prompt stage (`prompts.languages`, per-source `languages`): py3langid on
the user turns, the config checks of the language block (`language_problems`) and each source's
effective allow-list."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from dflash_pipeline.core.errors import ConfigError

#: Characters of a prompt's user text that the language filter classifies (see `language_sample`).
#: py3langid walks the UTF-8 bytes in Python (~0.4 ms for 500 characters), so the sample is bounded.
LANGUAGE_SAMPLE_CHARS = 500
#: Labels the model bundled with py3langid 0.4 returns: ISO 639-1 where one exists, else ISO 639-3
#: (e.g. `yue`), and `zxx` (no linguistic content). `languages` entries are checked against this
#: list at config time, without loading the model.
LANGUAGE_CODES = frozenset(
    "ace af am an ar ary arz as az ba bcl be bg bn br bs ca crh cs cy da de dz el en eo es et eu ext fa fi fo "
    "fr fuv fy ga gcf gcr gd gl gom grc gu gug guw ha hbo he hi hr ht hu hy id ig is it ja jv ka kab kik kk km "
    "kn ko ku ky la lb lg lij ln lo lt ltg lv mg mk ml mn mr ms mt my ne nl nn no nso oc om or pa pcm pl ps pt "
    "qu ro ru rw sa sdh se si sk sl sn so sq sr st sv sw ta te tg th tk tl tr tt ug uk ur uz uzs vec vi vo wa "
    "wuu xh yo yue zh zu zxx".split()
)
#: How to install the language filter's dependency (named in errors).
LANGUAGE_INSTALL = "pip install 'dflash-pipeline[lang]' (or: pip install 'py3langid>=0.4')"
#: `datasets.<name>.languages` value that turns off a language filter set in `prompts.languages`.
ANY_LANGUAGE = "any"

_LANGUAGE_IDENTIFIER = None  # loaded once per process (~1 s), only when a language filter is configured


def language_sample(messages: Sequence[Mapping[str, str]]) -> str:
    """The text the language filter classifies: the user turns' contents joined by newlines, cut to the first
    `LANGUAGE_SAMPLE_CHARS` characters."""
    return "\n".join(m["content"] for m in messages if m["role"] == "user")[:LANGUAGE_SAMPLE_CHARS]


def _language_identifier(key: str):
    """The py3langid identifier (probabilities normalized, all languages), loaded on first use.

    Raises:
        ConfigError: py3langid is not installed (names `key` and the install command).
    """
    global _LANGUAGE_IDENTIFIER
    if _LANGUAGE_IDENTIFIER is None:
        try:
            from py3langid.langid import MODEL_FILE, LanguageIdentifier
        except ImportError:
            raise ConfigError(
                f"{key} needs the `py3langid` package for language identification: {LANGUAGE_INSTALL}"
            ) from None
        # an identifier of our own: py3langid's module-level one can be restricted by other code (set_languages)
        _LANGUAGE_IDENTIFIER = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    return _LANGUAGE_IDENTIFIER


def _language_detector() -> str:
    """`"py3langid <version>"`, recorded in the manifest (the model ships in the wheel: version = model)."""
    import importlib.metadata

    try:
        return f"py3langid {importlib.metadata.version('py3langid')}"
    except importlib.metadata.PackageNotFoundError:
        return "py3langid"


def detect_language(text: str, *, key: str = "prompts.languages") -> tuple[str, float]:
    """Most likely language of `text` and its probability in [0, 1], by py3langid's bundled model. Deterministic for a
    given install.

    Args:
        key: config key named in the error when py3langid is missing.

    Raises:
        ConfigError: py3langid is not installed.
    """
    lang, prob = _language_identifier(key).classify(text)
    return lang, prob


def language_problems(prompts_cfg: Mapping[str, Any], datasets: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Problems with the language-filter settings, each naming its config key (empty when fine): unknown language
    codes (not in `LANGUAGE_CODES`), an empty list, a confidence outside [0, 1], or a source's `min_language_confidence`
    with no language filter applying to that source."""
    problems: list[str] = []

    def check_codes(key: str, value: Any, allow_any: bool) -> None:
        if value is None or (allow_any and value == ANY_LANGUAGE):
            return
        if isinstance(value, str) or not isinstance(value, Sequence) or not value:
            problems.append(
                f"{key}: expected a non-empty list of language codes such as [en, zh]"
                + (f" (or `{ANY_LANGUAGE}` for no filter on this source)" if allow_any else "")
                + f", got {value!r}"
            )
            return
        unknown = [c for c in value if c not in LANGUAGE_CODES]
        if unknown:
            problems.append(
                f"{key}: unknown language code(s) {unknown}; py3langid knows ISO 639-1 codes such as "
                f"en, zh, fr, de, es, ja, ru (full list: dflash_pipeline.prompts.LANGUAGE_CODES)"
            )

    def check_conf(key: str, value: Any) -> None:
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1
        ):
            problems.append(f"{key}: expected a probability in [0, 1], got {value!r}")

    check_codes("prompts.languages", prompts_cfg.get("languages"), allow_any=False)
    check_conf("prompts.min_language_confidence", prompts_cfg.get("min_language_confidence"))
    for name, src in datasets.items():
        check_codes(f"datasets.{name}.languages", src.get("languages"), allow_any=True)
        check_conf(f"datasets.{name}.min_language_confidence", src.get("min_language_confidence"))
        if (
            src.get("min_language_confidence") is not None
            and _source_languages(prompts_cfg.get("languages"), name, src)[0] is None
        ):
            problems.append(
                f"datasets.{name}.min_language_confidence: set, but no language filter applies to this "
                f"source (set `datasets.{name}.languages` or `prompts.languages`)"
            )
    return problems


def _source_languages(default: Sequence[str] | None, name: str, src: Mapping[str, Any]) -> tuple[list[str] | None, str]:
    """`(allow-list or None, config key)` of source `name`."""
    own = src.get("languages")
    if own == ANY_LANGUAGE:
        return None, f"datasets.{name}.languages"
    if own is not None:
        return list(own), f"datasets.{name}.languages"
    return (list(default) if default else None), "prompts.languages"
