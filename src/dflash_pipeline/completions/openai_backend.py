"""The openai backend (`generation.backend: openai`): `AsyncOpenAI` clients against the fleet, `POST
/chat/completions` (`generation.api: chat`) or `POST /completions` with token ids (`api: completions`).

One request (`_complete`): acquire an endpoint, one attempt, release it, act on the `retry.Failure`. A
conversation answers its user turns in order; `run` runs them on one event loop or on client processes
(`.workers`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from collections import Counter
from typing import Any, Sequence

from dflash_pipeline.core.config import generation_problems
from dflash_pipeline.core.contracts import has_tools
from dflash_pipeline.core.errors import ConfigError
from dflash_pipeline.target.chat import load_tokenizer, render, template_kwargs

from . import retry
from .describe import _describe
from .fleet import _auth_error, _Endpoint, _Fleet
from .records import (
    DISABLE_HINT_LOCAL,
    TOOLS_NEED_CHAT,
    Dialogue,
    OnDone,
    RowError,
    RunInfo,
    Turn,
    build_record,
    check_thinking,
    context_limit,
    redact_url,
    skipped_record,
    take_reasoning,
)
from .stats import fleet_stats

log = logging.getLogger(__package__)  # one logger for the whole completions stage


def _first_choice(data: Any) -> dict:
    """`choices[0]` of a response's JSON. Raises ValueError (malformed: retried) when there is none."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError("response has no choices")
    return choices[0]


def _first_present(*values):
    """The first of `values` that is not None (an empty list is an answer: zero ids)."""
    return next((v for v in values if v is not None), None)


def _turn(resp: dict, choice: dict, content: str, reasoning, latency: float, ep: _Endpoint) -> Turn:
    """The `Turn` of one answered request: its text split into `content` and `reasoning`, the `choice`'s finish
    reason (`stop` when it gives none), the latency (seconds), the endpoint and the response's facts."""
    return Turn(
        content=content,
        reasoning_content=reasoning,
        finish_reason=choice.get("finish_reason") or "stop",
        latency_s=round(latency, 6),
        endpoint=ep.url,
        **_response_facts(resp, choice),
    )


def _response_facts(data: dict, choice: dict) -> dict:
    """`prompt_tokens`, `completion_tokens` (`usage`) and `prompt_token_ids`, `output_token_ids` of a response's
    JSON, as `Turn` keywords (ids None when absent), read where the engines put them: vLLM's
    `return_token_ids`, SGLang's `return_token_ids` (the raw ids before reasoning parsing; sgl-project/sglang
    PR #30917) and SGLang's response-level `sglext` (PR #34488)."""
    usage = data.get("usage") or {}
    ext = data.get("sglext") if isinstance(data.get("sglext"), dict) else {}
    ext_out = ext.get("output_ids")
    index = choice.get("index") or 0
    ext_out = ext_out[index] if isinstance(ext_out, list) and len(ext_out) > index else None
    prompt_ids = _first_present(data.get("prompt_token_ids"), choice.get("prompt_token_ids"), ext.get("input_ids"))
    out_ids = _first_present(choice.get("token_ids"), choice.get("output_token_ids"), ext_out)
    return {
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "prompt_token_ids": list(prompt_ids) if prompt_ids is not None else None,
        "output_token_ids": list(out_ids) if out_ids is not None else None,
    }


def _answer_calls(calls: Any) -> list[dict] | None:
    """The `tool_calls` of an answer's message as a list of OpenAI calls (None: no call). Raises ValueError
    (malformed: retried) when it is not a list of calls with a function name."""
    if not calls:
        return None
    if not isinstance(calls, list):
        raise ValueError("message tool_calls is not a list")
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"message tool_calls holds no function call: {call!r}")
    return calls


#: `generation.extra_body` fields that ask the server for token ids: vLLM's and SGLang's per-choice ids
#: (`return_token_ids`), or SGLang's response-level `sglext` ids (both of its flags).
TOKEN_ID_FIELDS = ("return_token_ids", ("return_input_ids_in_sglext", "return_output_ids_in_sglext"))


