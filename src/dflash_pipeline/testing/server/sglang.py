"""SGLang's answer shapes for the test server (`TestServer(flavor="sglang")`), as SGLang's OpenAI layer
gives them (sgl-project/sglang `python/sglang/srt/entrypoints/openai/`: `protocol.py`, `serving_chat.py`,
`serving_completions.py`):

* **chat**: `return_token_ids` puts `prompt_token_ids` and the raw generated `token_ids` in each choice
  (PR #30917); `return_input_ids_in_sglext` / `return_output_ids_in_sglext` (or the `x-sglext-*` headers,
  or the server flags) put `sglext.input_ids` / `sglext.output_ids` in the response (PR #34488);
  `return_meta_info` puts `meta_info` in each choice. Streamed, asking for ids or meta info is refused
  with HTTP 400 (`STREAM_REFUSALS`); otherwise server-sent events end with the `sglext` chunk, usage and
  `[DONE]`.
* **completions**: `return_token_ids` puts both id lists in the choice; streamed, per chunk.

`legacy=True` is an SGLang before PR #30917 (e.g. v0.5.9): `return_token_ids` is ignored. Speculative
figures follow SGLang's `tokenizer_manager`: `spec_verify_ct`, `spec_correct_drafts_histogram`,
`spec_num_correct_drafts` / `spec_num_proposed_drafts` (and their aliases), `spec_accept_rate` and
`spec_accept_length` = completion tokens / verify steps.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

#: The request flags a streamed SGLang chat refuses, in the order SGLang checks them, with its messages.
STREAM_REFUSALS = (
    (
        "return_prompt_token_ids",
        (
            "return_prompt_token_ids is not supported with streaming. Please set "
            "stream=false when using return_prompt_token_ids=true."
        ),
    ),
    (
        "return_token_ids",
        (
            "return_token_ids is not supported with streaming on /v1/chat/completions. Please set "
            "stream=false when using return_token_ids=true."
        ),
    ),
    (
        "return_meta_info",
        ("return_meta_info is not supported with streaming. Please set stream=false when using return_meta_info=true."),
    ),
)


def error_response(message: str, status: int = 400, err_type: str = "BadRequestError") -> web.Response:
    """SGLang's error answer: `{object: error, message, type, param: null, code}` (`ErrorResponse`)."""
    return web.json_response(
        {"object": "error", "message": message, "type": err_type, "param": None, "code": status}, status=status
    )


def stream_refusal(body: dict, *, legacy: bool = False) -> web.Response | None:
    """The 400 SGLang answers a streamed chat that asks for ids or meta_info (None: not refused)."""
    if not body.get("stream"):
        return None
    for flag, message in STREAM_REFUSALS[:1] if legacy else STREAM_REFUSALS:
        if body.get(flag):
            return error_response(message)
    return None


def sglext_wanted(body: dict, headers, *, server_input_ids: bool, server_output_ids: bool) -> tuple[bool, bool]:
    """`(input ids, output ids)` wanted in `sglext`: the request flags, their headers, the server flags."""
    want_in = bool(body.get("return_input_ids_in_sglext")) or headers.get("x-sglext-return-input-ids") == "1"
    want_out = bool(body.get("return_output_ids_in_sglext")) or headers.get("x-sglext-return-output-ids") == "1"
    return want_in or server_input_ids, want_out or server_output_ids


def sglext(prompt_ids: list[int], out_ids: list[int], want: tuple[bool, bool]) -> dict | None:
    """The response-level `sglext` of a one-choice answer (None when nothing is wanted)."""
    ext: dict[str, Any] = {}
    if want[0]:
        ext["input_ids"] = list(prompt_ids)
    if want[1]:
        ext["output_ids"] = [list(out_ids)]
    return ext or None


def spec_meta_info(num_tokens: int, verify: int, block_size: int) -> dict:
    """SGLang's per-request speculative figures for `num_tokens` completion tokens produced in `verify` steps of a
    drafter with `block_size`: the accepted drafts (`num_tokens − verify`) spread as evenly as the steps allow, each
    step at most `block_size − 1`."""
    accepted = max(0, num_tokens - verify)
    base, extra = divmod(accepted, max(1, verify))
    hist = [0] * block_size
    for step in range(verify):
        hist[min(block_size - 1, base + (1 if step < extra else 0))] += 1
    correct = sum(n * c for n, c in enumerate(hist))
    proposed = verify * (block_size - 1)
    return {
        "spec_verify_ct": verify,
        "spec_accept_length": num_tokens / verify if verify else 0.0,
        "spec_accept_rate": correct / proposed if proposed else 0.0,
        "spec_num_correct_drafts": correct,
        "spec_num_proposed_drafts": proposed,
        "spec_accepted_drafts": correct,
        "spec_proposed_drafts": proposed,
        "spec_correct_drafts_histogram": hist,
        "spec_accept_histogram": list(hist),
    }


def matched_stop(finish: str, out_ids: Sequence[int]) -> int | None:
    """The stop token id SGLang reports: the last output id when the answer ended on a stop (`finish`
    `"stop"`), else None."""
    return out_ids[-1] if finish == "stop" and out_ids else None


def matched_choice(resp: dict, finish: str, out_ids: Sequence[int]) -> dict:
    """The one choice of answer `resp`, given SGLang's `matched_stop` (`matched_stop`) in place."""
    choice = resp["choices"][0]
    choice["matched_stop"] = matched_stop(finish, out_ids)
    return choice


