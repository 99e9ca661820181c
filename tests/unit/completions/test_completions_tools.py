"""Tool calls end to end: prompt sources with ``tools``, tool calls and tool results (OpenAI, ShareGPT
``function_call``/``observation`` and SpecForge formats) -> prompt shards -> completions against the test
server (``tools`` sent, tool calls regenerated with their output ids) -> tokens (the supervised ids are the
server's output ids, tool-call markup included); the divergence rule and its counter; tool-free shards keep
their schema and bytes."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import models_dir
from real_vocab import unpacked_dir

from dflash_pipeline.completions import generate_shard
from dflash_pipeline.completions.records import Dialogue, RunInfo, Turn, build_record
from dflash_pipeline.core import contracts, shards
from dflash_pipeline.core.config import validate_config
from dflash_pipeline.prompts import build_prompt_shards
from dflash_pipeline.target import chat
from dflash_pipeline.testing.server import Faults, start_test_server
from dflash_pipeline.tokens.shard import tokenize_records

MODELS = models_dir()

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    }
]


def _call(query: str, call_id: str = "c1") -> dict:
    args = json.dumps({"query": query})
    return {"id": call_id, "type": "function", "function": {"name": "search", "arguments": args}}


def _openai(question: str, called: str, answer_tail: list[dict] | None = None) -> dict:
    """An OpenAI-format record: the user asks, the assistant searches ``called``, the tool answers, the
    assistant answers (then ``answer_tail``)."""
    return {
        "messages": [
            {"role": "system", "content": "You can search."},
            {"role": "user", "content": question},
            {"role": "assistant", "content": "Let me search.", "tool_calls": [_call(called)]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"hits": 3}'},
            {"role": "assistant", "content": "Three hits."},
            *(answer_tail or []),
        ],
        "tools": TOOLS,
    }


def _write_jsonl(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return path


def _gen_cfg(url: str, **kw) -> dict:
    eps = [{"base_url": url, "max_concurrency": 2}]
    cfg = {"backend": "openai", "endpoints": eps, "extra_body": {"return_token_ids": True}, "thinking": "disable"}
    return validate_config({"generation": {**cfg, "request_timeout_s": 10.0, **kw}})["generation"]


def _qwen3_dir(tmp_path: Path) -> Path:
    """Qwen3's real vocabulary with Qwen3-8B's chat template (tools, <tool_call> as an added token)."""
    if MODELS is None:
        pytest.fail("no chat templates found: set DFLASH_MODELS_DIR")
    d = tmp_path / "qwen3"
    shutil.copytree(unpacked_dir("qwen3"), d)
    shutil.copy(MODELS / "Qwen3-8B" / "chat_template.jinja", d / "chat_template.jinja")
    return d


# ---------------------------------------------------------------------------------------------- prompts


def test_prompt_sources_keep_tools_calls_and_results_in_three_formats(tmp_path):
    """OpenAI messages, ShareGPT function_call/observation (LLaMA-Factory: bare function schemas as JSON text)
    and SpecForge's conversations of role/content/tool_calls all give the same normalized tool conversation."""
    openai_rec = _openai("Find DFlash", "DFlash")
    sharegpt = {
        "conversations": [
            {"from": "system", "value": "You can search."},
            {"from": "human", "value": "Find DFlash"},
            {"from": "function_call", "value": json.dumps({"name": "search", "arguments": {"query": "DFlash"}})},
            {"from": "observation", "value": '{"hits": 3}'},
            {"from": "gpt", "value": "Three hits."},
        ],
        "tools": json.dumps([TOOLS[0]["function"]]),
    }
    specforge = {"id": "sf1", "conversations": openai_rec["messages"], "tools": json.dumps(TOOLS)}
    m = build_prompt_shards(
        {
            "o": {"path": str(_write_jsonl(tmp_path / "o.jsonl", [openai_rec]))},
            "s": {"path": str(_write_jsonl(tmp_path / "s.jsonl", [sharegpt]))},
            "f": {"path": str(_write_jsonl(tmp_path / "f.jsonl", [specforge]))},
        },
        tmp_path / "out",
        shard_size=4,
        seed=0,
    )
    rows = {}
    for name in ("o", "s"):  # f: the same conversation as o (below)
        table = pq.read_table(tmp_path / "out" / name / "00000.parquet")
        assert table.schema.remove_metadata().equals(contracts.PROMPT_TOOLS_SCHEMA)
        (rows[name],) = table.to_pylist()
    assert json.loads(rows["o"]["tools"]) == TOOLS == json.loads(rows["s"]["tools"])
    roles = [msg["role"] for msg in rows["o"]["messages"]]
    assert roles == ["system", "user", "assistant", "tool"]  # the text answer is regenerated, not kept
    call = json.loads(rows["o"]["messages"][2]["tool_calls"])
    assert call[0]["function"]["name"] == "search" and rows["o"]["messages"][2]["content"] == ""
    assert rows["o"]["messages"][3]["tool_call_id"] == "c1"
    # OpenAI and SpecForge are one conversation (deduplicated as such); ShareGPT has no call id
    assert m["datasets"]["f"]["dropped"] == {"duplicate": 1}
    assert rows["o"]["prompt_id"] == contracts.prompt_id(rows["o"]["messages"], rows["o"]["tools"])
    assert [msg["role"] for msg in rows["s"]["messages"]] == roles
    assert json.loads(rows["s"]["messages"][2]["tool_calls"])[0]["function"]["arguments"] == {"query": "DFlash"}
    assert "tools" not in json.loads(rows["o"]["metadata"])


