"""The test server in SGLang's answer shapes (``flavor="sglang"``, issue 26): token ids per choice
(sgl-project/sglang PR #30917) and in the response-level ``sglext`` (PR #34488), ``meta_info`` with the
speculative figures, server-sent events for streamed chat and completions, and the 400 SGLang gives when
ids are asked for on a streamed chat; ``sglang-legacy`` is an SGLang from before PR #30917."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from dflash_pipeline.testing.server import start_test_server
from dflash_pipeline.testing.server.sglang import STREAM_REFUSALS

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1, whatever http_proxy says
MESSAGES = [{"role": "user", "content": "What is two plus two"}]


def post(base_url: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(
        f"{base_url}{path}",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with _OPENER.open(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def events(raw: bytes) -> list:
    """The ``data:`` payloads of a server-sent event stream (``[DONE]`` as the string)."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_chat_ids_per_choice_and_in_sglext_and_meta_info():
    with start_test_server(flavor="sglang", reasoning=True, spec_accept_length=2.0, spec_block_size=4) as srv:
        base = {"model": "test-model", "messages": MESSAGES, "max_tokens": 64}
        status, raw = post(
            srv.base_url, "/chat/completions", {**base, "return_token_ids": True, "return_meta_info": True}
        )
        assert status == 200
        resp = json.loads(raw)
        (choice,) = resp["choices"]
        assert "prompt_token_ids" not in resp and "sglext" not in resp and "meta_info" not in resp
        assert choice["message"]["reasoning_content"] == "Let me think about turn 1."
        assert choice["prompt_token_ids"] and choice["token_ids"][-1] == choice["matched_stop"] == 2
        assert resp["usage"]["completion_tokens"] == len(choice["token_ids"])
        meta = choice["meta_info"]
        assert meta["completion_tokens"] == len(choice["token_ids"]) and meta["finish_reason"]["type"] == "stop"
        hist = meta["spec_correct_drafts_histogram"]
        assert hist == meta["spec_accept_histogram"] and len(hist) == 4 and sum(hist) == meta["spec_verify_ct"]
        assert sum((n + 1) * c for n, c in enumerate(hist)) == meta["completion_tokens"]
        assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])

        status, raw = post(
            srv.base_url,
            "/chat/completions",
            {**base, "return_output_ids_in_sglext": True},
            headers={"x-sglext-return-input-ids": "1"},
        )
        ext = json.loads(raw)
        assert "token_ids" not in ext["choices"][0] and "meta_info" not in ext["choices"][0]
        assert ext["sglext"] == {"input_ids": choice["prompt_token_ids"], "output_ids": [choice["token_ids"]]}

        plain = json.loads(post(srv.base_url, "/chat/completions", base)[1])
        assert {"prompt_token_ids", "token_ids", "meta_info"}.isdisjoint(plain["choices"][0]) and "sglext" not in plain


@pytest.mark.parametrize("flag", [f for f, _ in STREAM_REFUSALS])
def test_streamed_chat_asking_for_ids_is_refused_as_sglang_does(flag):
    message = dict(STREAM_REFUSALS)[flag]
    with start_test_server(flavor="sglang") as srv:
        status, raw = post(
            srv.base_url, "/chat/completions", {"model": "test-model", "messages": MESSAGES, "stream": True, flag: True}
        )
        assert status == 400
        assert json.loads(raw) == {
            "object": "error",
            "message": message,
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
        client = openai.OpenAI(base_url=srv.base_url, api_key="EMPTY", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="is not supported with streaming"):
            client.chat.completions.create(model="test-model", messages=MESSAGES, stream=True, extra_body={flag: True})
        assert srv.stats.statuses[400] == 2 and srv.stats.answered == 0


def test_streamed_chat_carries_reasoning_content_and_the_sglext_ids_once():
    with start_test_server(flavor="sglang", reasoning=True) as srv:
        body = {
            "model": "test-model",
            "messages": MESSAGES,
            "max_tokens": 64,
            "return_input_ids_in_sglext": True,
            "return_output_ids_in_sglext": True,
        }
        whole = json.loads(post(srv.base_url, "/chat/completions", body)[1])
        status, raw = post(
            srv.base_url, "/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
        )
        assert status == 200
    evs = events(raw)
    assert evs[-1] == "[DONE]" and evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    chunks = evs[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    msg = whole["choices"][0]["message"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == msg["content"]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    ext = [c for c in chunks if "sglext" in c]
    assert len(ext) == 1 and ext[0]["choices"] == [] and ext[0]["sglext"] == whole["sglext"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_completions_ids_whole_and_streamed_per_chunk():
    with start_test_server(flavor="sglang") as srv:
        body = {"model": "test-model", "prompt": [5, 6, 7], "max_tokens": 32, "return_token_ids": True}
        (choice,) = json.loads(post(srv.base_url, "/completions", body)[1])["choices"]
        assert choice["prompt_token_ids"] == [5, 6, 7] and choice["token_ids"]
        evs = events(post(srv.base_url, "/completions", {**body, "stream": True})[1])
    chunks = [e["choices"][0] for e in evs[:-1]]
    assert len(chunks) > 1 and "prompt_token_ids" in chunks[0] and all("prompt_token_ids" not in c for c in chunks[1:])
    assert chunks[0]["prompt_token_ids"] == [5, 6, 7]
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    assert "".join(c["text"] for c in chunks) == choice["text"] and chunks[-1]["finish_reason"] == "stop"


def test_legacy_sglang_ignores_return_token_ids():
    with start_test_server(flavor="sglang-legacy") as srv:
        body = {"model": "test-model", "messages": MESSAGES, "return_token_ids": True}
        (choice,) = json.loads(post(srv.base_url, "/chat/completions", body)[1])["choices"]
        assert "token_ids" not in choice and "prompt_token_ids" not in choice
        status, _ = post(srv.base_url, "/chat/completions", {**body, "stream": True})
        assert status == 200  # ignored, so not refused either
        (choice,) = json.loads(
            post(srv.base_url, "/completions", {"model": "test-model", "prompt": "hi", "return_token_ids": True})[1]
        )["choices"]
        assert "token_ids" not in choice
