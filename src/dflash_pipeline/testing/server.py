"""A local OpenAI-compatible server (chat and raw completions) for tests, benchmarks and end-to-end runs, with fault injection.

It stands in for SGLang/vLLM (DESIGN.md §4): ``GET /v1/models``, ``POST /v1/chat/completions``,
``POST /v1/completions`` (raw prompts: a string, or token ids as ``generation.api: completions`` sends),
``GET /health``, ``GET /metrics`` (Prometheus-style counters) and ``GET /stats`` (everything
:class:`ServerStats` counts, per-prompt request counts included, as JSON), on 127.0.0.1 by default.

Two answer modes:

* **canned** (default): a deterministic answer computed from the conversation, e.g.
  ``"Answer 2 to: <last user message>"``; one "token" per whitespace-separated word, so ``max_tokens``
  smaller than the answer gives ``finish_reason: length``. With ``reasoning=True`` the server acts like a
  thinking model behind a reasoning parser: ``reasoning_content`` is returned unless the request sends
  ``chat_template_kwargs: {enable_thinking: false}``.
* **target**: the tiny target at ``target_dir``, rendered with its own chat template (honoring
  ``chat_template_kwargs``) and decoded greedily; ``<think>…</think>`` is split into ``reasoning_content``
  like SGLang's ``--reasoning-parser qwen3``.

Token ids are returned as vLLM does when the request body has ``return_token_ids: true``
(``prompt_token_ids`` at the top level, ``choices[0].token_ids``; on ``/v1/completions`` both in
``choices[0]``).

``/v1/completions`` answers ``choices[0].text`` in the OpenAI completions format. A token-id prompt is
decoded with the target's tokenizer (target mode) or ``tokenizer_dir``'s (canned mode; without one the
ids stand for themselves); a string prompt is tokenized with special tokens added, as vLLM/SGLang do.
Target mode continues the prompt greedily; canned mode answers ``"Completion <sha8> of a <n>-word
prompt."``, and with ``reasoning=True`` puts a ``<think>…</think>`` block before it unless the prompt
already ends with a closed one (the template's "thinking disabled" generation prompt); a prompt that
ends with an open ``<think>`` gets only the rest of the block, as a model would write it.

Speculative-decoding metrics (``spec_accept_length=τ``): every answer then carries SGLang-style
``meta_info`` (``spec_accept_length``, ``spec_verify_ct`` = ⌈completion tokens / τ⌉) unless
``spec_meta_info=False``, and ``/metrics`` exposes vLLM's counters ``vllm:spec_decode_num_drafts_total``
(one per verify step) and ``vllm:spec_decode_num_accepted_tokens_total`` (completion tokens − verify
steps), so ``evaluate.server_acceptance`` can be tested in both modes.

Faults (a mutable :class:`Faults`, changeable while the server runs) apply to generation requests (chat
and completions, counted together and numbered 1, 2, … in order of arrival): first ``drop_first``
requests get their connection dropped, the next ``hang_first`` get no answer for ``hang_s`` seconds (then
a dropped connection), the next ``fail_first`` get HTTP ``fail_status`` (with ``Retry-After`` if set);
after that, request numbers that are multiples of ``drop_every`` / ``hang_every`` / ``fail_every`` get
the same faults (checked in that order), and every other request is answered after ``delay_s`` seconds.
After ``die_after`` such requests every request (``/v1/models`` and ``/health`` included; not
``/metrics`` and ``/stats``) is dropped, like a crashed server. Marker strings in the last user message
(anywhere in a completions prompt) force a 400 (``bad_request_marker``), an answer that carries reasoning
although thinking was disabled (``wrong_content_marker``), or a malformed 200 body
(``malformed_marker``). Every request is counted (:class:`ServerStats`) per first user message and per
exact conversation (a completions prompt: its text for both), so tests can assert that nothing was sent
twice; ``GET /stats`` returns the same counts to other processes.

Use :func:`start_test_server` (a context manager; the server runs in a background thread) or the CLI
(``--help`` lists a flag for every field of :class:`Faults`)::

    python -m dflash_pipeline.testing.server --port 0 --target resources/demo-target --port-file p.txt
    python -m dflash_pipeline.testing.server --port 31001 --fail-every 5 --delay-s 0.5 --die-after 300
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import re
import signal
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from aiohttp import web

#: Model id served when none is given.
DEFAULT_MODEL_NAME = "test-model"


@dataclass
class Faults:
    """Fault plan of a :class:`TestServer` (counts are numbers of chat + completions requests, in arrival
    order; times in seconds). ``*_first`` take consecutive requests from the start (drops, then hangs,
    then failures); ``*_every = N`` (0 = off) takes every later request whose number is a multiple of N
    (drop before hang before fail)."""

    drop_first: int = 0
    hang_first: int = 0
    hang_s: float = 30.0
    fail_first: int = 0
    fail_status: int = 503
    retry_after_s: float | None = None
    drop_every: int = 0
    hang_every: int = 0
    fail_every: int = 0
    delay_s: float = 0.0
    die_after: int | None = None
    bad_request_marker: str = "[[400]]"
    wrong_content_marker: str = "[[WRONG]]"
    malformed_marker: str = "[[MALFORMED]]"


@dataclass
class ServerStats:
    """What the server saw. ``by_prompt`` is keyed by the first user message of the request,
    ``by_conversation`` by the canonical JSON of the messages sent (role + content); for completions
    requests both by the prompt text. ``chat_requests`` counts chat and completions requests,
    ``completions_requests`` the latter alone."""

    chat_requests: int = 0
    completions_requests: int = 0
    models_requests: int = 0
    answered: int = 0
    statuses: Counter = field(default_factory=Counter)
    by_prompt: Counter = field(default_factory=Counter)
    by_conversation: Counter = field(default_factory=Counter)
    requests: list = field(default_factory=list)  # request bodies (dicts), in arrival order
    unauthorized: int = 0
    spec_drafts: int = 0  # verify steps (vLLM spec_decode_num_drafts), when spec_accept_length is set
    spec_accepted_tokens: int = 0  # accepted draft tokens (vLLM spec_decode_num_accepted_tokens)


def _first_user(messages: list[dict]) -> str:
    return next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")


def _conversation_key(messages: list[dict]) -> str:
    norm = [{"role": m.get("role"), "content": m.get("content")} for m in messages]
    return json.dumps(norm, sort_keys=True, ensure_ascii=False)


def _fake_id(word: str) -> int:
    return int.from_bytes(hashlib.sha256(word.encode("utf-8")).digest()[:2], "little") % 30000 + 100


def split_think(text: str) -> tuple[str | None, str]:
    """Split generated text into (reasoning, content) like a Qwen3 reasoning parser (the pipeline's own
    :func:`dflash_pipeline.completions.split_reasoning`)."""
    from ..completions import split_reasoning

    return split_reasoning(text)


class _TargetModel:
    """Greedy generation with the tiny target (runs in one worker thread; requests are serialized)."""

    def __init__(self, target_dir: str | Path):
        import torch
        from transformers import AutoModelForCausalLM

        from ..chat import load_tokenizer

        self.torch = torch
        self.tok = load_tokenizer(target_dir)
        self.model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tok.eos_token_id is not None and self.tok.eos_token_id not in eos:
            eos.append(self.tok.eos_token_id)
        self.eos_ids = eos
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else eos[0]

    def answer(self, messages: list[dict], template_kwargs: dict, max_tokens: int):
        msgs = [{k: v for k, v in m.items() if v is not None} for m in messages]
        text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **template_kwargs)
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return self.complete(ids, max_tokens)

    def complete(self, ids: list[int], max_tokens: int):
        """Greedy continuation of prompt ``ids``: ``(text, finish_reason, ids, output ids)``."""
        with self.torch.inference_mode():
            out = self.model.generate(
                self.torch.tensor([ids]),
                attention_mask=self.torch.ones(1, len(ids), dtype=self.torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=self.eos_ids,
                pad_token_id=self.pad_id,
            )
        from ..completions import cut_at_eos

        new, stop = cut_at_eos(out[0, len(ids):].tolist(), self.eos_ids)
        body = new[:-1] if stop else new
        generated = self.tok.decode(body, skip_special_tokens=True)  # as SGLang/vLLM by default
        return generated, ("stop" if stop else "length"), ids, new


class TestServer:
    """An OpenAI-compatible server on 127.0.0.1 running in a background thread.

    Args:
        target_dir: serve the tiny target at this path (greedy); None = canned answers.
        model_name: id listed by ``/v1/models`` and echoed in answers.
        faults: the fault plan (mutable while running; see :class:`Faults`).
        reasoning: canned mode only: act like a thinking model behind a reasoning parser (on
            ``/v1/completions``: write a ``<think>`` block into the text).
        tokenizer_dir: canned mode: decode token-id prompts of ``/v1/completions`` with this tokenizer.
        reasoning_field: response field that carries reasoning (``reasoning_content`` as SGLang and
            older vLLM, ``reasoning`` as newer vLLM).
        api_key: if set, requests without ``Authorization: Bearer <api_key>`` get 401.
        port: TCP port (0 = a free one).
        host: address to bind (``0.0.0.0`` = every interface; :attr:`base_url` then names 127.0.0.1).
        spec_accept_length: act like an engine with a drafter loaded that reports this acceptance
            length (canned speculative metrics; see the module docstring). None = no such metrics.
        spec_meta_info: with ``spec_accept_length``, also put ``meta_info`` in each answer (SGLang);
            False = counters on ``/metrics`` only (vLLM).
    """

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
    ):
        self.spec_accept_length = spec_accept_length
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
        self._target: _TargetModel | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._stopping: asyncio.Event | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        """``http://<host>:<port>/v1`` (what a client passes as ``base_url``; 127.0.0.1 when bound to
        every interface)."""
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
        """Start serving on the running loop (used by the CLI and by :meth:`start`)."""
        if self.target_dir is not None and self._target is None:
            self._target = _TargetModel(self.target_dir)
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-server-gen")
        if self._target is not None:
            self._tok = self._target.tok
        elif self.tokenizer_dir is not None and self._tok is None:
            from ..chat import load_tokenizer

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

    @staticmethod
    def _drop(request: web.Request) -> web.Response:
        if request.transport is not None:
            request.transport.abort()
        return web.Response(status=500)  # never reaches the client: the connection is gone

    def _check_auth(self, request: web.Request) -> web.Response | None:
        if self.api_key is None:
            return None
        if request.headers.get("Authorization") != f"Bearer {self.api_key}":
            self.stats.unauthorized += 1
            return web.json_response({"error": {"message": "invalid api key", "type": "auth"}}, status=401)
        return None

    async def _health(self, request: web.Request) -> web.Response:
        if self._dead():
            return self._drop(request)
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        if self._dead():
            return self._drop(request)
        self.stats.models_requests += 1
        denied = self._check_auth(request)
        if denied is not None:
            return denied
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "test"}]})

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
        """What ``GET /stats`` answers: every :class:`ServerStats` counter (statuses keyed by their string),
        ``by_prompt`` and ``by_conversation`` as ``{key: requests}`` in first-arrival order, and ``dead``
        (``die_after`` reached). Request bodies are left out."""
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
            "by_prompt": dict(s.by_prompt),
            "by_conversation": dict(s.by_conversation),
        }

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats_json(), dumps=lambda o: json.dumps(o, ensure_ascii=False))

    def _fault_of(self, n: int) -> str | None:
        """``"drop"``, ``"hang"``, ``"fail"`` or None: what the fault plan does to generation request ``n``."""
        f = self.faults
        if n <= f.drop_first:
            return "drop"
        if n <= f.drop_first + f.hang_first:
            return "hang"
        if n <= f.drop_first + f.hang_first + f.fail_first:
            return "fail"
        for kind, every in (("drop", f.drop_every), ("hang", f.hang_every), ("fail", f.fail_every)):
            if every > 0 and n % every == 0:
                return kind
        return None

    async def _inject_faults(self, request: web.Request, n: int) -> web.StreamResponse | None:
        """The fault plan's answer to generation request number ``n`` (None: answer normally)."""
        stats, f = self.stats, self.faults
        fault = self._fault_of(n)
        if fault == "drop":
            stats.statuses["dropped"] += 1
            return self._drop(request)
        if fault == "hang":
            stats.statuses["hung"] += 1
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), f.hang_s)
            return self._drop(request)
        if fault == "fail":
            stats.statuses[f.fail_status] += 1
            headers = {"Retry-After": f"{f.retry_after_s:g}"} if f.retry_after_s is not None else None
            return web.json_response(
                {"error": {"message": f"injected failure {f.fail_status}", "type": "server_error"}},
                status=f.fail_status,
                headers=headers,
            )
        if f.delay_s > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), f.delay_s)
        return None

    def _marker_response(self, text: str) -> web.Response | None:
        """A 400 or a malformed 200 forced by a marker in ``text`` (None: no such marker)."""
        stats, f = self.stats, self.faults
        if f.bad_request_marker and f.bad_request_marker in text:
            stats.statuses[400] += 1
            return web.json_response(
                {"error": {"message": "injected bad request: prompt is too long", "type": "invalid_request_error"}},
                status=400,
            )
        if f.malformed_marker and f.malformed_marker in text:
            stats.statuses["malformed"] += 1
            return web.Response(status=200, text='{"choices": [', content_type="application/json")
        return None

    def _finish(self, resp: dict, out_ids: list[int]) -> web.Response:
        """Add speculative metrics (when configured), count the answer and send it."""
        stats = self.stats
        if self.spec_accept_length is not None and out_ids:
            verify = max(1, math.ceil(len(out_ids) / max(1.0, self.spec_accept_length)))
            stats.spec_drafts += verify
            stats.spec_accepted_tokens += len(out_ids) - verify
            if self.spec_meta_info:
                resp["meta_info"] = {"spec_accept_length": self.spec_accept_length, "spec_verify_ct": verify}
        stats.statuses[200] += 1
        stats.answered += 1
        return web.json_response(resp)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        if self._dead():
            return self._drop(request)
        stats, f = self.stats, self.faults
        stats.chat_requests += 1
        n = stats.chat_requests
        denied = self._check_auth(request)
        if denied is not None:
            stats.statuses[401] += 1
            return denied
        try:
            body = await request.json()
            messages = list(body["messages"])
        except (ValueError, KeyError, TypeError):
            stats.statuses[400] += 1
            return web.json_response({"error": {"message": "body must be JSON with `messages`"}}, status=400)
        stats.requests.append(body)
        stats.by_prompt[_first_user(messages)] += 1
        stats.by_conversation[_conversation_key(messages)] += 1
        faulted = await self._inject_faults(request, n)
        if faulted is not None:
            return faulted

        last_user = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "user"), "")
        marked = self._marker_response(last_user)
        if marked is not None:
            return marked

        kwargs = dict(body.get("chat_template_kwargs") or {})
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 256)
        if self._target is not None:
            text, finish, prompt_ids, out_ids = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._target.answer, messages, kwargs, max_tokens
            )
            reasoning, content = split_think(text)
            if reasoning is not None and not reasoning and kwargs.get("enable_thinking") is False:
                reasoning = None  # an empty think block is the template's, not the model's
        else:
            reasoning, content, finish, prompt_ids, out_ids = self._canned(messages, kwargs, max_tokens)
        if f.wrong_content_marker and f.wrong_content_marker in last_user:
            reasoning = "unexpected reasoning"

        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message[self.reasoning_field] = reasoning
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        resp = self._envelope("chatcmpl", "chat.completion", n, body, choice, prompt_ids, out_ids)
        if body.get("return_token_ids"):
            resp["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = out_ids
        return self._finish(resp, out_ids)

    def _canned(self, messages: list[dict], kwargs: dict, max_tokens: int):
        n_user = sum(1 for m in messages if m.get("role") == "user")
        last_user = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "user"), "")
        words = f"Answer {n_user} to: {last_user}".split()
        finish = "stop"
        if len(words) > max_tokens:
            words, finish = words[:max_tokens], "length"
        reasoning = None
        if self.reasoning and kwargs.get("enable_thinking") is not False:
            reasoning = f"Let me think about turn {n_user}."
        prompt_words = " ".join(f"{m.get('role')}: {m.get('content') or ''}" for m in messages).split()
        out_ids = [_fake_id(w) for w in words] + ([2] if finish == "stop" else [])
        return reasoning, " ".join(words), finish, [_fake_id(w) for w in prompt_words], out_ids

    def _prompt_of(self, prompt: Any) -> tuple[str, list[int]]:
        """``(text, token ids)`` of a completions ``prompt``: a string (tokenized with special tokens, as
        vLLM/SGLang do) or a list of token ids (decoded verbatim). Raises ValueError on anything else."""
        if isinstance(prompt, str):
            if self._tok is not None:
                return prompt, list(self._tok(prompt, add_special_tokens=True)["input_ids"])
            return prompt, [_fake_id(w) for w in prompt.split()]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if self._tok is not None:
                return self._tok.decode(prompt, skip_special_tokens=False), list(prompt)
            return " ".join(str(t) for t in prompt), list(prompt)
        raise ValueError("`prompt` must be a string or a non-empty list of token ids (one prompt per request)")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        if self._dead():
            return self._drop(request)
        stats, f = self.stats, self.faults
        stats.chat_requests += 1
        stats.completions_requests += 1
        n = stats.chat_requests
        denied = self._check_auth(request)
        if denied is not None:
            stats.statuses[401] += 1
            return denied
        try:
            body = await request.json()
            text, prompt_ids = self._prompt_of(body["prompt"])
        except (ValueError, KeyError, TypeError) as exc:
            stats.statuses[400] += 1
            return web.json_response({"error": {"message": f"body must be JSON with `prompt`: {exc}"}}, status=400)
        stats.requests.append(body)
        stats.by_prompt[text] += 1
        stats.by_conversation[text] += 1
        faulted = await self._inject_faults(request, n)
        if faulted is not None:
            return faulted
        marked = self._marker_response(text)
        if marked is not None:
            return marked

        max_tokens = int(body.get("max_tokens") or 16)  # the OpenAI completions default
        wrong = bool(f.wrong_content_marker and f.wrong_content_marker in text)
        if self._target is not None:
            generated, finish, prompt_ids, out_ids = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._target.complete, prompt_ids, max_tokens
            )
            if wrong:
                generated = "<think>\nunexpected reasoning\n</think>\n\n" + generated
        else:
            generated, finish, out_ids = self._canned_text(text, max_tokens, wrong)
        choice: dict[str, Any] = {"index": 0, "text": generated, "finish_reason": finish, "logprobs": None}
        if body.get("return_token_ids"):  # vLLM puts both in the choice for completions
            choice["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = out_ids
        resp = self._envelope("cmpl", "text_completion", n, body, choice, prompt_ids, out_ids)
        return self._finish(resp, out_ids)

    def _envelope(self, id_prefix: str, obj: str, n: int, body: dict, choice: dict, prompt_ids: list[int],
                  out_ids: list[int]) -> dict[str, Any]:
        """The OpenAI response around one choice (``id``, ``object``, ``model``, ``usage`` in tokens)."""
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

    def _canned_text(self, prompt: str, max_tokens: int, wrong: bool) -> tuple[str, str, list[int]]:
        """Canned continuation of a raw prompt: ``(text, finish_reason, output ids)``; one "token" per
        whitespace-separated piece (whitespace kept, so a cut inside the think block looks like one)."""
        digest = hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:8]
        answer = f"Completion {digest} of a {len(prompt.split())}-word prompt."
        tail = prompt.rstrip()
        think = ""
        if wrong or (self.reasoning and not tail.endswith("</think>")):
            thought = "unexpected reasoning" if wrong else f"Let me think about prompt {digest}."
            think = f"{thought}\n</think>\n\n" if tail.endswith("<think>") else f"<think>\n{thought}\n</think>\n\n"
        pieces = re.findall(r"\S+\s*", think + answer)
        finish = "stop"
        if len(pieces) > max_tokens:
            pieces, finish = pieces[:max_tokens], "length"
        out_ids = [_fake_id(p.strip()) for p in pieces] + ([2] if finish == "stop" else [])
        return "".join(pieces), finish, out_ids


