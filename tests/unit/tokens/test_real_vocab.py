"""Template, mask, thinking-mode, tool-call and markup tests on real vocabularies (Qwen3, DeepSeek-V3, gpt-oss:
``tests/data/tokenizers``, loaded by ``tests/real_vocab.py``), each with its family's own chat template from the
shared corpus. The byte-level stand-in runs the same invariants over every template in
``tests/unit/target/test_templates.py``; real merges and real added tokens are what these add: ``\\n\\n`` after
``</think>`` is one token, ``<think>`` and ``<tool_call>`` are single added ids the model emits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import models_dir
from real_vocab import REAL_VOCABULARIES, real_tokenizer

from dflash_pipeline.core.errors import MarkupWithoutIdsError, TokenizationError
from dflash_pipeline.target import chat
from dflash_pipeline.tokens.shard import (
    conversation_sequences,
    plain_text_tokenizer,
    tokenize_records,
    tokenize_sequences,
)

MODELS = models_dir()
if MODELS is None:
    pytest.skip("no chat templates found: set DFLASH_MODELS_DIR", allow_module_level=True)

SPECFORGE_TOOL_USE = Path(__file__).resolve().parents[2] / "data" / "specforge" / "qwen3-instruct_tool-use_ref.json"

REASONING = ["Let me think: 6 * 7 = 42.\nYes.", "Second thought, quick."]
CONTENT = ["The answer is 42.\n\nDone!", "Forty-two, `code` fine."]
#: (vocabulary, mode) -> the template fails closed (reasons in tests/unit/target/test_templates.py EXPECTED_FAILURES).
FAILS_CLOSED = {("deepseek_v3", "save")}
#: (vocabulary, mode) -> turns whose first generated token merges with the prompt's last characters under real
#: merges: DeepSeek-V3's '</think>' is no added token, and its '>' merges with the answer's 'The' ('>The'),
#: a token that straddles the boundary: 0 and counted (the byte-level stand-in never merges there).
STRADDLING = {("deepseek_v3", "disable"): {0}}


def _tok(name: str, template: str | None = None):
    return real_tokenizer(name, MODELS / (template or REAL_VOCABULARIES[name][1]))


def _conversation(thinking: str) -> list[dict]:
    def asst(k):
        return {
            "role": "assistant",
            "content": CONTENT[k],
            "reasoning_content": REASONING[k] if thinking == "save" else None,
        }

    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 6 times 7?"},
        asst(0),
        {"role": "user", "content": "And in words?"},
        asst(1),
    ]


def _runs(ids: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    runs, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


CASES = [(v, mode) for v in REAL_VOCABULARIES for mode in ("disable", "save")]


@pytest.mark.parametrize("vocab,mode", CASES, ids=[f"{v}-{m}" for v, m in CASES])
def test_supervised_tokens_are_what_the_model_emits(vocab, mode):
    """Each assistant turn's supervised tokens are exactly the real tokenizer's encoding of what follows its
    generation prompt up to and including the end-of-turn token: the model's own tokens, no straddling token,
    thinking scaffolding of the generation prompt 0; both turns once each."""
    tok = _tok(vocab)
    msgs = _conversation(mode)
    if (vocab, mode) in FAILS_CLOSED:
        with pytest.raises(TokenizationError, match="prompt_id=p1 turn="):
            conversation_sequences(tok, msgs, thinking=mode, prompt_id="p1")
        return
    seqs = conversation_sequences(tok, msgs, thinking=mode, prompt_id="p1")
    assert sorted(k for s in seqs for k in s.turns) == [0, 1]
    a_idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    straddled = STRADDLING.get((vocab, mode), set())
    for seq, (ids, mask, straddling) in zip(seqs, tokenize_sequences(tok, seqs)):
        assert straddling == len(straddled & set(seq.turns))
        assert tok.decode(ids.tolist(), skip_special_tokens=False) == seq.text
        for k, run, (s, e) in zip(seq.turns, _runs(ids, mask), seq.spans):
            emitted = seq.text[s:e]
            own = tok(emitted, add_special_tokens=False)["input_ids"]
            assert run == (own[1:] if k in straddled else own), (vocab, mode, k, emitted)
            assert CONTENT[k] in emitted and emitted.endswith(tok.decode(run[-1:], skip_special_tokens=False))
            prompt = chat.render(tok, msgs[: a_idx[k]], thinking=mode, add_generation_prompt=True)
            assert seq.text.startswith(prompt) and s == len(prompt)
            if mode == "save":
                assert REASONING[k] in emitted
            if vocab == "qwen3" and mode == "disable":  # the empty think block is in the prompt: never supervised
                assert prompt.endswith("<think>\n\n</think>\n\n") and "<think>" not in emitted


def test_qwen3_next_thinking_prefills_the_think_block():
    """The zoo's Qwen3-Next-80B-A3B-Thinking template opens '<think>\\n' in every generation prompt (as the real
    one does), so '<think>\\n' is prompt, never supervised; the reasoning after it and '</think>' are."""
    from dflash_pipeline.testing.zoo import family_template_text

    tok = _tok("qwen3")
    tok = type(tok).from_pretrained(str(Path(tok.name_or_path)))  # own copy: a different template
    tok.chat_template = family_template_text(MODELS, "Qwen3-Next-80B-A3B-Thinking")
    msgs = _conversation("save")[:3]
    for mode in ("none", "save"):
        assert chat.render(tok, msgs[:2], thinking=mode, add_generation_prompt=True).endswith(
            "<|im_start|>assistant\n<think>\n"
        )
    (seq,) = conversation_sequences(tok, msgs, thinking="save", prompt_id="p1")
    ((ids, mask, _),) = tokenize_sequences(tok, [seq])
    (run,) = _runs(ids, mask)
    think, end_think = tok.convert_tokens_to_ids(["<think>", "</think>"])
    assert think not in run and end_think in run
    assert tok.decode(run, skip_special_tokens=False) == f"{REASONING[0]}\n</think>\n\n{CONTENT[0]}<|im_end|>"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
#: What Qwen3 emits for that call (its template writes the same, arguments with json.dumps' separators).
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _tool_record(tok, *, thinking: str = "disable") -> dict:
    """A completion record of an OpenAI-format tool-calling conversation, with the output ids the model
    emitted for each assistant turn (the tool call, then the answer after the tool result)."""
    answer = "It is sunny in Paris, 22 °C."
    msgs = [
        {"role": "system", "content": "You check the weather."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": json.dumps([CALL])},
        {"role": "tool", "content": '{"temperature": 22, "condition": "sunny"}', "tool_call_id": "call_0"},
        {"role": "assistant", "content": answer},
    ]
    outs = [CALL_TEXT + "<|im_end|>", answer + "<|im_end|>"]
    return {
        "prompt_id": "tools1",
        "messages": msgs,
        "tools": json.dumps(TOOLS),
        "thinking": thinking,
        "status": "ok",
        "turns": [
            {"finish_reason": "stop", "output_token_ids": tok(o, add_special_tokens=False)["input_ids"]} for o in outs
        ],
    }


def test_tool_call_turns_supervise_exactly_the_output_ids():
    """Tools reach the template, the tool-call turn is supervised as the model's output ids (one
    <tool_call> added id, arguments, </tool_call>, <|im_end|>), the tool result never is."""
    tok = _tok("qwen3")
    rec = _tool_record(tok)
    stats: dict = {}
    rows = list(tokenize_records(tok, [rec], max_length=4096, stats=stats))
    assert stats["output_ids_spliced"] == 2 and stats["dropped"]["markup_without_ids"] == 0
    runs = [r for row in rows for r in _runs(row["input_ids"], row["loss_mask"])]
    assert runs == [t["output_token_ids"] for t in rec["turns"]]
    call_open, call_close, resp_open = tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>", "<tool_response>"])
    assert runs[0].count(call_open) == 1 and runs[0].count(call_close) == 1
    full = rows[-1]["input_ids"].tolist()
    assert resp_open in full and resp_open not in [t for r in runs for t in r]
    text = tok.decode(full, skip_special_tokens=False)
    assert '"name": "get_weather"' in text.split("<|im_end|>")[0]  # the tools block of the system turn


def test_tool_call_render_equals_the_server_render():
    """The rendered conversation is the template's own render with the tools (what a server renders)."""
    tok = _tok("qwen3")
    rec = _tool_record(tok)
    (seq, *_rest) = conversation_sequences(tok, rec["messages"], thinking="disable", tools=TOOLS, prompt_id="tools1")[
        -1:
    ]
    msgs = chat.template_messages(rec["messages"])
    want = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False, enable_thinking=False)
    assert seq.text == want and CALL_TEXT in want


