"""Completion records (completions/records.py): record building, reasoning split, thinking checks."""

from __future__ import annotations

import json

import pytest

from dflash_pipeline.completions import (
    RowError,
    RunInfo,
    Turn,
    build_record,
    check_thinking,
    cut_at_eos,
    split_reasoning,
)
from dflash_pipeline.completions.records import redact_url, sampling_params

INFO = RunInfo(model="m", sampling="{}", thinking="none")
PROMPT = {
    "prompt_id": "p1",
    "dataset": "d",
    "messages": [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "user", "content": "U2"},
    ],
}


def test_record_interleaves_generated_turns():
    turns = [Turn("A1", "R1", "stop", 3, 2), Turn("A2", None, "length", 5, 4)]
    rec = build_record(PROMPT, turns, INFO)
    assert [(m["role"], m["content"], m["reasoning_content"]) for m in rec["messages"]] == [
        ("system", "S", None),
        ("user", "U1", None),
        ("assistant", "A1", "R1"),
        ("user", "U2", None),
        ("assistant", "A2", None),
    ]
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
    # an answer quoting </think> is resent with empty reasoning, so the server's template keeps it whole
    assert Turn("x </think> y", None, "stop").history_message()["reasoning_content"] == ""


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


def test_reasoning_only_where_it_is():
    """Issue #18: a `</think>` later in an answer is answer text; thinking=disable never splits; the
    server's reasoning field is taken as it is."""
    from dflash_pipeline.completions import take_reasoning

    explains = "The tag <think></think> does nothing; `</think>` closes reasoning."
    assert split_reasoning(explains) == (None, explains)
    assert split_reasoning("A </think> B") == (None, "A </think> B")
    assert split_reasoning("R</think>\n\nC </think> D", opened=True) == ("R", "C </think> D")
    assert split_reasoning("<think>\nR\n</think>\n\nC </think> D") == ("R", "C </think> D")
    for mode in ("none", "save", "disable"):
        assert take_reasoning(explains, mode) == (None, explains)
        assert take_reasoning("<think>x</think>", mode, field="R") == ("R", "<think>x</think>")
    # disable: the content verbatim (an empty leading block included); real reasoning is returned so that
    # check_thinking rejects the row
    assert take_reasoning("<think>\n\n</think>\n\nC", "disable") == (None, "<think>\n\n</think>\n\nC")
    assert take_reasoning("<think>\nR\n</think>\n\nC", "disable")[0] == "R"
    with pytest.raises(RowError, match="thinking=disable"):
        check_thinking("disable", take_reasoning("<think>\nR\n</think>\n\nC", "disable")[0], require_reasoning=False)
    assert check_thinking("disable", take_reasoning(explains, "disable")[0], require_reasoning=False) is None


ANSWER = "Chat templates: the tag <think></think> does nothing here, and `</think>` ends a block."


class _Ep:
    url = "http://127.0.0.1:1/v1"


def _openai_backend(thinking: str, api: str = "chat", opened: bool = False):
    from dflash_pipeline.completions.openai_backend import OpenAIBackend

    b = OpenAIBackend.__new__(OpenAIBackend)  # parsing only: no fleet, no tokenizer
    b.cfg, b.api, b._opens_think = {"thinking": thinking}, api, opened
    return b


@pytest.mark.parametrize("thinking", ["none", "disable", "save"])
def test_answer_with_think_tags_keeps_every_character_chat_raw_transformers(thinking):
    """Issue #18: in chat, raw (/v1/completions) and transformers modes an answer containing `</think>` is
    stored verbatim; with a reasoning field (vLLM `reasoning`, SGLang `reasoning_content`) or a leading
    think block the reasoning is taken from there and the answer is still verbatim."""
    from dflash_pipeline.completions.transformers_backend import TransformersBackend

    chat = _openai_backend(thinking)
    if thinking == "save":  # chat mode needs the server's reasoning field for save
        for field in ("reasoning", "reasoning_content"):
            resp = {"choices": [{"message": {"content": ANSWER, field: "R"}, "finish_reason": "stop"}]}
            turn = chat._parse(resp, 0.1, _Ep())
            assert (turn.reasoning_content, turn.content) == ("R", ANSWER)
    else:
        turn = chat._parse({"choices": [{"message": {"content": ANSWER}, "finish_reason": "stop"}]}, 0.1, _Ep())
        assert (turn.reasoning_content, turn.content) == (None, ANSWER)
    text = ("<think>\nR\n</think>\n\n" if thinking == "save" else "") + ANSWER
    raw = _openai_backend(thinking, api="completions")
    turn = raw._parse_text({"choices": [{"text": text, "finish_reason": "stop"}]}, 0.1, _Ep())
    assert turn.content == ANSWER and turn.reasoning_content == ("R" if thinking == "save" else None)
    if thinking == "save":  # a generation prompt that opened <think>: reasoning up to the first </think>
        turn = _openai_backend("save", api="completions", opened=True)._parse_text(
            {"choices": [{"text": "R\n</think>\n\n" + ANSWER, "finish_reason": "stop"}]}, 0.1, _Ep()
        )
        assert (turn.reasoning_content, turn.content) == ("R", ANSWER)

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return text

    tb = TransformersBackend.__new__(TransformersBackend)
    tb.cfg, tb.tok, tb.eos_ids, tb._opens_think = {"thinking": thinking}, Tok(), [2], False
    turn = tb._turn([1, 1], [5, 6, 2], 0.1)
    assert turn.content == ANSWER and turn.reasoning_content == ("R" if thinking == "save" else None)


def test_same_tool_calls_compares_names_and_parsed_arguments():
    from dflash_pipeline.completions.records import same_tool_calls

    def call(name, args, cid="c0"):
        return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}

    a = [call("get_weather", '{"city": "Paris", "unit": "C"}')]
    assert same_tool_calls(a, [call("get_weather", '{"unit":"C","city":"Paris"}', cid="other")])
    assert same_tool_calls(json.dumps(a), [call("get_weather", {"city": "Paris", "unit": "C"})])
    assert not same_tool_calls(a, [call("get_weather", '{"city": "Lyon", "unit": "C"}')])
    assert not same_tool_calls(a, [call("get_time", '{"city": "Paris", "unit": "C"}')])
    assert not same_tool_calls(a, a + a) and not same_tool_calls(a, None)
    assert same_tool_calls(None, "[]")
