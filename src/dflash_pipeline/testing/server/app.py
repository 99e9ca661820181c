"""The test server itself (`TestServer`): its lifecycle (a background thread or the caller's event
loop) and the HTTP handlers of `/v1/models`, `/v1/chat/completions`, `/v1/completions`,
`/health`, `/metrics` and `/stats` (the package docstring has the behaviour)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

from aiohttp import web

from . import sglang as sg
from .answers import (
    TargetModel,
    canned_chat,
    canned_text,
    canned_tool_call,
    last_user,
    prompt_of,
    split_think,
)
from .faults import Faults, drop, inject_faults, marker_response
from .stats import ServerStats, conversation_key, first_user

#: Model id served when none is given.
DEFAULT_MODEL_NAME = "test-model"
#: Answer shapes the server can give (`TestServer(flavor=...)`).
FLAVORS = ("vllm", "sglang", "sglang-legacy")


class TestServer:
    """An OpenAI-compatible server on 127.0.0.1 running in a background thread.

    Args:
        target_dir: serve the tiny target at this path (greedy); None = canned answers.
        model_name: id listed by `/v1/models` and echoed in answers.
        faults: the fault plan (`Faults`, mutable while running).
        reasoning: canned mode: act like a thinking model behind a reasoning parser.
        tokenizer_dir: canned mode: decode token-id prompts of `/v1/completions` with this tokenizer.
        reasoning_field: `reasoning_content` (SGLang, older vLLM) or `reasoning` (newer vLLM).
        api_key: if set, requests without `Authorization: Bearer <api_key>` get 401.
        port: TCP port (0 = a free one).
        host: address to bind (`base_url` names 127.0.0.1 for `0.0.0.0`).
        spec_accept_length: report this acceptance length as an engine with a drafter; None = no metrics.
        spec_meta_info: with `spec_accept_length`, also `meta_info` in each answer (flavor vllm only).
        flavor: `vllm`, `sglang` (`.sglang`) or `sglang-legacy` (no token ids).
        spec_block_size: sglang flavors: the block size of the `spec_*` histograms.
        return_input_ids, return_output_ids: sglang flavor: ids in every answer's `sglext`.
        spec_long_context: `(prompt tokens, τ)`: longer prompts report this τ instead (acceptance
            collapsing at long context, vllm-ascend#15237)."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        *,
        target_dir: str | Path | None = None,
        model_name: str = DEFAULT_MODEL_NAME,
        faults: Faults | None = None,
        reasoning: bool = False,
        reasoning_field: str = "reasoning_content",
        tokenizer_dir: str | Path | None = None,
        api_key: str | None = None,
        port: int = 0,
        host: str = "127.0.0.1",
        spec_accept_length: float | None = None,
        spec_meta_info: bool = True,
        flavor: str = "vllm",
        spec_block_size: int = 16,
        return_input_ids: bool = False,
        return_output_ids: bool = False,
        spec_long_context: tuple[int, float] | None = None,
    ):
        if flavor not in FLAVORS:
            raise ValueError(f"flavor {flavor!r}: use one of {', '.join(FLAVORS)}")
        self.flavor = flavor
        self.spec_block_size = int(spec_block_size)
        self.return_input_ids, self.return_output_ids = return_input_ids, return_output_ids
        self.spec_accept_length = spec_accept_length
        self.spec_long_context = spec_long_context
        self.spec_meta_info = spec_meta_info
        self.target_dir = target_dir
        self.model_name = model_name
        self.faults = faults or Faults()
        self.reasoning = reasoning
        self.reasoning_field = reasoning_field
        self.tokenizer_dir = tokenizer_dir
        self._tok = None
        self.api_key = api_key
        self.port = port
        self.host = host
        self.stats = ServerStats()
        self._target: TargetModel | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._stopping: asyncio.Event | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        """`http://<host>:<port>/v1`."""
        host = "127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host
        return f"http://[{host}]:{self.port}/v1" if ":" in host else f"http://{host}:{self.port}/v1"

    def _make_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/stats", self._stats)
        app.router.add_get("/health", self._health)
        return app

    async def start_async(self) -> None:
        """Start serving on the running loop (used by the CLI and by `start`)."""
        if self.target_dir is not None and self._target is None:
            self._target = TargetModel(self.target_dir)
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-server-gen")
        if self._target is not None:
            self._tok = self._target.tok
        elif self.tokenizer_dir is not None and self._tok is None:
            from dflash_pipeline.target.chat import load_tokenizer

            self._tok = load_tokenizer(self.tokenizer_dir)
        self._stopping = asyncio.Event()
        self._runner = web.AppRunner(self._make_app(), handle_signals=False, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host or None, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the bound port when 0 was asked

    async def stop_async(self) -> None:
        """Stop serving (hanging requests are released first)."""
        if self._stopping is not None:
            self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    def start(self, timeout_s: float = 120.0) -> "TestServer":
        """Start in a background thread; returns once the port is bound (or raises what start raised)."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start_async())
            except BaseException as exc:  # reported to the starting thread
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self.stop_async())
            loop.close()

        self._thread = threading.Thread(target=run, name=f"test-server-{id(self)}", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise TimeoutError(f"test server did not start within {timeout_s} s")
        if failure:
            raise failure[0]
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the server and join its thread (idempotent). Afterwards the port refuses connections."""
        if self._loop is None or self._thread is None:
            return
        loop, self._loop = self._loop, None
        fut = asyncio.run_coroutine_threadsafe(self.stop_async(), loop)
        with contextlib.suppress(Exception):
            fut.result(timeout_s)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout_s)
        self._thread = None

    def __enter__(self) -> "TestServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- handlers -------------------------------------------------------------------------------
    def _dead(self) -> bool:
        f = self.faults
        return f.die_after is not None and self.stats.chat_requests >= f.die_after

    def _check_auth(self, request: web.Request) -> web.Response | None:
        if self.api_key is None:
            return None
        if request.headers.get("Authorization") != f"Bearer {self.api_key}":
            self.stats.unauthorized += 1
            return web.json_response({"error": {"message": "invalid api key", "type": "auth"}}, status=401)
        return None

    async def _health(self, request: web.Request) -> web.Response:
        if self._dead():
            return drop(request)
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        if self._dead():
            return drop(request)
        self.stats.models_requests += 1
        denied = self._check_auth(request)
        if denied is not None:
            return denied
        return web.json_response(
            {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "test"}]}
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        s = self.stats
        lines = [
            f"test_server_chat_requests_total {s.chat_requests}",
            f"test_server_answered_total {s.answered}",
            f"test_server_models_requests_total {s.models_requests}",
        ]
        by_status = sorted(s.statuses.items(), key=lambda kv: str(kv[0]))  # ints and "dropped"/"hung"/…
        lines += [f'test_server_responses_total{{status="{k}"}} {v}' for k, v in by_status]
        if self.spec_accept_length is not None:
            lines += [
                "# TYPE vllm:spec_decode_num_drafts_total counter",
                f'vllm:spec_decode_num_drafts_total{{model_name="{self.model_name}"}} {s.spec_drafts}',
                "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
                f'vllm:spec_decode_num_accepted_tokens_total{{model_name="{self.model_name}"}} {s.spec_accepted_tokens}',
            ]
        return web.Response(text="\n".join(lines) + "\n")

    def stats_json(self) -> dict[str, Any]:
        """What `GET /stats` answers: every `ServerStats` counter (statuses keyed by their string), `by_prompt` and
        `by_conversation` as `{key: requests}` in first-arrival order, and `dead` (`die_after` reached)."""
        s = self.stats
        return {
            "model": self.model_name,
            "chat_requests": s.chat_requests,
            "completions_requests": s.completions_requests,
            "models_requests": s.models_requests,
            "answered": s.answered,
            "unauthorized": s.unauthorized,
            "dead": self._dead(),
            "statuses": {str(k): v for k, v in s.statuses.items()},
            "spec_drafts": s.spec_drafts,
            "spec_accepted_tokens": s.spec_accepted_tokens,
            "tool_requests": s.tool_requests,
            "tools_seen": [json.loads(t) for t in s.tools_seen],
            "by_prompt": dict(s.by_prompt),
            "by_conversation": dict(s.by_conversation),
        }

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats_json(), dumps=lambda o: json.dumps(o, ensure_ascii=False))

    def _fault_of(self, n: int) -> str | None:
        """What the fault plan does to generation request `n` (`Faults.fault_of`)."""
        return self.faults.fault_of(n)

    def _accept_length(self, num_prompt_tokens: int) -> float:
        """The acceptance length this server reports for a prompt of `num_prompt_tokens` tokens."""
        if self.spec_long_context is not None and num_prompt_tokens >= self.spec_long_context[0]:
            return float(self.spec_long_context[1])
        return self.spec_accept_length

    def _finish(self, resp: dict, out_ids: list[int]) -> web.Response:
        """Add speculative metrics (when configured), count the answer and send it."""
        stats = self.stats
        if self.spec_accept_length is not None and out_ids:
            tau = self._accept_length(resp["usage"]["prompt_tokens"])
            verify = stats.count_spec_decode(len(out_ids), tau)
            if self.spec_meta_info:
                resp["meta_info"] = {"spec_accept_length": tau, "spec_verify_ct": verify}
        stats.statuses[200] += 1
        stats.answered += 1
        return web.json_response(resp)

    def _admit(self, request: web.Request, *, completions: bool) -> tuple[int, web.Response | None]:
        """Number and count a generation request: `(n, refusal)`, the refusal being a dropped connection
        once the server is dead (not counted) or a 401 for a wrong API key (None: go on)."""
        if self._dead():
            return 0, drop(request)
        stats = self.stats
        stats.chat_requests += 1
        if completions:
            stats.completions_requests += 1
        denied = self._check_auth(request)
        if denied is not None:
            stats.statuses[401] += 1
        return stats.chat_requests, denied

    async def _faulted(self, request: web.Request, n: int, marked_text: str) -> web.StreamResponse | None:
        """The fault plan's answer to generation request `n`, else the one a marker in `marked_text`
        forces (None: answer normally)."""
        faulted = await inject_faults(request, n, self.faults, self.stats, self._stopping)
        if faulted is not None:
            return faulted
        return marker_response(marked_text, self.faults, self.stats)

    async def _admitted_json(
        self, request: web.Request, field: str, parse: Callable[[Any], Any], *, completions: bool
    ) -> tuple[int, dict, Any, web.StreamResponse | None]:
        """Admit generation request `request` (`_admit`), read its JSON body and `parse(body[field])`: `(n, body,
        parsed, None)`, else `(n, {}, None, answer)` with the refusal, or a counted 400 when the body is not JSON or
        `field` does not parse."""
        n, refused = self._admit(request, completions=completions)
        if refused is not None:
            return n, {}, None, refused
        try:
            body = await request.json()
            return n, body, parse(body[field]), None
        except (ValueError, KeyError, TypeError) as exc:
            self.stats.statuses[400] += 1
            why = f": {exc}" if completions else ""
            message = f"body must be JSON with `{field}`{why}"
            return n, {}, None, web.json_response({"error": {"message": message}}, status=400)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        n, body, messages, refused = await self._admitted_json(request, "messages", list, completions=False)
        if refused is not None:
            return refused
        stats, f = self.stats, self.faults
        stats.record_request(body, first_user(messages), conversation_key(messages))
        if self.flavor != "vllm":  # SGLang refuses ids and meta_info on a streamed chat before generating
            refusal = sg.stream_refusal(body, legacy=self.flavor == "sglang-legacy")
            if refusal is not None:
                stats.statuses[400] += 1
                return refusal
        last = last_user(messages)
        faulted = await self._faulted(request, n, last)
        if faulted is not None:
            return faulted

        kwargs = dict(body.get("chat_template_kwargs") or {})
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 256)
        tools = body.get("tools")
        if tools and self._target is None and messages and messages[-1].get("role") == "user":
            return self._tool_call_answer(n, body, messages, tools, kwargs)
        if self._target is not None:
            text, finish, prompt_ids, out_ids = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._target.answer, messages, kwargs, max_tokens
            )
            reasoning, content = split_think(text)
            if reasoning is not None and not reasoning and kwargs.get("enable_thinking") is False:
                reasoning = None  # an empty think block is the template's, not the model's
        else:
            reasoning, content, finish, prompt_ids, out_ids = canned_chat(
                messages, kwargs, max_tokens, reasoning=self.reasoning
            )
        if f.wrong_content_marker and f.wrong_content_marker in last:
            reasoning = "unexpected reasoning"
        if self.flavor != "vllm" and self._target is None and self._tok is not None:  # real ids of the raw text
            prompt_ids, out_ids = sg.chat_ids(self._tok, messages, kwargs, reasoning, content, finish)

        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message[self.reasoning_field] = reasoning
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        resp = self._envelope("chatcmpl", "chat.completion", n, body, choice, prompt_ids, out_ids)
        if self.flavor != "vllm":
            return await self._sglang_chat(
                request,
                body,
                resp,
                reasoning=reasoning,
                content=content,
                finish=finish,
                prompt_ids=prompt_ids,
                out_ids=out_ids,
            )
        if body.get("return_token_ids"):
            resp["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = out_ids
        return self._finish(resp, out_ids)

    def _tool_call_answer(self, n: int, body: dict, messages: list, tools: list, kwargs: dict) -> web.Response:
        """Canned mode, a request that offers `tools` and ends with a user turn: the answer calls the first tool,
        `finish_reason: tool_calls`, as a server with a tool-call parser answers. Output ids: with a tokenizer, the
        template's render of the call, else fake ones; returned as the flavor returns ids."""
        from .answers import fake_id, tool_turn_ids

        calls = canned_tool_call(messages, tools, n)
        if self._tok is not None:
            out_ids = tool_turn_ids(self._tok, messages, tools, calls, kwargs)
            text = self._tok.apply_chat_template(
                [{k: v for k, v in m.items() if v is not None} for m in messages],
                tools=tools,
                tokenize=False,
                add_generation_prompt=True,
                **kwargs,
            )
            prompt_ids = list(self._tok(text, add_special_tokens=False)["input_ids"])
        else:
            out_ids = [fake_id(c["function"]["arguments"]) for c in calls] + [2]
            prompt_ids = [fake_id(str(m.get("content"))) for m in messages]
        message = {"role": "assistant", "content": "", "tool_calls": calls}
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": "tool_calls", "logprobs": None}
        resp = self._envelope("chatcmpl", "chat.completion", n, body, choice, prompt_ids, out_ids)
        if body.get("return_token_ids") and not self._legacy:
            if self.flavor == "vllm":
                resp["prompt_token_ids"] = prompt_ids
            else:
                choice["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = out_ids
        return self._finish(resp, out_ids)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        n, body, parsed, refused = await self._admitted_json(
            request, "prompt", lambda prompt: prompt_of(prompt, self._tok), completions=True
        )
        if refused is not None:
            return refused
        stats, f = self.stats, self.faults
        text, prompt_ids = parsed
        stats.record_request(body, text, text)
        faulted = await self._faulted(request, n, text)
        if faulted is not None:
            return faulted

        max_tokens = int(body.get("max_tokens") or 16)  # the OpenAI completions default
        wrong = bool(f.wrong_content_marker and f.wrong_content_marker in text)
        if self._target is not None:
            generated, finish, prompt_ids, out_ids = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._target.complete, prompt_ids, max_tokens
            )
            if wrong:
                generated = "<think>\nunexpected reasoning\n</think>\n\n" + generated
        else:
            generated, finish, out_ids = canned_text(text, max_tokens, wrong, reasoning=self.reasoning)
            if self.flavor != "vllm" and self._tok is not None:  # real ids of the text
                out_ids = sg.text_ids(self._tok, generated, finish)
        choice: dict[str, Any] = {"index": 0, "text": generated, "finish_reason": finish, "logprobs": None}
        if self.flavor != "vllm":
            resp = self._envelope("cmpl", "text_completion", n, body, choice, prompt_ids, out_ids)
            return await self._sglang_completion(
                request, body, resp, text=generated, finish=finish, prompt_ids=prompt_ids, out_ids=out_ids
            )
        if body.get("return_token_ids"):  # vLLM puts both in the choice for completions
            choice["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = out_ids
        resp = self._envelope("cmpl", "text_completion", n, body, choice, prompt_ids, out_ids)
        return self._finish(resp, out_ids)

    # -- SGLang's shapes (flavor sglang / sglang-legacy; see .sglang) ---------------------------------
    @property
    def _legacy(self) -> bool:
        return self.flavor == "sglang-legacy"

    def _spec_figures(self, out_ids: list[int], num_prompt_tokens: int) -> dict | None:
        """Count one answer's speculative decoding (when configured) and return SGLang's `spec_*` figures."""
        if self.spec_accept_length is None or not out_ids:
            return None
        verify = self.stats.count_spec_decode(len(out_ids), self._accept_length(num_prompt_tokens))
        return sg.spec_meta_info(len(out_ids), verify, self.spec_block_size)

    async def _send(self, request: web.Request, resp: dict, events: list[bytes] | None) -> web.StreamResponse:
        """Count an answer and send it: the JSON `resp`, or the server-sent `events` of a streamed one."""
        self.stats.statuses[200] += 1
        self.stats.answered += 1
        if events is not None:
            return await sg.send_events(request, events)
        return web.json_response(resp)

    async def _sglang_chat(
        self,
        request: web.Request,
        body: dict,
        resp: dict,
        *,
        reasoning: str | None,
        content: str,
        finish: str,
        prompt_ids: list[int],
        out_ids: list[int],
    ) -> web.StreamResponse:
        """A chat answer in SGLang's shapes: ids per choice and in `sglext`, `meta_info`, or a stream."""
        choice = sg.matched_choice(resp, finish, out_ids)
        if body.get("return_prompt_token_ids") or (body.get("return_token_ids") and not self._legacy):
            choice["prompt_token_ids"] = prompt_ids
        if body.get("return_token_ids") and not self._legacy:
            choice["token_ids"] = out_ids
        spec = self._spec_figures(out_ids, len(prompt_ids))
        if body.get("return_meta_info"):
            choice["meta_info"] = sg.meta_info(resp["id"], finish, prompt_ids, out_ids, spec)
        want = (
            (False, False)
            if self._legacy
            else sg.sglext_wanted(
                body, request.headers, server_input_ids=self.return_input_ids, server_output_ids=self.return_output_ids
            )
        )
        ext = sg.sglext(prompt_ids, out_ids, want)
        if body.get("stream"):
            usage = resp["usage"] if (body.get("stream_options") or {}).get("include_usage") else None
            events = sg.chat_stream_events(
                resp["id"], resp["model"], reasoning=reasoning, content=content, finish=finish, ext=ext, usage=usage
            )
            return await self._send(request, resp, events)
        if ext is not None:
            resp["sglext"] = ext
        return await self._send(request, resp, None)

    async def _sglang_completion(
        self,
        request: web.Request,
        body: dict,
        resp: dict,
        *,
        text: str,
        finish: str,
        prompt_ids: list[int],
        out_ids: list[int],
    ) -> web.StreamResponse:
        """A completion in SGLang's shapes: both id lists in the choice (`return_token_ids`), or a stream."""
        choice = sg.matched_choice(resp, finish, out_ids)
        with_ids = bool(body.get("return_token_ids")) and not self._legacy
        if with_ids:
            choice["token_ids"] = out_ids
            choice["prompt_token_ids"] = prompt_ids
        self._spec_figures(out_ids, len(prompt_ids))
        if body.get("stream"):
            usage = resp["usage"] if (body.get("stream_options") or {}).get("include_usage") else None
            events = sg.completion_stream_events(
                resp["id"],
                resp["model"],
                text=text,
                finish=finish,
                prompt_ids=prompt_ids,
                out_ids=out_ids,
                with_ids=with_ids,
                usage=usage,
            )
            return await self._send(request, resp, events)
        return await self._send(request, resp, None)

    def _envelope(
        self, id_prefix: str, obj: str, n: int, body: dict, choice: dict, prompt_ids: list[int], out_ids: list[int]
    ) -> dict[str, Any]:
        """The OpenAI response around one choice (`id`, `object`, `model`, `usage` in tokens)."""
        return {
            "id": f"{id_prefix}-{n}",
            "object": obj,
            "created": 0,
            "model": body.get("model") or self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(out_ids),
                "total_tokens": len(prompt_ids) + len(out_ids),
            },
        }


@contextlib.contextmanager
def start_test_server(**kwargs) -> Iterator[TestServer]:
    """Run a `TestServer` (same keyword arguments) for the duration of a `with` block."""
    server = TestServer(**kwargs).start()
    try:
        yield server
    finally:
        server.stop()
