"""Completion records: the generated :class:`Turn`, the record built from a prompt and its turns, the
thinking-mode checks, and the prompt-shard reader (``contracts.PROMPT_SCHEMA`` in,
``contracts.COMPLETION_SCHEMA`` rows out). Pure functions: no I/O except :func:`read_prompts`."""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from dflash_pipeline.core import shards
from dflash_pipeline.core.config import schema_default
from dflash_pipeline.core.contracts import PROMPT_ROLES
from dflash_pipeline.core.errors import DataError, strip_url_credentials

#: Called once per finished conversation with its record (status ok/truncated/error).
OnDone = Callable[[dict], None]


@dataclass
class Turn:
    """One generated assistant turn (fields as in ``contracts.TURN_TYPE`` plus the two texts)."""

    content: str
    reasoning_content: str | None
    finish_reason: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    latency_s: float | None = None
    endpoint: str | None = None

    def facts(self) -> dict:
        """The ``turns[i]`` entry of the record."""
        return {
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_token_ids": self.prompt_token_ids,
            "output_token_ids": self.output_token_ids,
            "latency_s": self.latency_s,
            "endpoint": self.endpoint,
        }

    def history_message(self) -> dict:
        """The assistant message appended to the history for the next user turn. An answer without
        reasoning that contains ``</think>`` carries ``reasoning_content: ""``, so the template renders it
        verbatim instead of splitting it there (as :func:`dflash_pipeline.target.chat.template_messages` does for
        the local renders and the tokens stage)."""
        msg = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        elif "</think>" in self.content:
            msg["reasoning_content"] = ""
        return msg


class RowError(Exception):
    """A conversation failed in a way retrying now will not fix; it becomes an error row."""


@dataclass
class RunInfo:
    """What every record of a run shares."""

    model: str
    sampling: str  # canonical JSON
    thinking: str


def sampling_params(gen_cfg: dict) -> dict:
    """The sampling parameters recorded in every record (``extra_body`` only when non-empty, ``api`` only
    when not ``chat``)."""
    out = {k: gen_cfg[k] for k in ("temperature", "top_p", "top_k", "max_tokens", "seed")}
    if gen_cfg["extra_body"]:
        out["extra_body"] = gen_cfg["extra_body"]
    if gen_cfg["api"] != schema_default("generation", "api"):  # so chat-mode records and resume files stay as they were
        out["api"] = gen_cfg["api"]
    return out


def build_record(prompt: dict, turns: Sequence[Turn], info: RunInfo, error: str | None = None) -> dict:
    """Completion record (``COMPLETION_SCHEMA`` as a dict) from a prompt and its generated turns.

    With ``error`` set, the record holds the turns generated before the failure and ``status: error``.
    """
    messages: list[dict] = []
    it = iter(turns)
    n_done = 0
    for m in prompt["messages"]:
        messages.append({"role": m["role"], "content": m["content"], "reasoning_content": None})
        if m["role"] == "user":
            t = next(it, None)
            if t is None:
                break
            messages.append({"role": "assistant", "content": t.content, "reasoning_content": t.reasoning_content})
            n_done += 1
    if error is not None:
        status = "error"
    elif any(t.finish_reason == "length" for t in turns):
        status = "truncated"
    else:
        status = "ok"
    return {
        "prompt_id": prompt["prompt_id"],
        "dataset": prompt["dataset"],
        "messages": messages,
        "turns": [t.facts() for t in turns[:n_done]],
        "model": info.model,
        "sampling": info.sampling,
        "thinking": info.thinking,
        "status": status,
        "error": error,
    }