def test_bad_tool_records_are_dropped_naming_file_record_and_field(tmp_path):
    recs = [
        {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "orphan"}]},
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"function": {}}]}]},
        {"messages": [{"role": "user", "content": "x"}], "tools": "not json"},
        {
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "tool_calls": [_call("q")]},
                {"role": "user", "content": "y"},
            ]
        },
        {"messages": [{"role": "user", "content": "fine"}]},
    ]
    src = _write_jsonl(tmp_path / "t.jsonl", recs)
    m = build_prompt_shards({"t": {"path": str(src)}}, tmp_path / "out", shard_size=4, seed=0)
    ds = m["datasets"]["t"]
    assert ds["kept"] == 1 and ds["dropped"] == {"bad_tool_turns": 4}
    assert ds["skipped_examples"] == [
        f"{src}: line 1: bad_tool_turns: `messages[1]` is a tool result that answers no tool call of an assistant "
        "turn before it",
        f"{src}: line 2: bad_tool_turns: `messages[1].tool_calls[0]` is no call with a function `name`",
        f"{src}: line 3: bad_tool_turns: `tools` is not JSON (Expecting value: line 1 column 1 (char 0))",
        f"{src}: line 4: bad_tool_turns: `messages[1]` calls tools, but no tool result follows before the next user "
        "turn",
    ]


def test_tool_free_shards_keep_the_prompt_schema_and_its_bytes(tmp_path):
    """A source that mixes tool conversations and plain prompts: the shards without tools are written with
    PROMPT_SCHEMA, byte for byte what the writer gives for those rows under PROMPT_SCHEMA (as before tools
    existed), an empty `tools` field stays metadata; only the shard with a tool conversation has the tools
    schema."""
    plain = [{"messages": [{"role": "user", "content": f"q{i}"}], "tools": []} for i in range(4)]
    src = _write_jsonl(tmp_path / "m.jsonl", plain + [_openai("Find", "Find")])
    build_prompt_shards({"m": {"path": str(src)}}, tmp_path / "out", shard_size=2, seed=0)
    for name, schema in (("00000", contracts.PROMPT_SCHEMA), ("00001", contracts.PROMPT_SCHEMA)):
        path = tmp_path / "out" / "m" / f"{name}.parquet"
        table = pq.read_table(path)
        assert table.schema.remove_metadata().equals(schema)
        rows = table.to_pylist()
        assert all(json.loads(r["metadata"])["tools"] == [] for r in rows)
        again = tmp_path / f"again-{name}.parquet"
        shards.write_parquet(
            again, shards.table_from_records(rows, contracts.PROMPT_SCHEMA), metadata=shards.read_shard_metadata(path)
        )
        assert again.read_bytes() == path.read_bytes()
        assert rows[0]["prompt_id"] == contracts.prompt_id(
            [{"role": "user", "content": rows[0]["messages"][0]["content"]}]
        )
    last = pq.read_table(tmp_path / "out" / "m" / "00002.parquet")
    assert last.schema.remove_metadata().equals(contracts.PROMPT_TOOLS_SCHEMA)


# ---------------------------------------------------------------------------------------------- completions


def _prompt_shard(tmp_path: Path, recs: list[dict]) -> Path:
    build_prompt_shards(
        {"t": {"path": str(_write_jsonl(tmp_path / "src.jsonl", recs))}}, tmp_path / "p", shard_size=8, seed=0
    )
    return tmp_path / "p" / "t" / "00000.parquet"


