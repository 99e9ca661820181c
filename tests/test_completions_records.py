"""Completion records (completions/records.py): record building, reasoning split, thinking checks."""

from __future__ import annotations

import pytest

from dflash_pipeline.completions import RowError, RunInfo, Turn, build_record, check_thinking, cut_at_eos, split_reasoning
from dflash_pipeline.completions.records import redact_url, sampling_params

INFO = RunInfo(model="m", sampling="{}", thinking="none")
PROMPT = {"prompt_id": "p1", "dataset": "d", "messages": [
    {"role": "system", "content": "S"}, {"role": "user", "content": "U1"}, {"role": "user", "content": "U2"}]}


def test_record_interleaves_generated_turns():
    turns = [Turn("A1", "R1", "stop", 3, 2), Turn("A2", None, "length", 5, 4)]
    rec = build_record(PROMPT, turns, INFO)
    assert [(m["role"], m["content"], m["reasoning_content"]) for m in rec["messages"]] == [
        ("system", "S", None), ("user", "U1", None), ("assistant", "A1", "R1"), ("user", "U2", None),
        ("assistant", "A2", None)]
    assert rec["status"] == "truncated" and rec["error"] is None
    assert [t["completion_tokens"] for t in rec["turns"]] == [2, 4]


def test_error_record_keeps_turns_before_the_failure():
    rec = build_record(PROMPT, [Turn("A1", None, "stop")], INFO, error="turn 2: boom")
    assert rec["status"] == "error" and rec["error"] == "turn 2: boom"
    assert [m["role"] for m in rec["messages"]] == ["system", "user", "assistant", "user"]
    assert len(rec["turns"]) == 1


def test_history_message_carries_reasoning_only_when_present():
    assert Turn("A", None, "stop").history_message() == {"role": "assistant", "content": "A"}
    assert Turn("A", "R", "stop").history_message() == {"role": "assistant", "content": "A", "reasoning_content": "R"}


def test_split_reasoning_and_cut_at_eos():
    assert split_reasoning("<think>\nR\n</think>\n\nC") == ("R", "C")
    assert split_reasoning("<think>\ncut off") == ("cut off", "")
    assert split_reasoning("plain") == (None, "plain")
    assert cut_at_eos([5, 6, 2, 0, 0], {2}) == ([5, 6, 2], True)
    assert cut_at_eos([5, 6], {2}) == ([5, 6], False)


def test_check_thinking_modes():
    assert check_thinking("none", "R", require_reasoning=True) == "R"
    assert check_thinking("save", "R", require_reasoning=True) == "R"
    assert check_thinking("disable", "  ", require_reasoning=False) is None
    with pytest.raises(RowError, match="reasoning parser"):
        check_thinking("save", None, require_reasoning=True)
    with pytest.raises(RowError, match="enable_thinking=false"):
        check_thinking("disable", "R", require_reasoning=False)


def test_sampling_params_and_redacted_urls():
    cfg = {"temperature": 0.0, "top_p": 1.0, "top_k": None, "max_tokens": 8, "seed": 0, "extra_body": {}, "api": "chat"}
    assert sampling_params(cfg) == {"temperature": 0.0, "top_p": 1.0, "top_k": None, "max_tokens": 8, "seed": 0}
    assert sampling_params({**cfg, "api": "completions", "extra_body": {"x": 1}})["api"] == "completions"
    assert redact_url("http://u:secret@h:8000/v1") == "http://h:8000/v1"
    assert redact_url("http://h/v1") == "http://h/v1"