def context_limit(target_dir: str | Path | None) -> int | None:
    """``max_position_embeddings`` of the target's text model from ``<target_dir>/config.json`` (top level or
    ``text_config`` / ``language_config`` / ``llm_config`` of multimodal configs); None when unknown."""
    if target_dir is None:
        return None
    path = Path(target_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for node in (cfg, *(cfg.get(k) for k in ("text_config", "language_config", "llm_config"))):
        if isinstance(node, dict) and isinstance(node.get("max_position_embeddings"), int):
            return node["max_position_embeddings"]
    return None


#: Examples kept per skip reason in a shard's stats (``skipped_examples``).
MAX_SKIPPED_EXAMPLES = 3


def skipped_record(prompt: dict, reason: str, **example) -> dict:
    """The marker a backend reports (``on_done``) for a conversation it skipped without generating it
    (``reason``, e.g. ``too_long``; ``example``: why, e.g. ``prompt_tokens``, ``limit``). It never goes into
    the shard: :func:`dflash_pipeline.completions.generate_shard` counts it in the stats with an example."""
    return {
        "prompt_id": prompt["prompt_id"],
        "dataset": prompt["dataset"],
        "status": "skipped",
        "turns": [],
        "reason": reason,
        "example": {"prompt_id": prompt["prompt_id"], **example},
    }


def cut_at_eos(new: list[int], eos_ids) -> tuple[list[int], bool]:
    """Generated token ids up to and including the first end-of-turn id (padding after it dropped).

    Returns ``(ids, stopped)``; ``stopped`` is False when no eos id was generated (a length cut).
    """
    for i, t in enumerate(new):
        if t in eos_ids:
            return new[: i + 1], True
    return new, False


def split_reasoning(text: str, *, opened: bool = False) -> tuple[str | None, str]:
    """Split generated text into ``(reasoning, content)`` where reasoning is: a think block at the very
    start of the text, or (``opened``: the generation prompt ended with ``<think>``) the text up to the
    first ``</think>``. A ``</think>`` later in an answer is answer text (an answer that explains chat
    templates), never the end of reasoning.

    ``"<think>\\nR\\n</think>\\n\\nC"`` → ``("R", "C")``; cut off while thinking (``<think>`` without
    ``</think>``) → ``(rest, "")``; no leading ``<think>`` and not ``opened`` → ``(None, text)``, whatever
    follows. Callers with ``generation.thinking=disable`` use :func:`take_reasoning` (never split).
    """
    body = text.lstrip()
    if body.startswith("<think>"):
        body = body[len("<think>") :]
    elif not opened:
        return None, text
    head, sep, tail = body.partition("</think>")
    if not sep:
        return body.strip("\n"), ""
    return head.strip("\n"), tail.lstrip("\n")


def take_reasoning(
    text: str, thinking: str, *, field: str | None = None, opened: bool = False
) -> tuple[str | None, str]:
    """``(reasoning, content)`` of one generated answer, reasoning taken only where it is:

    * ``field``: the server's own reasoning field (vLLM ``message.reasoning``, SGLang and older vLLM
      ``reasoning_content``): used as it is, the content is never split;
    * ``thinking == "disable"``: never split. A non-empty think block at the very start is returned as
      reasoning only so :func:`check_thinking` rejects the row (the template ignored enable_thinking=false);
      otherwise the content is the text verbatim, ``</think>`` and all;
    * else :func:`split_reasoning` (a think block at the very start, or one the generation prompt opened).
    """
    if field is not None:
        return field, text
    if thinking == "disable":
        reasoning, content = split_reasoning(text)
        if reasoning is not None and reasoning.strip():
            return reasoning, content
        return None, text
    return split_reasoning(text, opened=opened)


#: Why a thinking=disable answer can still carry reasoning, by where the prompt was rendered.
DISABLE_HINT_SERVER = "the server's chat template ignores chat_template_kwargs (check the served template)"
DISABLE_HINT_LOCAL = (
    "the target thought although its template was rendered here with enable_thinking=false; "
    "use a template that honours it (target.chat_template) or generation.thinking=none"
)


def check_thinking(
    thinking: str, reasoning: str | None, *, require_reasoning: bool, disable_hint: str = DISABLE_HINT_SERVER
) -> str | None:
    """Normalize ``reasoning`` for a thinking mode (``disable_hint``: the cause named when a ``disable``
    answer carries reasoning).

    Raises:
        RowError: ``disable`` but the answer carries reasoning; ``save`` with ``require_reasoning`` but
            none came back (the message names the server flag to set).
    """
    if thinking == "disable":
        if reasoning is not None and reasoning.strip():
            raise RowError(
                f"answer carries reasoning although generation.thinking=disable sent enable_thinking=false; "
                f"{disable_hint}"
            )
        return None
    if thinking == "save" and require_reasoning and reasoning is None:
        raise RowError(
            "generation.thinking=save but the answer has no reasoning_content; start the server with a "
            "reasoning parser (SGLang/vLLM: --reasoning-parser qwen3, or the one for your model)"
        )
    return reasoning


def read_prompts(path: str | Path) -> list[dict]:
    """Read a prompt shard into ``[{prompt_id, dataset, messages}]`` in shard order.

    Raises:
        DataError: a record without a user turn, with a role other than system/user, or a duplicate
            ``prompt_id`` (names the file and prompt_id).
    """
    rows = shards.read_parquet(path).select(["prompt_id", "dataset", "messages"]).to_pylist()
    seen: set[str] = set()
    for r in rows:
        pid = r["prompt_id"]
        if pid in seen:
            raise DataError(f"{path}: prompt_id {pid} appears twice; rebuild the prompt shards (they dedup)")
        seen.add(pid)
        roles = [m["role"] for m in r["messages"]]
        bad = [x for x in roles if x not in PROMPT_ROLES]
        if bad or "user" not in roles:
            raise DataError(
                f"{path}: prompt {pid}: field `messages` must hold system/user turns with at least one user "
                f"turn (got roles {roles}); rebuild the prompt shards"
            )
    return rows


def redact_url(url: str) -> str:
    """``url`` without ``user:password@`` (safe to record and log): the project's one redaction,
    :func:`dflash_pipeline.core.errors.strip_url_credentials`."""
    return strip_url_credentials(url)


#: Loggers of the HTTP stack under the openai client; at INFO, httpx logs one line per request.
HTTP_LOGGERS = ("httpx", "httpx2", "httpcore", "httpcore2", "openai", "aiohttp")


def _raise_http_log_levels() -> dict[str, int]:
    """Set the :data:`HTTP_LOGGERS` to WARNING (``HTTP Request: POST ... "HTTP/1.1 200 OK"`` per request
    would flood the job log); a logger already stricter keeps its level, this module's own logger is
    untouched. Returns the levels changed (name: previous level)."""
    saved = {}
    for name in HTTP_LOGGERS:
        lg = logging.getLogger(name)
        if lg.getEffectiveLevel() < logging.WARNING:
            saved[name] = lg.level
            lg.setLevel(logging.WARNING)
    return saved


@contextlib.contextmanager
def _quiet_http_logs():
    """:func:`_raise_http_log_levels` for the duration of a ``with`` block (the levels restored on exit)."""
    saved = _raise_http_log_levels()
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def same_tool_calls(original, regenerated) -> bool:
    """Whether a regenerated assistant turn calls the same tools as the source's turn: same number of calls,
    in order the same function names and equal arguments compared as parsed JSON (whitespace, key order and
    call ids do not matter). Either side is a list of OpenAI calls or its JSON text (None: no calls). When
    this is False the conversation ends at that turn (docs/how-to/tool-calls.md): the source's tool result
    answers a call that was never made."""
    from dflash_pipeline.target.chat import tool_calls_of

    a = tool_calls_of({"tool_calls": original}) or []
    b = tool_calls_of({"tool_calls": regenerated}) or []
    return [(c["function"]["name"], c["function"]["arguments"]) for c in a] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in b
    ]