def test_tool_conversation_prompts_to_completions_to_tokens_supervises_the_output_ids(tmp_path):
    """A tool-calling OpenAI conversation through the prompts stage, the test server (tools sent, the call
    answered with ids, Qwen3's real vocabulary and template) and the tokens stage: every supervised run is the
    server's output ids, the <tool_call> markup as its added token, the tool result never; a tool-free
    conversation in the same shard is written as before."""
    tok_dir = _qwen3_dir(tmp_path)
    # the server calls search with the user's text: the source's call matches it
    plain = {"messages": [{"role": "user", "content": "Say hi"}]}
    prompt_shard = _prompt_shard(tmp_path, [_openai("Find DFlash", "Find DFlash"), plain])
    out = tmp_path / "c.parquet"
    # the first request fails (503): the retry sends the same body, tools included
    faults = Faults(fail_first=1, fail_status=503)
    with start_test_server(tokenizer_dir=tok_dir, flavor="sglang", faults=faults) as srv:
        stats = generate_shard(prompt_shard, out, target_dir=None, gen_cfg=_gen_cfg(srv.base_url))
        sent = list(srv.stats.requests)
        served = srv.stats_json()
    assert stats["run"]["retries"] == 1 and served["statuses"] == {"503": 1, "200": 3}
    with_tools = [b for b in sent if "tools" in b]
    assert served["tool_requests"] == len(with_tools) >= 2 and served["tools_seen"] == [TOOLS]
    assert all(b["tools"] == TOOLS for b in with_tools)
    assert not any("tools" in b for b in sent if b["messages"][-1]["content"] == "Say hi")
    # the second request carries the regenerated call and the tool result paired to its id
    second = next(b for b in with_tools if b["messages"][-1]["role"] == "tool")
    assert second["messages"][-2]["tool_calls"][0]["id"] == second["messages"][-1]["tool_call_id"] != "c1"
    assert stats["ok"] == 2 and stats["tool_conversations"] == 1
    assert stats["ended_early"] == {"tool_call_diverged": 0}

    table = pq.read_table(out)
    assert table.schema.remove_metadata().equals(contracts.COMPLETION_TOOLS_SCHEMA)
    recs = {r["prompt_id"]: r for r in table.to_pylist()}
    rec = next(r for r in recs.values() if r["tools"])
    assert [m["role"] for m in rec["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert rec["end_reason"] is None and json.loads(rec["tools"]) == TOOLS
    (call,) = json.loads(rec["messages"][2]["tool_calls"])
    assert call["function"]["name"] == "search" and json.loads(call["function"]["arguments"]) == {
        "query": "Find DFlash"
    }
    assert rec["turns"][0]["finish_reason"] == "tool_calls"

    from real_vocab import real_tokenizer

    from dflash_pipeline.completions.generate import too_long_prompts
    from dflash_pipeline.completions.records import read_prompts

    tok = real_tokenizer("qwen3", MODELS / "Qwen3-8B" / "chat_template.jinja")
    # the context check renders the prompt with its tools and the source's call (a lower bound that counts them)
    (tooled, _) = read_prompts(prompt_shard)
    bare = {**tooled, "tools": None, "messages": [m for m in tooled["messages"] if m["role"] in ("system", "user")]}
    n_bare = len(chat.render(tok, bare["messages"], thinking="disable", add_generation_prompt=True, tokenize=True))
    check = {"thinking": "disable", "max_tokens": 0}
    assert too_long_prompts([bare], tok, check, n_bare) == {}
    assert too_long_prompts([tooled], tok, check, n_bare)[tooled["prompt_id"]]["prompt_tokens"] > n_bare + 50
    tstats: dict = {}
    rows = list(tokenize_records(tok, table.to_pylist(), max_length=4096, stats=tstats))
    assert tstats["output_ids_spliced"] == 3 and not any(tstats["dropped"].values())
    by_pid: dict = {}
    for row in rows:
        ids, mask = np.asarray(row["input_ids"]), np.asarray(row["loss_mask"])
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
        by_pid.setdefault(row["prompt_id"], []).extend(ids[a:b].tolist() for a, b in zip(edges[::2], edges[1::2]))
    assert by_pid[rec["prompt_id"]] == [t["output_token_ids"] for t in rec["turns"]]
    call_open, resp_open = tok.convert_tokens_to_ids(["<tool_call>", "<tool_response>"])
    assert call_open in rec["turns"][0]["output_token_ids"]
    assert all(resp_open not in run for run in by_pid[rec["prompt_id"]])


def test_a_diverged_tool_call_ends_the_conversation_and_is_counted(tmp_path):
    """The source searched for something else than the regenerated turn does: the conversation ends at that
    turn (kept, with the target's own call), the source's tool result and later turns are dropped, and the
    stats count it under ended_early.tool_call_diverged."""
    later = [{"role": "user", "content": "And more?"}]
    prompt_shard = _prompt_shard(tmp_path, [_openai("Find DFlash", "something else", later), _openai("Same", "Same")])
    out = tmp_path / "c.parquet"
    with start_test_server() as srv:
        stats = generate_shard(prompt_shard, out, target_dir=None, gen_cfg=_gen_cfg(srv.base_url, extra_body={}))
    assert stats["ended_early"] == {"tool_call_diverged": 1} and stats["tool_conversations"] == 2
    assert stats["ended_early_examples"]["tool_call_diverged"][0]["turn"] == 0
    recs = {r["messages"][1]["content"]: r for r in pq.read_table(out).to_pylist()}
    cut = recs["Find DFlash"]
    assert [m["role"] for m in cut["messages"]] == ["system", "user", "assistant"] and len(cut["turns"]) == 1
    assert cut["end_reason"] == "tool_call_diverged" and cut["status"] == "ok"
    assert json.loads(json.loads(cut["messages"][2]["tool_calls"])[0]["function"]["arguments"]) == {
        "query": "Find DFlash"
    }
    whole = recs["Same"]
    assert whole["end_reason"] is None and [m["role"] for m in whole["messages"]][-2:] == ["tool", "assistant"]
    assert shards.read_shard_metadata(out)["ended_early"] == {"tool_call_diverged": 1}


def test_dialogue_pairs_results_to_regenerated_ids_and_text_turns_that_call_diverge():
    """Unit rules of the walk: a matching call rewrites the results' tool_call_id to the regenerated id; a
    source text answer regenerated as a tool call with source turns left ends the conversation; without tools
    the record is the old one ({role, content, reasoning_content}, no tool keys)."""
    info = RunInfo(model="m", sampling="{}", thinking="none")
    call = json.dumps([_call("x", "orig")])
    prompt = {
        "prompt_id": "p",
        "dataset": "d",
        "tools": json.dumps(TOOLS),
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": call},
            {"role": "tool", "content": "r", "tool_call_id": "orig"},
            {"role": "user", "content": "y"},
        ],
    }
    same = Turn(content="", reasoning_content=None, finish_reason="tool_calls", tool_calls=[_call("x", "new")])
    text = Turn(content="done", reasoning_content=None, finish_reason="stop")
    walk = Dialogue(prompt)
    assert walk.advance() and walk.source_calls == call
    walk.add(same)
    assert walk.advance() and walk.history[-1] == {"role": "tool", "content": "r", "tool_call_id": "new"}
    rec = build_record(prompt, [same, text, text], info)
    assert [m["role"] for m in rec["messages"]] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert rec["end_reason"] is None and rec["messages"][2]["tool_call_id"] == "new"
    calls_instead = Turn(content="", reasoning_content=None, finish_reason="tool_calls", tool_calls=[_call("z")])
    rec = build_record(prompt, [same, calls_instead], info)
    assert (
        rec["end_reason"] == "tool_call_diverged"
        and len(rec["turns"]) == 2
        and rec["messages"][-1]["role"] == "assistant"
    )
    plain = {"prompt_id": "q", "dataset": "d", "messages": [{"role": "user", "content": "x"}]}
    rec = build_record(plain, [text], info)
    assert rec["messages"] == [
        {"role": "user", "content": "x", "reasoning_content": None},
        {"role": "assistant", "content": "done", "reasoning_content": None},
    ]
    assert "tools" not in rec and "end_reason" not in rec
    assert contracts.completion_schema([rec]) is contracts.COMPLETION_SCHEMA


@pytest.mark.parametrize("backend", ["transformers", "openai-completions"])
def test_backends_without_a_tool_call_parser_refuse_tool_conversations(tmp_path, demo_target, backend):
    """The transformers backend and ``api: completions`` render and decode locally, with no tool-call parser:
    a shard with tool conversations stops the job before any request, saying what to use instead."""
    from dflash_pipeline.core.errors import ConfigError

    prompt_shard = _prompt_shard(tmp_path, [_openai("Find", "Find")])
    if backend == "transformers":
        cfg = validate_config({"generation": {"max_tokens": 4}})["generation"]
        ctx = contextlib.nullcontext()
    else:
        ctx = start_test_server()
    with ctx as srv:
        if srv is not None:
            cfg = _gen_cfg(srv.base_url, api="completions", extra_body={}, max_tokens=4)
        with pytest.raises(ConfigError, match=r"tool calls.*generation.backend: openai and generation.api: chat"):
            generate_shard(prompt_shard, tmp_path / "c.parquet", target_dir=demo_target, gen_cfg=cfg)
        if srv is not None:
            assert srv.stats.chat_requests == 0
    assert not (tmp_path / "c.parquet").exists()