def meta_info(rid: str, finish: str, prompt_ids: Sequence[int], out_ids: Sequence[int], spec: dict | None) -> dict:
    """A choice's `meta_info` (`return_meta_info`): request id, finish reason as SGLang records it
    (`matched`: the stop token id), token counts and the speculative figures."""
    matched = matched_stop(finish, out_ids)
    info = {
        "id": rid,
        "finish_reason": {"type": finish, **({"matched": matched} if finish == "stop" else {})},
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(out_ids),
        "cached_tokens": 0,
        "weight_version": "default",
    }
    return {**info, **(spec or {})}


def chat_ids(
    tok, messages: list[dict], kwargs: dict, reasoning: str | None, content: str, finish: str
) -> tuple[list[int], list[int]]:
    """`(prompt ids, output ids)` of a canned chat answer with the tokenizer `tok`: the request rendered with its
    chat template, and the raw text the model wrote (`<think>\\n…\\n</think>\\n\\n` before the content when it thought)
    plus the end-of-turn token when it stopped, as a model behind a Qwen3-style reasoning parser generates it."""
    msgs = [{k: v for k, v in m.items() if v is not None} for m in messages]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
    prompt = list(tok(text, add_special_tokens=False)["input_ids"])
    raw = (f"<think>\n{reasoning}\n</think>\n\n" if reasoning is not None else "") + content
    return prompt, text_ids(tok, raw, finish)


def text_ids(tok, text: str, finish: str) -> list[int]:
    """The ids a model wrote `text` in (`tok` without special tokens added), and its end-of-turn token
    when it stopped (SGLang's ids include the stop token; `matched_stop` names it)."""
    out = list(tok(text, add_special_tokens=False)["input_ids"])
    if finish == "stop" and tok.eos_token_id is not None:
        out.append(tok.eos_token_id)
    return out


def _pieces(text: str, n: int) -> list[str]:
    """`text` in `n` consecutive pieces (the last ones may be empty)."""
    size = math.ceil(len(text) / n) if text else 0
    return [text[i * size : (i + 1) * size] for i in range(n)] if size else [""] * n


def _split(ids: Sequence[int], n: int) -> list[list[int]]:
    """`ids` in `n` consecutive slices."""
    size = math.ceil(len(ids) / n) if ids else 0
    return [list(ids[i * size : (i + 1) * size]) for i in range(n)] if size else [[] for _ in range(n)]


def _stream_chunk(rid: str, model: str, obj: str, choices: list[dict], **extra) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices, **extra}


def chat_stream_events(
    rid: str,
    model: str,
    *,
    reasoning: str | None,
    content: str,
    finish: str,
    ext: dict | None,
    usage: dict | None,
    chunks: int = 3,
) -> list[bytes]:
    """The server-sent events of a streamed chat answer (see the module docstring), `[DONE]` last."""

    def choice(delta: dict, finish_reason=None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason, "matched_stop": None}

    obj = "chat.completion.chunk"
    out = [_stream_chunk(rid, model, obj, [choice({"role": "assistant", "content": ""})])]
    for piece in _pieces(reasoning or "", chunks) if reasoning else []:
        if piece:
            out.append(_stream_chunk(rid, model, obj, [choice({"reasoning_content": piece})]))
    for piece in _pieces(content, chunks):
        if piece:
            out.append(_stream_chunk(rid, model, obj, [choice({"content": piece})]))
    out.append(_stream_chunk(rid, model, obj, [choice({}, finish)]))
    if ext:
        out.append(_stream_chunk(rid, model, obj, [], sglext=ext))
    if usage is not None:
        out.append(_stream_chunk(rid, model, obj, [], usage=usage))
    return [f"data: {json.dumps(c)}\n\n".encode() for c in out] + [b"data: [DONE]\n\n"]


def completion_stream_events(
    rid: str,
    model: str,
    *,
    text: str,
    finish: str,
    prompt_ids: Sequence[int],
    out_ids: Sequence[int],
    with_ids: bool,
    usage: dict | None,
    chunks: int = 3,
) -> list[bytes]:
    """The server-sent events of a streamed completion: text pieces, each chunk with the ids generated in it
    and the first with the prompt's ids (`with_ids`: `return_token_ids`), the finish on the last."""
    n = max(1, min(chunks, len(out_ids) or 1))
    out = []
    for k, (piece, ids) in enumerate(zip(_pieces(text, n), _split(out_ids, n))):
        ch: dict[str, Any] = {
            "index": 0,
            "text": piece,
            "logprobs": None,
            "finish_reason": finish if k == n - 1 else None,
            "matched_stop": None,
        }
        if with_ids:
            ch["token_ids"] = ids
            if k == 0:
                ch["prompt_token_ids"] = list(prompt_ids)
        out.append(_stream_chunk(rid, model, "text_completion", [ch]))
    if usage is not None:
        out.append(_stream_chunk(rid, model, "text_completion", [], usage=usage))
    return [f"data: {json.dumps(c)}\n\n".encode() for c in out] + [b"data: [DONE]\n\n"]


async def send_events(request: web.Request, events: list[bytes]) -> web.StreamResponse:
    """Stream `events` as `text/event-stream`."""
    resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for ev in events:
        await resp.write(ev)
    await resp.write_eof()
    return resp