def asked_token_ids(extra_body: dict) -> str:
    """The `extra_body` fields of `TOKEN_ID_FIELDS` that are set, joined (`''`: none asks for ids)."""
    for field in TOKEN_ID_FIELDS:
        names = (field,) if isinstance(field, str) else field
        if all(extra_body.get(n) for n in names):
            return " and ".join(names)
    return ""


def _ids_ignored_error(ep: _Endpoint, fields: str) -> ConfigError:
    """The endpoint answered without the token ids `generation.extra_body` asks for (`fields`): it does not know the
    field (an SGLang before PR #30917 ignores `return_token_ids`). A configuration error, so the run stops at the first
    answer instead of generating a fleet's worth of records the tokens stage then has to render."""
    return ConfigError(
        f"{ep.url} answered without token ids although generation.extra_body sets {fields}: the server ignores "
        f"the field. SGLang returns them per choice from v0.5.18 (sgl-project/sglang PR #30917, return_token_ids; "
        f"non-streaming chat and completions) and in the response's sglext from PR #34488 "
        f"(return_input_ids_in_sglext + return_output_ids_in_sglext); vLLM with return_token_ids (vllm-project/vllm "
        f"PR #22587). Upgrade the server, or drop the field from generation.extra_body (records then carry no "
        f"ids and the tokens stage renders the chat template)"
    )


def _aiohttp_client(max_concurrency: int, timeout_s: float):
    """openai's aiohttp transport (about 2x the requests/s of the default one, feasibility.md §8) with
    a connection pool sized to the endpoint's concurrency; None (= the default transport) if missing."""
    import openai

    try:
        import httpx2
    except ImportError:
        return None
    limits = httpx2.Limits(max_connections=max_concurrency + 8, max_keepalive_connections=max_concurrency + 8)
    try:
        return openai.DefaultAioHttpClient(limits=limits, timeout=timeout_s)
    except RuntimeError:  # the aiohttp extra is not installed
        log.info("aiohttp not installed: using the openai client's default transport (slower)")
        return None