@contextlib.contextmanager
def start_test_server(**kwargs) -> Iterator[TestServer]:
    """Run a :class:`TestServer` (same keyword arguments) for the duration of a ``with`` block."""
    server = TestServer(**kwargs).start()
    try:
        yield server
    finally:
        server.stop()


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a count >= 0, got {text}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def _status(text: str) -> int:
    value = int(text)
    if not 100 <= value <= 599:
        raise argparse.ArgumentTypeError(f"must be an HTTP status 100-599, got {text}")
    return value


def _accept_length(text: str) -> float:
    value = float(text)
    if not (value >= 1 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be an acceptance length >= 1, got {text}")
    return value


_CLI_EPILOG = """\
Generation requests (POST /v1/chat/completions and /v1/completions, counted together) are numbered
1, 2, ... in arrival order. The *-first faults take consecutive requests from the start, in the order
drops, hangs, failures (e.g. --drop-first 1 --fail-first 2: request 1 is dropped, 2 and 3 fail); the
*-every faults then take every request whose number is a multiple of N (drop before hang before fail);
every other request is answered after --delay-s. Once --die-after requests have arrived, the server
acts crashed: every later request (/v1/models and /health included) has its connection dropped and is
not counted; /metrics and /stats keep answering. The process keeps running until SIGINT/SIGTERM.

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions, GET /health,
GET /metrics (Prometheus text: totals per status), GET /stats (JSON: the totals plus by_prompt =
{first user message (completions: the prompt text): requests received} and by_conversation =
{canonical JSON of the messages: requests received}).

On start it prints "READY <base_url>" (e.g. READY http://127.0.0.1:31001/v1) on stdout and the active
fault plan on stderr.

example: a server that fails every 5th request with 429 (Retry-After: 2) and answers the rest after 0.5 s
  python -m dflash_pipeline.testing.server --port 31001 --fail-every 5 --fail-status 429 \\
      --retry-after-s 2 --delay-s 0.5
"""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m dflash_pipeline.testing.server",
        description=__doc__.split("\n")[0],
        epilog=_CLI_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = Faults()
    srv = ap.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to bind (default: %(default)s; 0.0.0.0 = every interface, the printed "
                          "base_url then names 127.0.0.1)")
    srv.add_argument("--port", type=int, default=0, help="TCP port (default: 0 = a free one; read it from "
                                                         "the READY line or --port-file)")
    srv.add_argument("--port-file", default=None, metavar="FILE",
                     help="write the bound port to FILE (atomically) once listening")
    srv.add_argument("--api-key-env", default=None, metavar="VAR",
                     help="require 'Authorization: Bearer <key>' with the key held by environment variable "
                          "VAR; other requests get 401 (default: no key)")

    ans = ap.add_argument_group("answers")
    ans.add_argument("--target", default=None, metavar="DIR",
                     help="serve the causal LM at DIR (e.g. resources/demo-target) with its chat template, "
                          "greedy, one request at a time (needs torch and transformers; meant for tiny "
                          "models). Default: canned answers ('Answer <turn> to: <last user message>', one "
                          "token per word)")
    ans.add_argument("--tokenizer", default=None, metavar="DIR",
                     help="canned mode: decode token-id prompts of /v1/completions (and tokenize string "
                          "prompts) with the tokenizer at DIR (default: ids stand for themselves)")
    ans.add_argument("--model-name", default=DEFAULT_MODEL_NAME,
                     help="model id listed by /v1/models and echoed in answers to requests without "
                          "'model' (default: %(default)s)")
    ans.add_argument("--reasoning", action="store_true",
                     help="canned mode: act like a thinking model behind a reasoning parser: chat answers "
                          "carry reasoning unless the request sends chat_template_kwargs.enable_thinking="
                          "false; completions text starts with a <think> block unless the prompt ends "
                          "with </think>")
    ans.add_argument("--reasoning-field", default="reasoning_content", choices=["reasoning_content", "reasoning"],
                     help="response field that carries reasoning (default: %(default)s as SGLang and older "
                          "vLLM; 'reasoning' as newer vLLM)")
    ans.add_argument("--spec-accept-length", type=_accept_length, default=None, metavar="TAU",
                     help="act like an engine with a drafter of acceptance length TAU (>= 1): answers carry "
                          "SGLang meta_info.spec_accept_length/spec_verify_ct and /metrics vLLM's "
                          "spec_decode counters (default: none)")
    ans.add_argument("--no-spec-meta-info", action="store_true",
                     help="with --spec-accept-length: leave meta_info out of answers (vLLM: /metrics only)")

    flt = ap.add_argument_group("faults (generation requests only; see the numbering below)")
    flt.add_argument("--delay-s", type=_seconds, default=d.delay_s, metavar="S",
                     help="answer every non-faulted chat or completions request after S seconds "
                          "(default: %(default)s)")
    flt.add_argument("--drop-first", type=_count, default=d.drop_first, metavar="N",
                     help="drop the connection of the first N requests without an answer (default: %(default)s)")
    flt.add_argument("--hang-first", type=_count, default=d.hang_first, metavar="N",
                     help="the N requests after the drops get no answer for --hang-s seconds, then a dropped "
                          "connection (a client timeout shorter than --hang-s sees a timeout; default: %(default)s)")
    flt.add_argument("--fail-first", type=_count, default=d.fail_first, metavar="N",
                     help="the N requests after the drops and hangs get HTTP --fail-status (default: %(default)s)")
    flt.add_argument("--drop-every", type=_count, default=d.drop_every, metavar="N",
                     help="drop the connection of every request whose number is a multiple of N "
                          "(default: %(default)s = off)")
    flt.add_argument("--hang-every", type=_count, default=d.hang_every, metavar="N",
                     help="hang every request whose number is a multiple of N, as --hang-first does "
                          "(default: %(default)s = off)")
    flt.add_argument("--fail-every", type=_count, default=d.fail_every, metavar="N",
                     help="answer every request whose number is a multiple of N with HTTP --fail-status, "
                          "i.e. a failure rate of 1/N (default: %(default)s = off)")
    flt.add_argument("--hang-s", type=_seconds, default=d.hang_s, metavar="S",
                     help="how long a hung request waits before its connection is dropped (seconds; "
                          "default: %(default)s)")
    flt.add_argument("--fail-status", type=_status, default=d.fail_status, metavar="CODE",
                     help="HTTP status of --fail-first/--fail-every failures, e.g. 500, 503, or 429 for rate "
                          "limiting (default: %(default)s); the body is an OpenAI error object")
    flt.add_argument("--retry-after-s", type=_seconds, default=d.retry_after_s, metavar="S",
                     help="send 'Retry-After: S' (seconds) with --fail-first/--fail-every failures "
                          "(default: no header)")
    flt.add_argument("--die-after", type=_count, default=d.die_after, metavar="N",
                     help="after N requests, act crashed: drop every later connection, /v1/models and /health "
                          "included (/metrics and /stats keep answering; default: never)")
    flt.add_argument("--bad-request-marker", default=d.bad_request_marker, metavar="TEXT",
                     help="a request whose last user message (completions: prompt) contains TEXT gets HTTP 400 "
                          "'prompt is too long' (default: %(default)s; '' = off)")
    flt.add_argument("--wrong-content-marker", default=d.wrong_content_marker, metavar="TEXT",
                     help="a request whose last user message (completions: prompt) contains TEXT gets an answer "
                          "that carries reasoning even though thinking was disabled (default: %(default)s; "
                          "'' = off)")
    flt.add_argument("--malformed-marker", default=d.malformed_marker, metavar="TEXT",
                     help="a request whose last user message (completions: prompt) contains TEXT gets HTTP 200 "
                          "with a truncated, unparsable JSON body (default: %(default)s; '' = off)")
    return ap


def faults_summary(faults: Faults) -> str:
    """The fields of ``faults`` that differ from the defaults, as ``name=value`` (``none`` if all do not)."""
    default = Faults()
    changed = [f"{k}={v!r}" for k, v in vars(faults).items() if getattr(default, k) != v]
    return " ".join(changed) or "none"


def main(argv: list[str] | None = None) -> int:
    """CLI: serve until SIGINT/SIGTERM. Prints ``READY <base_url>`` on stdout once listening."""
    args = _parser().parse_args(argv)

    import os

    api_key = os.environ[args.api_key_env] if args.api_key_env else None
    faults = Faults(
        drop_first=args.drop_first,
        hang_first=args.hang_first,
        hang_s=args.hang_s,
        fail_first=args.fail_first,
        fail_status=args.fail_status,
        retry_after_s=args.retry_after_s,
        drop_every=args.drop_every,
        hang_every=args.hang_every,
        fail_every=args.fail_every,
        delay_s=args.delay_s,
        die_after=args.die_after,
        bad_request_marker=args.bad_request_marker,
        wrong_content_marker=args.wrong_content_marker,
        malformed_marker=args.malformed_marker,
    )
    server = TestServer(
        target_dir=args.target,
        model_name=args.model_name,
        faults=faults,
        reasoning=args.reasoning,
        reasoning_field=args.reasoning_field,
        tokenizer_dir=args.tokenizer,
        api_key=api_key,
        port=args.port,
        host=args.host,
        spec_accept_length=args.spec_accept_length,
        spec_meta_info=not args.no_spec_meta_info,
    )

    async def serve() -> None:
        await server.start_async()
        if args.port_file:
            tmp = Path(args.port_file + ".tmp")
            tmp.write_text(f"{server.port}\n")
            tmp.replace(args.port_file)
        print(f"READY {server.base_url}", flush=True)
        print(f"test server {server.base_url}: model {server.model_name!r}, "
              f"{'target ' + str(args.target) if args.target else 'canned answers'}, "
              f"faults: {faults_summary(faults)}", file=sys.stderr, flush=True)
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, done.set)
        await done.wait()
        await server.stop_async()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