def test_markup_in_answer_text_without_ids_fails_closed():
    """An answer whose text holds <tool_call> (Qwen3's added token 151657) with no output ids: refused with
    the reason, never supervised as the text pieces '<', 'tool', '_call', '>'; dropped and counted without
    strict."""
    tok = _tok("qwen3")
    rec = {
        "prompt_id": "m1",
        "messages": [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": CALL_TEXT}],
        "thinking": "disable",
        "status": "ok",
        "turns": [{"finish_reason": "stop"}],
    }
    with pytest.raises(
        MarkupWithoutIdsError,
        match=r"prompt_id=m1 turn=0: the answer holds \['</tool_call>', '<tool_call>'\].*return_token_ids",
    ):
        list(tokenize_records(tok, [rec], max_length=512))
    stats: dict = {}
    assert list(tokenize_records(tok, [rec], max_length=512, strict=False, stats=stats)) == []
    assert stats["dropped"]["markup_without_ids"] == 1
    # output ids that hold the added token: the model emitted markup, spliced as its ids
    emitted = tok(CALL_TEXT + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert 151657 in emitted
    rows = list(
        tokenize_records(
            tok, [{**rec, "turns": [{"finish_reason": "stop", "output_token_ids": emitted}]}], max_length=512
        )
    )
    assert _runs(rows[0]["input_ids"], rows[0]["loss_mask"]) == [emitted]


def test_quoted_markup_stays_text_when_ids_show_it():
    """Output ids that spell '<tool_call>' as text pieces show a quote: the answer stays text (no added id
    supervised) even when the ids cannot be spliced (the render differs from them)."""
    tok = _tok("qwen3")
    quoted = "Write " + CALL_TEXT + " to call a tool."
    plain_ids = plain_text_tokenizer(tok).encode(quoted, add_special_tokens=False).ids
    assert 151657 not in plain_ids
    msgs = [{"role": "user", "content": "How do I call a tool?"}, {"role": "assistant", "content": quoted}]
    counts: dict = {}
    (seq,) = conversation_sequences(
        tok, msgs, thinking="disable", generated_ids=[plain_ids], counts=counts, prompt_id="q1"
    )
    ((ids, mask, _),) = tokenize_sequences(tok, [seq])
    (run,) = _runs(ids, mask)
    assert counts["control_text_kept"] == 1 and 151657 not in run
    assert tok.decode(run, skip_special_tokens=False) == quoted + "<|im_end|>"
    # ids that hold the added token but do not match the render: the model emitted markup, fail closed
    with pytest.raises(MarkupWithoutIdsError, match="emitted"):
        conversation_sequences(tok, msgs, thinking="disable", generated_ids=[[151657, 151645]], prompt_id="q1")


def test_specforge_qwen3_tool_use_reference():
    """SpecForge's Qwen3 tool-use golden reference (real template and vocabulary): our ids equal it, and our
    mask equals it up to the end-of-turn newline (we do not supervise the '\\n' after <|im_end|>: the model
    stops at <|im_end|>)."""
    ref = json.loads(SPECFORGE_TOOL_USE.read_text())
    tok = _tok("qwen3")
    msgs = [
        {"role": "system", "content": "You are a helpful assistant that can search the web and check the weather."},
        {"role": "user", "content": "What's the weather like in Beijing today?"},
        {"role": "assistant", "content": "I'll check the current weather in Beijing for you."},
        {"role": "tool", "content": '{"location": "Beijing", "temperature": 22, "condition": "Sunny"}'},
        {"role": "assistant", "content": "The current weather in Beijing is sunny with a temperature of 22°C."},
        {"role": "tool", "content": '{"unit": "Celsius", "forecast": "Clear skies all day."}'},
        {"role": "user", "content": "Great! Can you also tell me if it will rain tomorrow?"},
        {
            "role": "assistant",
            "content": "Based on the forecast, there will be no rain tomorrow—expect clear skies all day.",
        },
    ]
    (seq,) = conversation_sequences(tok, msgs, thinking="disable", last_turn_only=True, prompt_id="sf")
    ((ids, mask, _),) = tokenize_sequences(tok, [seq])
    want_ids, want_mask = ref["input_ids"], ref["loss_mask"]
    assert ids.tolist() == want_ids and want_ids[-2:] == [151645, 198]
    assert mask.tolist()[:-1] == want_mask[:-1] and (mask[-1], want_mask[-1]) == (0, 1)  # the "\n" after <|im_end|>


def test_tool_call_shard_keeps_the_old_schema_for_data_without_tools(tmp_path):
    """A completion shard with tool calls is written with COMPLETION_TOOLS_SCHEMA and tokenized from disk
    (the ``tools`` column reaches the template); records without tools keep COMPLETION_SCHEMA."""
    import pyarrow.parquet as pq
    from real_vocab import unpacked_dir

    from dflash_pipeline.core import shards
    from dflash_pipeline.core.contracts import COMPLETION_SCHEMA, COMPLETION_TOOLS_SCHEMA, completion_schema
    from dflash_pipeline.tokens.shard import tokenize_shard

    tok = _tok("qwen3")
    rec = _tool_record(tok)
    base = {"dataset": "t", "model": "m", "sampling": "{}", "error": None}
    turns = [{"finish_reason": "stop", "output_token_ids": t["output_token_ids"]} for t in rec["turns"]]
    row = {**base, **rec, "turns": turns}
    plain = {k: v for k, v in row.items() if k != "tools"}
    plain["messages"] = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert (
        completion_schema([plain]) is COMPLETION_SCHEMA and completion_schema([plain, row]) is COMPLETION_TOOLS_SCHEMA
    )
    path = tmp_path / "c.parquet"
    shards.write_parquet(path, shards.table_from_records([row], COMPLETION_TOOLS_SCHEMA))
    out = tmp_path / "t.parquet"
    stats = tokenize_shard(
        path,
        out,
        target_dir=unpacked_dir("qwen3"),
        chat_template=MODELS / REAL_VOCABULARIES["qwen3"][1],
        tokens_cfg={"max_length": 4096, "last_turn_only": False},
    )
    assert stats["output_ids_spliced"] == 2
    runs = [
        r for x in pq.read_table(out).to_pylist() for r in _runs(np.array(x["input_ids"]), np.array(x["loss_mask"]))
    ]
    assert runs == [t["output_token_ids"] for t in rec["turns"]]


MARKUP = {"qwen3": "<think>", "deepseek_v3": "<｜tool▁call▁begin｜>", "gptoss": "<|channel|>"}


@pytest.mark.parametrize("vocab", list(REAL_VOCABULARIES))
def test_emittable_markup_in_text_needs_ids_on_every_vocabulary(vocab):
    """Each real vocabulary's markup token (one added id, not the eos) in an answer without output ids is
    refused; its eos token quoted alone is text (the model stops at a real one)."""
    tok = _tok(vocab)
    markup = MARKUP[vocab]
    assert len(tok(markup, add_special_tokens=False)["input_ids"]) == 1 and markup != tok.eos_token
    msgs = [{"role": "user", "content": "Tags?"}, {"role": "assistant", "content": f"Use {markup} here."}]
    with pytest.raises(MarkupWithoutIdsError, match=f"the answer holds \\['{markup}'\\]"):
        conversation_sequences(tok, msgs, thinking="disable", prompt_id="m")
    msgs[1]["content"] = f"Write {tok.eos_token} to stop."
    counts: dict = {}
    (seq,) = conversation_sequences(tok, msgs, thinking="disable", prompt_id="m", counts=counts)
    ((ids, mask, _),) = tokenize_sequences(tok, [seq])
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    assert counts["control_text_kept"] == 1 and _runs(ids, mask)[0].count(eos) <= 1