class OpenAIBackend:
    """Generation against OpenAI-compatible servers (`generation.backend: openai`).

    With `generation.api: completions` the target's tokenizer (`target_dir`, `chat_template`,
    `trust_remote_code` as `target.*`) is loaded once here and renders every request.

    `resolved_model`: the model a parent process settled from `GET /models` (`generation.model`
    unset), so that its client processes send and check that one.

    Raises:
        ConfigError: no endpoints, `api_key_env` names an unset variable, or completions mode without
            `target_dir` or with `extra_body.chat_template_kwargs`.
    """

    def __init__(
        self,
        gen_cfg: dict,
        *,
        target_dir=None,
        chat_template=None,
        trust_remote_code=False,
        resolved_model: str | None = None,
    ):
        problems = generation_problems(gen_cfg, target_dir=target_dir, backend="openai")
        if problems:
            raise ConfigError("; ".join(problems))
        self.cfg = gen_cfg
        self.api = gen_cfg["api"]
        self.tok = None
        self._opens_think = False
        if self.api == "completions":
            self.tok = load_tokenizer(target_dir, chat_template=chat_template, trust_remote_code=trust_remote_code)
            # Templates that open <think> in the generation prompt (DeepSeek-R1, Qwen3 thinking-2507) make
            # the completion start inside the reasoning; known once per template and mode.
            probe = render(
                self.tok, [{"role": "user", "content": "x"}], thinking=gen_cfg["thinking"], add_generation_prompt=True
            )
            self._opens_think = probe.rstrip().endswith("<think>")
        # raw mode renders each turn here, so a turn that outgrows the target's context is skipped, not sent
        self.context_limit = context_limit(target_dir) if self.api == "completions" else None
        self.model = gen_cfg["model"] or resolved_model or ""
        self._probed = False  # whether resolve_model/_discover checked the fleet's /models in this process
        # what a client process needs to build its own copy (keys come from its inherited environment)
        self._init_kw = {
            "target_dir": target_dir,
            "chat_template": chat_template,
            "trust_remote_code": trust_remote_code,
        }
        self._keys = [os.environ[ep["api_key_env"]] if ep["api_key_env"] else "EMPTY" for ep in gen_cfg["endpoints"]]
        self.stats: Counter = Counter()
        self._asks_ids = asked_token_ids(gen_cfg["extra_body"])

    def _make_fleet(self) -> _Fleet:
        import openai

        eps = []
        for ep_cfg, key in zip(self.cfg["endpoints"], self._keys):
            cap = int(ep_cfg["max_concurrency"])
            http_client = _aiohttp_client(cap, float(self.cfg["request_timeout_s"]))
            client = openai.AsyncOpenAI(
                base_url=ep_cfg["base_url"],
                api_key=key,
                max_retries=0,
                timeout=float(self.cfg["request_timeout_s"]),
                http_client=http_client,
            )
            eps.append(
                _Endpoint(
                    url=redact_url(ep_cfg["base_url"]),
                    client=client,
                    max_concurrency=cap,
                    key_env=ep_cfg["api_key_env"],
                )
            )
        return _Fleet(eps, self.cfg, model=self.model or None)

    def _request_kwargs(self, history: list[dict], tools: list[dict] | None = None) -> dict:
        cfg = self.cfg
        kw: dict[str, Any] = {
            "model": self.model,
            "messages": history,
            "max_tokens": cfg["max_tokens"],
            "temperature": cfg["temperature"],
            "top_p": cfg["top_p"],
        }
        if tools:  # the function schemas the source offered (OpenAI `tools`; the server's default tool_choice)
            kw["tools"] = tools
        if self.api == "completions":  # token ids of the local render (no second BOS; see the module doc)
            del kw["messages"]
            kw["prompt"] = render(
                self.tok, history, thinking=cfg["thinking"], add_generation_prompt=True, tokenize=True
            )
        if cfg["seed"] is not None:
            kw["seed"] = cfg["seed"]
        extra = dict(cfg["extra_body"])
        if cfg["top_k"] is not None:
            extra.setdefault("top_k", cfg["top_k"])
        tk = template_kwargs(cfg["thinking"]) if self.api == "chat" else {}
        if tk:
            extra["chat_template_kwargs"] = {**(extra.get("chat_template_kwargs") or {}), **tk}
        if extra:
            kw["extra_body"] = extra
        return kw

    def _parse(self, resp: dict, latency: float, ep: _Endpoint) -> Turn:
        """Turn from a response's JSON. Raises RowError (wrong thinking) or ValueError (malformed: retried)."""
        choice = _first_choice(resp)
        msg = choice.get("message")
        if not isinstance(msg, dict):
            raise ValueError("choice has no message")
        content = msg.get("content") or ""
        if not isinstance(content, str):
            raise ValueError("message content is not a string")
        reasoning = msg.get("reasoning_content")
        if reasoning is None:
            reasoning = msg.get("reasoning")
        # no reasoning field: only a think block at the very start of the content (server without a
        # reasoning parser); never a `</think>` later in the answer, never with thinking=disable
        reasoning, content = take_reasoning(content, self.cfg["thinking"], field=reasoning)
        reasoning = check_thinking(self.cfg["thinking"], reasoning, require_reasoning=True)
        turn = _turn(resp, choice, content, reasoning, latency, ep)
        turn.tool_calls = _answer_calls(msg.get("tool_calls"))
        return turn

    def _parse_text(self, resp, latency: float, ep: _Endpoint) -> Turn:
        """Turn from a `/completions` response (`generation.api: completions`): the reasoning is split
        here from `<think>…</think>` in `choices[0].text`. Raises RowError (wrong thinking) or
        ValueError (malformed: retried)."""
        choice = _first_choice(resp)
        text = choice.get("text")
        if not isinstance(text, str):
            raise ValueError("completion choice has no text")
        # the generation prompt may have opened the reasoning (then it ends at the first </think>)
        reasoning, content = take_reasoning(text, self.cfg["thinking"], opened=self._opens_think)
        if self.cfg["thinking"] == "save" and reasoning is None:
            raise RowError(
                "generation.thinking=save but the completion has no <think>…</think> reasoning (with "
                "generation.api=completions it is split from the text); the target did not think under its "
                "template with enable_thinking=true"
            )
        reasoning = check_thinking(
            self.cfg["thinking"], reasoning, require_reasoning=False, disable_hint=DISABLE_HINT_LOCAL
        )
        return _turn(resp, choice, content, reasoning, latency, ep)

    def _request(self, history: list[dict], tools: list[dict] | None = None) -> tuple[str, dict]:
        """`(path, body)` of the request answering `history`'s last user turn.

        Sent with the client's generic post and the JSON parsed here: the typed `create` spends about half of a
        request's client CPU transforming the parameters and building pydantic models of the answer, which caps the
        requests/s on few cores.
        """
        kw = self._request_kwargs(history, tools)
        body = {k: v for k, v in kw.items() if k != "extra_body"}
        body.update(kw.get("extra_body") or {})  # merged over the body, as the SDK does with extra_body
        return ("/completions" if self.api == "completions" else "/chat/completions"), body

    async def _attempt(self, ep: _Endpoint, path: str, body: dict) -> tuple[Turn | None, retry.Failure | None]:
        """One attempt on `ep`: `(turn, None)`, or `(None, failure)` for an HTTP error, a connection
        error or timeout, or a malformed answer. Raises RowError (wrong thinking: not retried)."""
        import openai

        t0 = time.monotonic()
        try:
            raw = await asyncio.wait_for(
                ep.client.post(path, cast_to=bytes, body=body), float(self.cfg["request_timeout_s"])
            )
            resp = json.loads(raw)
        except openai.APIStatusError as exc:
            header = exc.response.headers.get("retry-after") if exc.response is not None else None
            return None, retry.status_failure(exc.status_code, _describe(exc), header, exc)
        except (openai.APIConnectionError, asyncio.TimeoutError) as exc:
            return None, retry.Failure(_describe(exc))
        except (ValueError, openai.APIResponseValidationError) as exc:  # unparseable body
            return None, retry.Failure(f"malformed response: {_describe(exc)}")
        parse = self._parse_text if self.api == "completions" else self._parse
        try:
            turn = parse(resp, time.monotonic() - t0, ep)
        except (ValueError, AttributeError, TypeError, LookupError) as exc:
            return None, retry.Failure(f"malformed response: {exc}")
        if self._asks_ids and (turn.prompt_token_ids is None or turn.output_token_ids is None):
            raise _ids_ignored_error(ep, self._asks_ids)
        return turn, None

    async def _complete(self, fleet: _Fleet, history: list[dict], tools: list[dict] | None = None) -> Turn:
        """The assistant turn answering `history` (`tools` offered), retried per `.retry` on the fleet's
        least busy endpoint. Raises RowError (client error, retries exhausted, wrong thinking) or ConfigError
        (the key was rejected)."""
        path, body = self._request(history, tools)
        attempt = 0
        while True:
            ep = await fleet.acquire()
            self.stats["attempts"] += 1
            try:
                turn, failure = await self._attempt(ep, path, body)
            finally:
                fleet.release(ep)
            if failure is None:
                fleet.success(ep)
                return turn
            if failure.kind == retry.AUTH:
                raise _auth_error(ep, failure.exc)
            if failure.kind == retry.CLIENT:
                fleet.success(ep)  # the server is alive and answered; the request is at fault
                raise RowError(f"{failure.error} (not retried: client error) from {ep.url}")
            if failure.kind == retry.RATE_LIMITED:
                self.stats["rate_limited"] += 1  # backpressure: the endpoint stays in
            else:
                fleet.failure(ep, failure.error)
            attempt += 1
            if attempt > self.cfg["max_retries"]:
                raise RowError(f"gave up after {attempt} attempts; last: {failure.error} from {ep.url}")
            self.stats["retries"] += 1
            await asyncio.sleep(
                retry.retry_delay(
                    attempt,
                    base_s=float(self.cfg["retry_backoff_s"]),
                    max_s=float(self.cfg["retry_backoff_max_s"]),
                    retry_after=failure.retry_after,
                    jitter=random.random(),
                )
            )

    async def _conversation(self, fleet: _Fleet, prompt: dict, info: RunInfo) -> dict:
        walk = Dialogue(prompt)
        while walk.advance():
            history = walk.history
            if self.context_limit:
                n = len(
                    render(self.tok, history, thinking=self.cfg["thinking"], add_generation_prompt=True, tokenize=True)
                )
                if n + self.cfg["max_tokens"] > self.context_limit:
                    return skipped_record(
                        prompt,
                        "too_long",
                        turn=len(walk.turns),
                        prompt_tokens=n,
                        max_tokens=self.cfg["max_tokens"],
                        max_position_embeddings=self.context_limit,
                    )
            try:
                turn = await self._complete(fleet, list(history), walk.tools)
            except RowError as exc:
                return build_record(prompt, walk.turns, info, error=f"turn {len(walk.turns) + 1}: {exc}")
            walk.add(turn)
        return build_record(prompt, walk.turns, info)

    async def _run(self, prompts: Sequence[dict], on_done: OnDone, info: RunInfo) -> dict:
        fleet = self._make_fleet()
        try:
            self.model = await fleet.start()
            info.model = self.model
            queue = list(reversed(prompts))

            async def worker() -> None:
                while queue:
                    prompt = queue.pop()
                    on_done(await self._conversation(fleet, prompt, info))

            n = min(len(prompts), sum(ep.max_concurrency for ep in fleet.eps))
            tasks = [asyncio.ensure_future(worker()) for _ in range(n)]
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await fleet.close()
        return fleet_stats(self.stats, fleet.eps)

    def resolve_model(self) -> str:
        """The model id sent and recorded: `generation.model`, else settled from the endpoints'
        `GET /models` (one probe round, waiting for an endpoint like `run` does). Raises what
        `_Fleet.start` raises."""
        if not self.model:
            asyncio.run(self._discover())
        return self.model

    def run(self, prompts: Sequence[dict], on_done: OnDone, info: RunInfo) -> dict:
        if not prompts:
            return {"requests": 0, "attempts": 0, "retries": 0}
        if self.api == "completions" and any(has_tools(p) for p in prompts):
            raise ConfigError(f"generation.api: completions: {TOOLS_NEED_CHAT}")
        procs = self._client_processes(len(prompts))
        if procs > 1:
            from .workers import run_client_processes

            return run_client_processes(self, prompts, on_done, info, procs)
        return asyncio.run(self._run(prompts, on_done, info))

    # -- several client processes (generation.client_processes > 1) --------------------------------

    def _client_processes(self, n_prompts: int) -> int:
        """Client processes for `n_prompts`: `generation.client_processes`, at most one per prompt and at most the
        smallest per-endpoint cap."""
        want = int(self.cfg["client_processes"])
        if want <= 1:
            return 1
        cap = min(int(ep["max_concurrency"]) for ep in self.cfg["endpoints"])
        n = min(want, n_prompts, cap)
        if n < want:
            log.info(
                "generation.client_processes=%d: using %d (prompts left: %d, smallest endpoint max_concurrency: %d)",
                want,
                n,
                n_prompts,
                cap,
            )
        return n

    async def _discover(self) -> None:
        """Probe the fleet once and set `self.model` to the model it settles (as `_run`; raises what
        `_Fleet.start` raises)."""
        fleet = self._make_fleet()
        try:
            self.model = await fleet.start()
        finally:
            await fleet.close()
        self._probed = True
