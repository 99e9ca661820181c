"""Language filter of the prompt stage (`prompts.languages`, per-source `languages`): py3langid on the user
turns, drops counted per reason and per detected language, per-source overrides, determinism, errors."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dflash_pipeline import prompts
from dflash_pipeline.core.config import load_config
from dflash_pipeline.core.errors import ConfigError
from dflash_pipeline.prompts import (
    LANGUAGE_CODES,
    LANGUAGE_SAMPLE_CHARS,
    build_prompt_shards,
    detect_language,
    language_problems,
    language_sample,
)
from dflash_pipeline.workflow.problems import problems

pytest.importorskip("py3langid")

REPO = Path(__file__).resolve().parents[3]
DATA = REPO / "data"

ENGLISH = [
    "Can you explain how photosynthesis works in simple terms?",
    "Write a short poem about the ocean at night.",
    "What are the main differences between a list and a tuple in Python?",
    "My landlord wants to raise the rent by twenty percent. Is that legal where I live?",
]
CHINESE = ["请用简单的语言解释一下光合作用是如何进行的。", "帮我写一封邀请朋友参加生日聚会的邮件。"]
FRENCH = [
    "Pouvez-vous m'expliquer simplement comment fonctionne la photosynthèse ?",
    "Écris un court poème sur la mer la nuit, s'il te plaît.",
]
GERMAN = ["Kannst du mir erklären, wie die Photosynthese funktioniert?"]


def write_jsonl(path: Path, records) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def mixed_source(tmp_path: Path, name: str = "mixed.jsonl") -> Path:
    """Single prompts in four languages, interleaved, plus a ShareGPT conversation in French."""
    recs = []
    for i in range(4):
        recs.append({"prompt": ENGLISH[i]})
        recs.append({"prompt": [CHINESE[0], FRENCH[0], GERMAN[0], CHINESE[1]][i]})
    recs.append(
        {
            "conversations": [
                {"from": "human", "value": "Bonjour ! Quelle est la capitale de l'Australie ?"},
                {"from": "gpt", "value": "Canberra."},
                {"from": "human", "value": "Et combien d'habitants compte cette ville ?"},
            ]
        }
    )
    return write_jsonl(tmp_path / name, recs)


def user_texts(out: Path, dataset: str) -> list[str]:
    rows = [r for p in sorted((out / dataset).glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
    return [m["content"] for r in rows for m in r["messages"] if m["role"] == "user"]


def test_language_codes_are_the_installed_models_labels():
    """The list checked at config time (without loading the model) is exactly what the model can return."""
    assert LANGUAGE_CODES == set(prompts._language_identifier("test").labels)
    assert {"en", "zh", "fr", "de", "es", "ja", "ru"} <= LANGUAGE_CODES


def test_detects_real_sentences():
    for text in ENGLISH:
        assert detect_language(text)[0] == "en", text
    assert [detect_language(t)[0] for t in CHINESE + FRENCH + GERMAN] == ["zh", "zh", "fr", "fr", "de"]
    lang, prob = detect_language(FRENCH[0])
    assert lang == "fr" and 0.9 < prob <= 1.0


def test_filter_keeps_english_drops_others_and_counts_them(tmp_path):
    src = mixed_source(tmp_path)
    out = tmp_path / "out"
    m = build_prompt_shards({"mixed": {"path": str(src)}}, out, shard_size=3, seed=0, languages=["en"])
    ds = m["datasets"]["mixed"]
    assert ds["read"] == 9 and ds["kept"] == 4
    assert ds["dropped"] == {"language": 5}
    assert ds["dropped_languages"] == {"de": 1, "fr": 2, "zh": 2}
    assert ds["config"]["languages"] == ["en"] and ds["config"]["min_language_confidence"] == 0.0
    assert m["languages"] == ["en"] and m["language_detector"].startswith("py3langid ")
    assert user_texts(out, "mixed") == ENGLISH  # in source order
    assert [s["rows"] for s in ds["shards"]] == [3, 1]
    assert json.loads((out / "manifest.json").read_text()) == m


def test_allow_list_and_min_confidence(tmp_path):
    src = mixed_source(tmp_path)
    m = build_prompt_shards({"mixed": {"path": str(src)}}, tmp_path / "a", shard_size=8, seed=0, languages=["en", "zh"])
    assert m["datasets"]["mixed"]["kept"] == 6
    assert m["datasets"]["mixed"]["dropped_languages"] == {"de": 1, "fr": 2}
    assert set(user_texts(tmp_path / "a", "mixed")) == set(ENGLISH + CHINESE)

    # "What is 3 + 3?" is English, but with little evidence (p ~ 0.4): below the bar it is dropped as
    # low_language_confidence, and still counted under its detected language
    short = write_jsonl(tmp_path / "short.jsonl", [{"prompt": ENGLISH[0]}, {"prompt": "What is 3 + 3?"}])
    assert 0.2 < detect_language("What is 3 + 3?")[1] < 0.6
    m = build_prompt_shards(
        {"s": {"path": str(short)}}, tmp_path / "b", shard_size=8, seed=0, languages=["en"], min_language_confidence=0.8
    )
    ds = m["datasets"]["s"]
    assert ds["kept"] == 1 and ds["dropped"] == {"low_language_confidence": 1} and ds["dropped_languages"] == {"en": 1}
    m = build_prompt_shards({"s": {"path": str(short)}}, tmp_path / "c", shard_size=8, seed=0, languages=["en"])
    assert m["datasets"]["s"]["kept"] == 2  # default 0: the top language decides


def test_per_source_override(tmp_path):
    src = str(mixed_source(tmp_path))
    other = str(mixed_source(tmp_path, "other.jsonl"))  # same prompts: dedup applies only to kept ones
    third = str(write_jsonl(tmp_path / "third.jsonl", [{"prompt": t} for t in ["What is 3 + 3?", *GERMAN]]))
    cfg = {
        "inherits": {"path": src},  # prompts.languages: [en]
        "french": {"path": other, "languages": ["fr"]},  # its own list
        "anything": {"path": third, "languages": "any"},  # no filter
    }
    out = tmp_path / "out"
    m = build_prompt_shards(cfg, out, shard_size=8, seed=0, languages=["en"], min_language_confidence=0.5)
    ds = m["datasets"]
    assert user_texts(out, "inherits") == ENGLISH
    assert ds["inherits"]["dropped"] == {"language": 5}
    # French prompts were dropped from `inherits`, so they are not duplicates here
    assert user_texts(out, "french") == [
        FRENCH[0],
        "Bonjour ! Quelle est la capitale de l'Australie ?",
        "Et combien d'habitants compte cette ville ?",
    ]
    assert ds["french"]["dropped"] == {"duplicate": 4, "language": 3}  # the English ones were kept in `inherits`
    assert ds["french"]["config"]["languages"] == ["fr"] and ds["french"]["config"]["min_language_confidence"] == 0.5
    assert user_texts(out, "anything") == ["What is 3 + 3?", *GERMAN]  # below 0.5 and German: kept, no filter
    assert "dropped_languages" not in ds["anything"] and ds["anything"]["config"]["languages"] == "any"

    # a source's own min_language_confidence overrides the global one
    cfg = {"short": {"path": third, "languages": ["en", "de"], "min_language_confidence": 0.0}}
    m = build_prompt_shards(cfg, tmp_path / "o2", shard_size=8, seed=0, languages=["en"], min_language_confidence=0.9)
    assert m["datasets"]["short"]["kept"] == 2


def test_sample_is_user_turns_only_and_bounded():
    msgs = [
        {"role": "system", "content": "You are a helpful assistant. Always answer in English."},
        {"role": "user", "content": FRENCH[0]},
        {"role": "user", "content": FRENCH[1]},
    ]
    assert language_sample(msgs) == FRENCH[0] + "\n" + FRENCH[1]
    assert detect_language(language_sample(msgs))[0] == "fr"
    long_fr = " ".join([FRENCH[0]] * 20)
    msgs = [{"role": "user", "content": long_fr + " " + " ".join(ENGLISH * 20)}]
    assert len(language_sample(msgs)) == LANGUAGE_SAMPLE_CHARS
    assert detect_language(language_sample(msgs))[0] == "fr"  # only the beginning is read


def test_same_config_gives_byte_identical_shards(tmp_path, monkeypatch):
    cfg = {
        "mixed": {"path": str(mixed_source(tmp_path))},
        "sharegpt": {"path": str(DATA / "sharegpt" / "sharegpt.json"), "max_prompts": 50},
        "gsm8k": {"path": str(DATA / "gsm8k" / "train.jsonl"), "max_prompts": 300},
    }
    kwargs = dict(shard_size=16, seed=0, languages=["en"], min_language_confidence=0.3)
    m1 = build_prompt_shards(cfg, tmp_path / "a", **kwargs)
    monkeypatch.setattr(prompts.language, "_LANGUAGE_IDENTIFIER", None)  # a freshly loaded model decides the same
    m2 = build_prompt_shards(cfg, tmp_path / "b", **kwargs)

    def files(d):
        return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*.parquet"))}

    assert files(tmp_path / "a") == files(tmp_path / "b") and len(files(tmp_path / "a")) > 5
    assert m1 == m2
    assert m1["datasets"]["mixed"]["kept"] == 4 and m1["datasets"]["gsm8k"]["kept"] == 300


def test_unknown_language_code_names_the_key(tmp_path):
    src = str(mixed_source(tmp_path))
    with pytest.raises(ConfigError, match=r"prompts\.languages: unknown language code\(s\) \['xx'\]"):
        build_prompt_shards({"m": {"path": src}}, tmp_path / "o", shard_size=8, seed=0, languages=["en", "xx"])
    with pytest.raises(ConfigError, match=r"datasets\.m\.languages: unknown language code\(s\) \['english'\]"):
        build_prompt_shards({"m": {"path": src, "languages": ["english"]}}, tmp_path / "o", shard_size=8, seed=0)
    assert not (tmp_path / "o").exists()  # raised before anything was read or written

    # at plan time (workflow.problems, what `snakemake -n` prints): the code list by key, and the schema (shape)
    assert any(
        re.match(r"prompts\.languages: unknown language code\(s\) \['qq'\]", line)
        for line in problems({"prompts": {"languages": ["en", "qq"]}, "datasets": {"m": {"path": src}}})
    )
    with pytest.raises(ConfigError, match=r"`prompts\.languages\.0`.*'EN'.*\^\[a-z\]\{2,3\}\$"):  # the schema's pattern
        load_config(overrides={"prompts": {"languages": ["EN"]}})
    assert any(
        line.startswith("datasets.m.min_language_confidence: set, but no language filter")
        for line in problems({"datasets": {"m": {"path": src, "min_language_confidence": 0.5}}})
    )
    cfg = load_config(
        overrides={"prompts": {"languages": ["en", "zh"]}, "datasets": {"m": {"path": src, "languages": "any"}}}
    )
    assert cfg["prompts"]["min_language_confidence"] == 0.0 and cfg["datasets"]["m"]["min_language_confidence"] is None
    assert language_problems(cfg["prompts"], cfg["datasets"]) == []
    assert load_config()["prompts"]["languages"] is None  # off by default


def test_missing_py3langid_is_a_config_error_naming_key_and_install(tmp_path, monkeypatch):
    src = str(mixed_source(tmp_path))
    monkeypatch.setattr(prompts.language, "_LANGUAGE_IDENTIFIER", None)
    for mod in ("py3langid", "py3langid.langid"):
        monkeypatch.setitem(sys.modules, mod, None)  # `import py3langid` now fails
    with pytest.raises(
        ConfigError, match=r"datasets\.m\.languages needs the `py3langid` package.*dflash-pipeline\[lang\]"
    ):
        build_prompt_shards({"m": {"path": src, "languages": ["en"]}}, tmp_path / "o", shard_size=8, seed=0)
    # unconfigured: py3langid is never imported
    m = build_prompt_shards({"m": {"path": src}}, tmp_path / "o", shard_size=8, seed=0)
    assert m["datasets"]["m"]["kept"] == 9 and m["language_detector"] is None and m["languages"] is None
    assert "dropped_languages" not in m["datasets"]["m"]


def test_shard_prompts_takes_the_prompts_section(tmp_path):
    src = str(mixed_source(tmp_path))
    m = prompts.shard_prompts(
        {"m": {"path": src}},
        tmp_path / "o",
        {"shard_size": 8, "seed": 0, "languages": ["zh"], "min_language_confidence": 0.0, "special_token_text": "keep"},
    )
    assert m["datasets"]["m"]["kept"] == 2 and user_texts(tmp_path / "o", "m") == CHINESE
