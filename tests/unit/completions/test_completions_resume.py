"""Resume (completions/resume.py): the progress file and its fingerprint."""

from __future__ import annotations

import json
import logging

from dflash_pipeline.completions import ProgressLog, _drop_other_model, _fingerprint
from dflash_pipeline.core.config import validate_config


def gen_cfg(**kw) -> dict:
    return validate_config({"generation": kw})["generation"]


def test_progress_log_round_trip_and_torn_tail(tmp_path):
    fp = {"a": 1}
    log = ProgressLog(tmp_path / "p.jsonl", fp)
    assert log.load() == {}
    log.open([{"prompt_id": "x", "status": "ok"}])
    log.append({"prompt_id": "y", "status": "ok"})
    log.close()
    with open(tmp_path / "p.jsonl", "a") as fh:
        fh.write('{"prompt_id": "z", "sta')  # a killed write
    assert set(ProgressLog(tmp_path / "p.jsonl", fp).load()) == {"x", "y"}
    assert ProgressLog(tmp_path / "p.jsonl", {"a": 2}).load() == {}  # other settings: discarded
    assert json.loads((tmp_path / "p.jsonl").read_text().splitlines()[0]) == {"header": fp}


def test_fingerprint_depends_on_what_the_backend_reads(tmp_path):
    target = tmp_path / "t"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "tokenizer.model").write_text("x")
    chat = _fingerprint("openai", gen_cfg(backend="openai"), target, None)
    assert "target" not in chat and "tokenizer" not in chat  # prompts rendered by the servers
    raw = _fingerprint("openai", gen_cfg(backend="openai", api="completions"), target, None)
    assert [f[0] for f in raw["tokenizer"]] == ["config.json", "tokenizer.model"]
    tf = _fingerprint("transformers", gen_cfg(), target, None)
    assert [f[0] for f in tf["target"]] == ["config.json"] and tf["target_dir"] == str(target.resolve())
    (tmp_path / "t.jinja").write_text("{{ x }}")
    assert len(_fingerprint("transformers", gen_cfg(), target, tmp_path / "t.jinja")["chat_template"]) == 64


def test_records_of_another_model_are_dropped(tmp_path, caplog):
    done = {"a": {"model": "m1"}, "b": {"model": "m2"}}
    with caplog.at_level(logging.WARNING, logger="dflash_pipeline.completions"):
        assert _drop_other_model(done, "m2", tmp_path / "p.jsonl")
    assert list(done) == ["b"] and "1 of 2 finished conversations" in caplog.text
    assert not _drop_other_model(done, "m2", tmp_path / "p.jsonl")
