"""Completions stage: regenerate every assistant turn of a prompt shard with the target.

One prompt shard (``contracts.PROMPT_SCHEMA``) becomes one completion shard
(``contracts.COMPLETION_SCHEMA``), via :func:`generate_shard`. Each user turn is answered against the
*regenerated* history, as a serving client would send it: ``system?, user1, assistant1, user2,
assistant2, ...`` where every assistant message (its ``content``, plus ``reasoning_content`` when there is
one, which Qwen3-style templates read) was produced by the target in this run.

Backends (``generation.backend``), behind one interface (:class:`Backend`):

* ``transformers`` (default): the target in-process; rendered with :func:`chat.render` (the same thinking
  mapping the tokens stage uses), left-padded batches sorted by prompt length, greedy when
  ``temperature == 0`` else sampled (seeded per batch).
* ``openai``: ``AsyncOpenAI`` clients against one or more OpenAI-compatible servers (SGLang, vLLM), with
  least-outstanding-requests balancing under a per-endpoint concurrency cap, retries with exponential
  backoff and jitter, endpoints taken out after repeated failures and re-probed (``GET /models``; a warning
  every 30 s while none is available), and a circuit breaker (see the ``generation.*`` keys in the config
  schema for every knob). The model sent is checked against each endpoint's ``GET /models`` at start and
  when a taken-out endpoint answers again: ``generation.model`` must be listed by every endpoint that lists
  models; unset, the endpoints must list the same models (the first is sent). A rejected key (401/403) or a
  ``/models`` that answers 404 (a base_url without ``/v1``) is a configuration error, not an outage. Error
  messages carry the cause chain (a refused connection reads ``Cannot connect to host``), and the HTTP
  client's per-request INFO lines are silenced while generating.
  ``generation.api: completions`` (default ``chat``) is the raw mode for servers without a chat endpoint:
  the same fleet, but each turn's history is rendered here with the target's own template
  (:func:`chat.render`, the thinking mapping above) and sent to ``POST /completions`` as **token ids**
  (the render tokenized with ``add_special_tokens=False``, exactly what the transformers backend and the
  tokens stage use). A string prompt would be tokenized by vLLM/SGLang with special tokens added, so
  templates that write their own BOS would get it twice. Reasoning is split from ``<think>…</think>`` in
  the returned text (a generation prompt that already opens ``<think>`` counts as its start).

**Record.** ``messages`` holds the system/user messages as given and each generated assistant message
with ``content`` (the answer; special tokens skipped, as servers decode) and ``reasoning_content`` (the
text between ``<think>`` and ``</think>`` when the target thought, else null). ``turns[i]`` describes
assistant turn ``i``: ``finish_reason`` (``stop|length``), ``prompt_tokens``/``completion_tokens``,
``prompt_token_ids``/``output_token_ids`` (transformers: always, ``output_token_ids`` including the
end-of-turn token when generated; openai: only when the server returns them, e.g. vLLM with
``extra_body: {return_token_ids: true}``), ``latency_s`` (seconds of the successful request; the whole
batch for transformers) and ``endpoint`` (base URL without credentials, or ``transformers``). ``status``
is ``truncated`` if any turn hit ``max_tokens`` (later user turns are still answered), ``error`` with
``error`` naming the turn and cause, else ``ok``.

**Thinking.** ``disable`` sends/renders ``enable_thinking=False`` and rejects (error row, not retried) an
answer that still carries reasoning; ``save`` sends ``enable_thinking=True`` and, on the openai backend,
requires ``reasoning_content`` (or ``reasoning``, newer vLLM; or a raw ``<think>…</think>`` in the content,
which is split locally) — a missing one means the server runs without a reasoning parser; ``none`` uses
the template's default and keeps whatever reasoning comes back.

**Resume.** Every finished conversation (ok or truncated) is appended as one JSON line, flushed, to the
progress file (default ``<out>.progress.jsonl``; its first line is a header with the generation settings,
and a file written under other settings is discarded; so are finished conversations of another model
than the one the endpoints serve now, with ``generation.model`` unset). A rerun sends only prompts not in
it, so a killed job re-sends at most its in-flight conversations (with ``client_processes > 1``, also those a client
process had finished but the parent had not yet written: at most one event-loop turn's worth each). The shard is written atomically in prompt-shard order
with each prompt exactly once, then the progress file is removed.

**Errors.** A conversation that fails after retries (other 4xx, retries exhausted, reasoning in disable
mode, ...) goes to the sidecar ``<out>.errors.jsonl`` (rewritten each run), never to the progress file, so
the next run retries it. If more than ``generation.max_error_fraction`` (default 0) of the shard failed,
:func:`generate_shard` raises :class:`GenerationError` without writing the shard (finished conversations
stay in the progress file); otherwise the failed conversations are written as ``status: error`` rows
with their message, and the sidecar stays next to the shard. Rows never vanish.

**Secrets.** The API key is read from the environment variable named by ``api_key_env`` and handed only
to the HTTP client; records, sidecars, stats and logs carry base URLs with any ``user:pass@`` removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence
from urllib.parse import urlsplit, urlunsplit

from . import shards
from .chat import load_tokenizer, render, template_kwargs
from .contracts import (
    COMPLETION_SCHEMA,
    COMPLETION_SCHEMA_VERSION,
    PROMPT_ROLES,
    canonical_json,
)
from .errors import ConfigError, DataError, GenerationError, strip_url_credentials

log = logging.getLogger(__name__)

PROGRESS_SUFFIX = ".progress.jsonl"
ERRORS_SUFFIX = ".errors.jsonl"
#: HTTP statuses that are retried (plus every 5xx); other 4xx make an error row at once.
RETRYABLE_STATUS = frozenset({408, 409, 425, 429})

OnDone = Callable[[dict], None]


# ------------------------------------------------------------------------------------------------
# records


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
        """The assistant message appended to the history for the next user turn."""
        msg = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
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
    out = {k: gen_cfg.get(k) for k in ("temperature", "top_p", "top_k", "max_tokens", "seed")}
    if gen_cfg.get("extra_body"):
        out["extra_body"] = gen_cfg["extra_body"]
    if gen_cfg.get("api", "chat") != "chat":  # only when set, so chat-mode records and resume files stay as they were
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


def cut_at_eos(new: list[int], eos_ids) -> tuple[list[int], bool]:
    """Generated token ids up to and including the first end-of-turn id (padding after it dropped).

    Returns ``(ids, stopped)``; ``stopped`` is False when no eos id was generated (a length cut).
    """
    for i, t in enumerate(new):
        if t in eos_ids:
            return new[: i + 1], True
    return new, False


def split_reasoning(text: str) -> tuple[str | None, str]:
    """Split generated text into ``(reasoning, content)`` at ``<think>``/``</think>``.

    ``"<think>\\nR\\n</think>\\n\\nC"`` → ``("R", "C")``; cut off while thinking (``<think>`` without
    ``</think>``) → ``(rest, "")``; no markers → ``(None, text)``.
    """
    if "</think>" in text:
        head, _, tail = text.partition("</think>")
        return head.split("<think>")[-1].strip("\n"), tail.lstrip("\n")
    stripped = text.lstrip("\n")
    if stripped.startswith("<think>"):
        return stripped[len("<think>"):].strip("\n"), ""
    return None, text


#: Why a thinking=disable answer can still carry reasoning, by where the prompt was rendered.
DISABLE_HINT_SERVER = "the server's chat template ignores chat_template_kwargs (check the served template)"
DISABLE_HINT_LOCAL = ("the target thought although its template was rendered here with enable_thinking=false; "
                      "use a template that honours it (target.chat_template) or generation.thinking=none")


def check_thinking(thinking: str, reasoning: str | None, *, require_reasoning: bool,
                   disable_hint: str = DISABLE_HINT_SERVER) -> str | None:
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


# ------------------------------------------------------------------------------------------------
# prompts, progress and error files


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
    """``url`` without ``user:password@`` (safe to record and log)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


class ProgressLog:
    """Append-only JSON-lines file of finished conversations, keyed by ``prompt_id``.

    Line 1 is ``{"header": {...}}`` with the run's fingerprint (generation settings and target identity).
    A file with another fingerprint is discarded on :meth:`open` (its conversations were generated
    under other settings); an unreadable line (the tail of a killed write) is skipped.
    """

    def __init__(self, path: str | Path, fingerprint: dict):
        self.path = Path(path)
        self.fingerprint = fingerprint
        self._fh = None

    def load(self) -> dict[str, dict]:
        """Records already finished under this fingerprint ({} if none)."""
        if not self.path.is_file():
            return {}
        done: dict[str, dict] = {}
        bad = 0
        with open(self.path, "r", encoding="utf-8") as fh:
            first = fh.readline()
            try:
                header = json.loads(first)["header"]
            except (ValueError, KeyError, TypeError):
                header = None
            if header != self.fingerprint:
                log.warning("%s: written under other generation settings; starting over", self.path)
                return {}
            for line in fh:
                try:
                    rec = json.loads(line)
                    done[rec["prompt_id"]] = rec
                except (ValueError, KeyError, TypeError):
                    bad += 1
        if bad:
            log.warning("%s: skipped %d unreadable line(s) (a killed write); those prompts are redone", self.path, bad)
        return done

    def open(self, keep: Iterable[dict]) -> None:
        """Rewrite the file atomically with the header and ``keep`` records, then open it for appending."""
        lines = [json.dumps({"header": self.fingerprint}, sort_keys=True)]
        lines += [json.dumps(r, ensure_ascii=False) for r in keep]
        shards.atomic_write_bytes(self.path, ("\n".join(lines) + "\n").encode("utf-8"), skip_if_identical=False)
        self._fh = open(self.path, "a", encoding="utf-8")

    def append(self, record: dict) -> None:
        """Append one finished conversation (one line, flushed to the OS before returning)."""
        self._fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _drop_other_model(done: dict[str, dict], model: str, progress_path: Path) -> bool:
    """Drop from ``done`` (records loaded from the progress file) those generated by another model than
    ``model``, the one this run sends (with ``generation.model`` unset it comes from the servers'
    ``GET /models``, which the progress header cannot hold: a fleet restarted with another model must not
    leave a shard of mixed models). Logs a warning; returns whether any was dropped."""
    other = Counter(r.get("model") for r in done.values() if r.get("model") != model)
    if not other:
        return False
    was = ", ".join(repr(m) for m in other)
    n = sum(other.values())
    if n == len(done):
        log.warning("%s: written under other generation settings (model %s; this run sends %r); starting over",
                    progress_path, was, model)
    else:
        log.warning("%s: %d of %d finished conversations were generated by model %s, not %r (the model this run "
                    "sends); those are redone", progress_path, n, len(done), was, model)
    for pid in [pid for pid, r in done.items() if r.get("model") != model]:
        del done[pid]
    return True


def _fingerprint(backend: str, gen_cfg: dict, target_dir: str | Path | None, chat_template) -> dict:
    fp: dict[str, Any] = {
        "schema_version": COMPLETION_SCHEMA_VERSION,
        "backend": backend,
        "thinking": gen_cfg["thinking"],
        "sampling": sampling_params(gen_cfg),
        "model": gen_cfg.get("model"),
    }
    if backend == "transformers":
        tdir = Path(target_dir).resolve()
        files = sorted(p for p in tdir.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".jinja", ".bin"))
        fp["target"] = [[p.name, p.stat().st_size, int(p.stat().st_mtime)] for p in files]
        fp["target_dir"] = str(tdir)
        if chat_template is not None:
            fp["chat_template"] = hashlib.sha256(Path(chat_template).read_bytes()).hexdigest()
    elif gen_cfg.get("api", "chat") == "completions" and target_dir is not None:  # prompts rendered here
        tdir = Path(target_dir).resolve()
        files = sorted(p for p in tdir.iterdir() if p.is_file() and p.suffix in (".json", ".jinja", ".model", ".txt", ".tiktoken"))
        fp["tokenizer"] = [[p.name, p.stat().st_size, int(p.stat().st_mtime)] for p in files]
        fp["target_dir"] = str(tdir)
        if chat_template is not None:
            fp["chat_template"] = hashlib.sha256(Path(chat_template).read_bytes()).hexdigest()
    return fp


# ------------------------------------------------------------------------------------------------
# progress display


class _Progress:
    """Live bar (stderr) with ok/truncated/error counts, requests/s and output tokens/s."""

    def __init__(self, total: int, initial: int, desc: str, resumed_records: Iterable[dict] = ()):
        """``initial`` conversations are already finished (``resumed_records``: their records, counted in
        ok/truncated; the rates count this run's only)."""
        from tqdm import tqdm

        tty = sys.stderr.isatty()
        self.bar = tqdm(
            total=total, initial=initial, desc=desc, file=sys.stderr, mininterval=0.5 if tty else 30.0,
            dynamic_ncols=True, unit="conv", leave=True,
        )
        self.counts: Counter = Counter(r["status"] for r in resumed_records)
        self.t0 = time.monotonic()
        self.turns = 0
        self.out_tokens = 0
        if self.counts:
            self._postfix()

    def _postfix(self) -> None:
        dt = max(time.monotonic() - self.t0, 1e-9)
        c = self.counts
        self.bar.set_postfix_str(
            f"ok={c['ok']} trunc={c['truncated']} err={c['error']} "
            f"{self.turns / dt:.1f} req/s {self.out_tokens / dt:.0f} tok/s",
            refresh=False,
        )

    def update(self, record: dict) -> None:
        self.counts[record["status"]] += 1
        self.turns += len(record["turns"])
        self.out_tokens += sum(t.get("completion_tokens") or 0 for t in record["turns"])
        self._postfix()
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


# ------------------------------------------------------------------------------------------------
# backends


class Backend(Protocol):
    """A generation backend: answers every user turn of each prompt and reports each conversation."""

    #: model name recorded in every record
    model: str

    def resolve_model(self) -> str:
        """The model name this backend sends and records (may ask the servers). Optional: without it
        :func:`generate_shard` uses ``model``."""
        ...

    def run(self, prompts: Sequence[dict], on_done: OnDone, info: RunInfo) -> dict:
        """Generate all ``prompts``; call ``on_done(record)`` once per conversation as it finishes
        (status ok/truncated/error). Returns backend stats (JSON-able). Raises GenerationError to stop."""
        ...


class TransformersBackend:
    """In-process batched generation with the target (``generation.backend: transformers``).

    Args:
        target_dir: target directory (config, weights, tokenizer).
        gen_cfg: validated ``config["generation"]``.
        chat_template: optional .jinja overriding the tokenizer's template.
        trust_remote_code: allow the target's own code.
        dtype: ``auto`` (float32 on CPU, bfloat16 on CUDA), ``float32``, ``bfloat16`` or ``float16``.
    """

    def __init__(self, target_dir, gen_cfg: dict, *, chat_template=None, trust_remote_code=False, dtype="auto"):
        import torch

        from .target import load_target

        self.torch = torch
        self.cfg = gen_cfg
        self.tok = load_tokenizer(target_dir, chat_template=chat_template, trust_remote_code=trust_remote_code)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device
        self.lm = load_target(target_dir, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        eos = self.lm.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tok.eos_token_id is not None and self.tok.eos_token_id not in eos:
            eos.append(self.tok.eos_token_id)
        if not eos:
            raise ConfigError(f"{target_dir}: no eos token in generation_config.json or the tokenizer; set one")
        self.eos_ids = eos
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else eos[0]
        self.model = Path(target_dir).resolve().name
        self._batches = 0

    def _generate(self, prompts_ids: list[list[int]]) -> tuple[list[list[int]], float]:
        torch, cfg = self.torch, self.cfg
        width = max(len(p) for p in prompts_ids)
        ids = torch.full((len(prompts_ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts_ids):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        kw: dict[str, Any] = dict(
            max_new_tokens=cfg["max_tokens"], eos_token_id=self.eos_ids, pad_token_id=self.pad_id
        )
        if cfg["temperature"] > 0:
            kw.update(do_sample=True, temperature=cfg["temperature"], top_p=cfg["top_p"], top_k=cfg["top_k"] or 0)
            if cfg["seed"] is not None:
                torch.manual_seed(cfg["seed"] + self._batches)
        else:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        self._batches += 1
        t0 = time.monotonic()
        with torch.inference_mode():
            out = self.lm.generate(ids.to(self.device), attention_mask=mask.to(self.device), **kw)
        new = out[:, width:].tolist()
        return new, time.monotonic() - t0

    def _turn(self, prompt_ids: list[int], new: list[int], latency: float) -> Turn:
        new, stop = cut_at_eos(new, self.eos_ids)
        body = new[:-1] if stop else new
        reasoning, content = split_reasoning(self.tok.decode(body, skip_special_tokens=True))
        reasoning = check_thinking(self.cfg["thinking"], reasoning, require_reasoning=False,
                                   disable_hint=DISABLE_HINT_LOCAL)
        return Turn(
            content=content, reasoning_content=reasoning, finish_reason="stop" if stop else "length",
            prompt_tokens=len(prompt_ids), completion_tokens=len(new), prompt_token_ids=list(prompt_ids),
            output_token_ids=list(new), latency_s=round(latency, 6), endpoint="transformers",
        )

    def resolve_model(self) -> str:
        """The target directory's name (recorded as ``model``)."""
        return self.model

    def run(self, prompts: Sequence[dict], on_done: OnDone, info: RunInfo) -> dict:
        thinking, bs = self.cfg["thinking"], self.cfg["batch_size"]

        @dataclass
        class Conv:
            prompt: dict
            pos: int = 0  # next message of prompt["messages"] to add
            history: list = field(default_factory=list)
            turns: list = field(default_factory=list)
            ids: list = field(default_factory=list)

            def advance(self) -> bool:
                """Add messages up to the next user turn; False when no user turn is left."""
                msgs = self.prompt["messages"]
                while self.pos < len(msgs):
                    m = msgs[self.pos]
                    self.pos += 1
                    self.history.append({"role": m["role"], "content": m["content"]})
                    if m["role"] == "user":
                        return True
                return False

        def prepare(c: Conv) -> None:
            c.ids = render(self.tok, c.history, thinking=thinking, add_generation_prompt=True, tokenize=True)

        convs = [Conv(p) for p in prompts]
        for c in convs:
            c.advance()
            prepare(c)
        # Longest first: similar lengths share a batch, and an out-of-memory shows up in the first batch.
        convs.sort(key=lambda c: -len(c.ids))
        chunk = bs * 4
        requests = 0
        for start in range(0, len(convs), chunk):
            active = convs[start:start + chunk]
            while active:
                active.sort(key=lambda c: -len(c.ids))
                still: list[Conv] = []
                for b in range(0, len(active), bs):
                    batch = active[b:b + bs]
                    outs, dt = self._generate([c.ids for c in batch])
                    requests += len(batch)
                    for c, new in zip(batch, outs):
                        try:
                            turn = self._turn(c.ids, new, dt)
                        except RowError as exc:
                            on_done(build_record(c.prompt, c.turns, info, error=f"turn {len(c.turns) + 1}: {exc}"))
                            continue
                        c.turns.append(turn)
                        c.history.append(turn.history_message())
                        if c.advance():
                            prepare(c)
                            still.append(c)
                        else:
                            on_done(build_record(c.prompt, c.turns, info))
                active = still
        return {"requests": requests, "attempts": requests, "retries": 0}


@dataclass
class _Endpoint:
    url: str  # redacted
    client: Any
    max_concurrency: int
    outstanding: int = 0
    up: bool = True
    consecutive_failures: int = 0
    last_error: str = ""
    attempts: int = 0
    failures: int = 0
    taken_out: int = 0
    reprobe_task: Any = None
    key_env: str | None = None  # name of the API-key variable (for error messages; never the key)
    served: list[str] | None = None  # model ids its last answered GET /models listed; None: never answered
    next_probe_at: float | None = None  # time.monotonic() of its next re-probe while taken out


#: HTTP statuses that mean the API key is wrong or lacks access: no retry can fix them, the job stops.
AUTH_STATUS = (401, 403)
#: Seconds between the warnings logged while every endpoint is taken out (until the breaker opens).
OUTAGE_LOG_S = 30.0


def _auth_error(ep: _Endpoint, exc: BaseException) -> ConfigError:
    """The error for an endpoint that rejected the API key (names the variable, never the key)."""
    where = (f"the key in ${ep.key_env} (its api_key_env)" if ep.key_env
             else "no API key (set api_key_env on this endpoint)")
    return ConfigError(f"endpoint {ep.url} rejected {where}: {_describe(exc)}; fix the key or the endpoint's "
                       f"api_key_env in generation.endpoints - retrying cannot help")


def _not_found_error(ep: _Endpoint, exc: BaseException) -> ConfigError:
    """The error for an endpoint whose ``GET /models`` answers 404: its base_url is not an API root."""
    return ConfigError(
        f"endpoint {ep.url}: GET {ep.url.rstrip('/')}/models answered {_describe(exc)}; base_url usually ends "
        f"with /v1 (e.g. http://host:30000/v1); fix its base_url in generation.endpoints - retrying cannot help"
    )


def _model_list(ids: Sequence[str], limit: int = 8) -> str:
    """``'a', 'b'`` (the first ``limit`` ids, then how many more)."""
    shown = ", ".join(repr(i) for i in ids[:limit])
    return shown + (f" and {len(ids) - limit} more" if len(ids) > limit else "")


def _settle_model(model: str | None, served: Sequence[tuple[str, list[str]]], *, configured: bool) -> str | None:
    """The model to send, checked against what the endpoints list.

    Args:
        model: ``generation.model``, or the model settled earlier in this job; None = pick one.
        served: ``(url, ids)`` of every endpoint whose ``GET /models`` answered, in config order (urls
            redacted). An endpoint listing no model is not judged (some servers list nothing).
        configured: ``model`` comes from ``generation.model`` (else from an earlier ``/models``), for the
            message.

    Returns:
        ``model`` when given; else the first id of the first endpoint listing one; None when no endpoint
        lists a model.

    Raises:
        ConfigError: ``model`` is not among the ids an endpoint lists (names each such endpoint, what it
            lists, and ``generation.model``), or no model is given and the endpoints list different ones
            (names each endpoint and what it serves).
    """
    listing = [(url, list(ids)) for url, ids in served if ids]
    if model:
        bad = [(url, ids) for url, ids in listing if model not in ids]
        if not bad:
            return model
        where = "; ".join(f"endpoint {url} lists {_model_list(ids)}" for url, ids in bad)
        if configured:
            raise ConfigError(
                f"{where} - not generation.model={model!r}; set generation.model to the model these servers "
                f"serve, or list only endpoints that serve {model!r}"
            )
        raise ConfigError(
            f"{where} - not {model!r}, which the other endpoints served when this job started (generation.model "
            f"is not set); the servers now serve different models: set generation.model and list only "
            f"endpoints that serve it"
        )
    if not listing:
        return None
    if len({frozenset(ids) for _, ids in listing}) > 1:
        what = "; ".join(f"{url} serves {_model_list(ids)}" for url, ids in listing)
        raise ConfigError(
            f"the endpoints serve different models ({what}) and generation.model is not set; set "
            f"generation.model to the model to generate with, and list only endpoints that serve it"
        )
    return listing[0][1][0]


class _Fleet:
    """Endpoints with least-outstanding-requests selection, take-out/re-probe and a circuit breaker.

    ``model`` is the model id sent (``generation.model``, one settled earlier in the job, or None until
    :meth:`start` settles it from ``GET /models``). Single event loop, no locks: state changes happen
    between awaits.
    """

    def __init__(self, endpoints: list[_Endpoint], gen_cfg: dict, model: str | None = None):
        self.eps = endpoints
        self.cfg = gen_cfg
        self.configured = bool(gen_cfg.get("model"))
        self.model = gen_cfg.get("model") or model or None
        self.tripped: GenerationError | ConfigError | None = None
        self._waiters: list[asyncio.Future] = []
        self._outage_task: asyncio.Task | None = None
        self._outage_since: float | None = None  # time.monotonic() since when every endpoint is out

    def _wake(self, n: int | None = None) -> None:
        while self._waiters and (n is None or n > 0):
            fut = self._waiters.pop(0)
            if not fut.done():
                fut.set_result(None)
                if n is not None:
                    n -= 1

    def _raise_if_tripped(self) -> None:
        if self.tripped is not None:
            raise self.tripped

    def _trip(self, exc: GenerationError | ConfigError) -> None:
        """Stop the job with ``exc`` (every waiter wakes and raises it)."""
        if self.tripped is None:
            self.tripped = exc
        self._wake()

    async def acquire(self) -> _Endpoint:
        """An up endpoint with a free slot and the fewest outstanding requests (relative to its cap);
        waits while none has one. Raises GenerationError once the breaker is open."""
        while True:
            self._raise_if_tripped()
            best = None
            for ep in self.eps:
                if ep.up and ep.outstanding < ep.max_concurrency:
                    if best is None or ep.outstanding * best.max_concurrency < best.outstanding * ep.max_concurrency:
                        best = ep
            if best is not None:
                best.outstanding += 1
                best.attempts += 1
                return best
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)

    def release(self, ep: _Endpoint) -> None:
        ep.outstanding -= 1
        self._wake(1)

    def success(self, ep: _Endpoint) -> None:
        ep.consecutive_failures = 0

    def failure(self, ep: _Endpoint, err: str) -> None:
        """A failed request on ``ep``: counted while ``ep`` is in (failures of requests already in flight
        when it was taken out are the same outage); takes it out at ``endpoint_max_failures``."""
        ep.failures += 1
        ep.last_error = err
        if not ep.up:
            return
        ep.consecutive_failures += 1
        if ep.consecutive_failures >= self.cfg["endpoint_max_failures"]:
            self._take_out(ep)
            log.warning("endpoint %s taken out after %d consecutive failures (last: %s)", ep.url, ep.consecutive_failures, err)
        self._check_breaker()
        self._watch_outage()

    def _take_out(self, ep: _Endpoint) -> None:
        ep.up = False
        ep.taken_out += 1
        ep.next_probe_at = time.monotonic() + float(self.cfg["endpoint_reprobe_s"])
        ep.reprobe_task = asyncio.get_running_loop().create_task(self._reprobe(ep))

    def _check_breaker(self) -> None:
        n = self.cfg["circuit_breaker_failures"]
        if self.tripped is None and all(e.consecutive_failures >= n for e in self.eps):
            detail = "; ".join(f"{e.url}: {e.last_error}" for e in self.eps).rstrip(".")
            self._trip(GenerationError(
                f"circuit breaker open: every endpoint failed {n}+ consecutive times "
                f"(generation.circuit_breaker_failures) — {detail}. Check that the servers are up and "
                f"reachable from this host"
            ))

    def _watch_outage(self) -> None:
        """While every endpoint is taken out, warn every :data:`OUTAGE_LOG_S` seconds (the wait for the
        breaker is otherwise silent between re-probes)."""
        if self.tripped is None and not any(ep.up for ep in self.eps):
            if self._outage_since is None:
                self._outage_since = time.monotonic()
            if self._outage_task is None:
                self._outage_task = asyncio.get_running_loop().create_task(self._outage_log())

    async def _outage_log(self) -> None:
        try:
            while True:
                await asyncio.sleep(OUTAGE_LOG_S)
                if self.tripped is not None or self._outage_since is None or any(ep.up for ep in self.eps):
                    self._outage_since = None
                    return
                now = time.monotonic()
                fewest = min(self.eps, key=lambda e: e.consecutive_failures)
                nxt = [e.next_probe_at - now for e in self.eps if e.next_probe_at is not None]
                log.warning(
                    "no endpoint available for %.0f s: %d consecutive failures of circuit_breaker_failures=%d "
                    "(the job stops once every endpoint reaches it); re-probing %d endpoint(s), next in %.0f s "
                    "(last: %s: %s)",
                    now - self._outage_since, fewest.consecutive_failures, self.cfg["circuit_breaker_failures"],
                    len(self.eps), max(0.0, min(nxt)) if nxt else 0.0, fewest.url, fewest.last_error,
                )
        finally:
            self._outage_task = None

    async def probe(self, ep: _Endpoint) -> list[str]:
        """``GET /models`` on ``ep``; records and returns the model ids. Raises what the client raises."""
        timeout = min(float(self.cfg["request_timeout_s"]), 30.0)
        page = await asyncio.wait_for(ep.client.with_options(timeout=timeout).models.list(), timeout)
        ep.served = [m.id for m in page.data]
        return ep.served

    def _config_error(self, ep: _Endpoint, exc: BaseException) -> ConfigError | None:
        """The error when ``exc`` from a probe of ``ep`` is a configuration fault retrying cannot fix: the
        key rejected (401/403), or 404 from an endpoint that never answered ``/models`` (a base_url
        without ``/v1``); None for an outage."""
        status = getattr(exc, "status_code", None)
        if status in AUTH_STATUS:
            return _auth_error(ep, exc)
        if status == 404 and ep.served is None:
            return _not_found_error(ep, exc)
        return None

    async def _reprobe(self, ep: _Endpoint) -> None:
        delay = float(self.cfg["endpoint_reprobe_s"])
        while self.tripped is None:
            ep.next_probe_at = time.monotonic() + delay
            await asyncio.sleep(delay)
            try:
                ids = await self.probe(ep)
            except Exception as exc:  # any failure keeps it out
                err = self._config_error(ep, exc)
                if err is not None:
                    self._trip(err)  # stops the job like the breaker
                    return
                ep.consecutive_failures += 1
                ep.last_error = f"re-probe: {_describe(exc)}"
                self._check_breaker()
                delay = min(delay * 2, float(self.cfg["retry_backoff_max_s"]))
                continue
            if self.model is not None:  # an endpoint back with another model must not join silently
                try:
                    _settle_model(self.model, [(ep.url, ids)], configured=self.configured)
                except ConfigError as exc:
                    self._trip(exc)
                    return
            log.warning("endpoint %s is back", ep.url)
            ep.up = True
            ep.consecutive_failures = 0
            ep.next_probe_at = None
            self._outage_since = None
            self._wake()
            return

    async def start(self) -> str:
        """Probe every endpoint (``GET /models``) and settle the model to send (see :func:`_settle_model`).
        Endpoints that do not answer start taken out (re-probed, and judged once they answer); waits for
        one to answer or the breaker.

        Returns:
            The model id.

        Raises:
            ConfigError: an endpoint rejects the API key, answers 404 (base_url without ``/v1``), or lists
                other models than the one to send, or the endpoints list different models and
                ``generation.model`` is not set.
            GenerationError: the breaker opened, or no answering endpoint lists a model and
                ``generation.model`` is not set.
        """
        results = await asyncio.gather(*(self.probe(ep) for ep in self.eps), return_exceptions=True)
        for ep, res in zip(self.eps, results):
            if isinstance(res, Exception) and (err := self._config_error(ep, res)) is not None:
                raise err
        self.model = _settle_model(self.model, [(ep.url, ep.served) for ep in self.eps if ep.served is not None],
                                   configured=self.configured)
        for ep, res in zip(self.eps, results):
            if isinstance(res, BaseException):
                self._take_out(ep)
                ep.consecutive_failures = 1
                ep.last_error = f"probe: {_describe(res)}"
                log.warning("endpoint %s does not answer (%s); re-probing later", ep.url, ep.last_error)
        self._check_breaker()
        self._watch_outage()
        while not any(ep.served is not None for ep in self.eps):  # a re-probe records what it lists
            self._raise_if_tripped()
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut
        self._raise_if_tripped()
        self.model = _settle_model(self.model, [(ep.url, ep.served) for ep in self.eps if ep.served is not None],
                                   configured=self.configured)
        if self.model is None:
            urls = ", ".join(f"{ep.url}/models" for ep in self.eps if ep.served is not None)
            raise GenerationError(f"{urls} lists no model; set generation.model")
        return self.model

    async def close(self) -> None:
        if self._outage_task is not None:
            self._outage_task.cancel()
        for ep in self.eps:
            if ep.reprobe_task is not None:
                ep.reprobe_task.cancel()
        for ep in self.eps:
            try:
                await ep.client.close()
            except Exception:  # closing a broken connection is not worth failing the run
                pass


def _first_line(exc: BaseException | str) -> str:
    """The first line of ``exc``'s message (or of a server's message string; 300 characters at most,
    ``user:pass@`` removed from any URL in it), or its type name when it has none."""
    text = str(exc)
    if text.strip():
        msg = next(line for line in text.splitlines() if line.strip())[:300]
    else:
        msg = type(exc).__name__ if isinstance(exc, BaseException) else "(empty message)"
    return strip_url_credentials(msg)


def _root_cause(exc: BaseException) -> BaseException | None:
    """The first exception in ``exc``'s cause chain (``__cause__``, else an unsuppressed ``__context__``)
    whose message differs from ``exc``'s: the deepest of those sharing that message (the most specific
    type). None when the chain adds nothing."""
    top = _first_line(exc)
    found = None
    seen = {id(exc)}
    cur = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        msg = _first_line(cur)
        if found is None:
            if msg != top:
                found = cur
        elif msg == _first_line(found):
            found = cur  # a deeper exception with the same message names the more specific type
        else:
            break
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return found


def _describe(exc: BaseException) -> str:
    """One line for logs, take-out lines, error rows and the breaker message: ``HTTP <status>: <message>``
    or ``<Type>: <message>``, plus ``(cause: <Type>: <message>)`` from the exception's cause chain. The
    cause matters: openai's aiohttp transport reports a refused connection as ``APITimeoutError: Request
    timed out.``, whose cause says ``Cannot connect to host ...``. Credentials in URLs are removed."""
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout"
    status = getattr(exc, "status_code", None)
    msg = _first_line(exc)
    if status is not None:  # openai's text is "Error code: 400 - {body}": say the server's message once
        body = getattr(exc, "body", None)
        server_msg = body.get("message") if isinstance(body, dict) else None
        msg = _first_line(server_msg) if isinstance(server_msg, str) and server_msg.strip() else re.sub(
            r"^Error code: \d+ - ", "", msg)
    out = f"HTTP {status}: {msg}" if status is not None else f"{type(exc).__name__}: {msg}"
    cause = _root_cause(exc)
    if cause is not None:
        out += f" (cause: {type(cause).__name__}: {_first_line(cause)})"
    return out


def _first_choice(data: Any) -> dict:
    """``choices[0]`` of a response's JSON. Raises ValueError (malformed: retried) when there is none."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError("response has no choices")
    return choices[0]


def _response_facts(data: dict, choice: dict) -> dict:
    """``prompt_tokens``, ``completion_tokens`` (``usage``) and ``prompt_token_ids``, ``output_token_ids``
    (as vLLM returns them with ``return_token_ids``: top level or choice, choice; None when absent) of a
    response's JSON, as :class:`Turn` keywords."""
    usage = data.get("usage") or {}
    prompt_ids = data.get("prompt_token_ids") or choice.get("prompt_token_ids")
    out_ids = choice.get("token_ids") or choice.get("output_token_ids")
    return {
        "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
        "prompt_token_ids": list(prompt_ids) if prompt_ids is not None else None,
        "output_token_ids": list(out_ids) if out_ids is not None else None,
    }


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
    """Generation against OpenAI-compatible servers (``generation.backend: openai``).

    With ``generation.api: completions`` the target's tokenizer (``target_dir``, ``chat_template``,
    ``trust_remote_code`` as ``target.*``) is loaded once here and renders every request.

    ``resolved_model``: the model a parent process settled from ``GET /models`` (``generation.model``
    unset), so that its client processes send and check that one.

    Raises:
        ConfigError: no endpoints, ``api_key_env`` names an unset variable, or completions mode without
            ``target_dir`` or with ``extra_body.chat_template_kwargs``.
    """

    def __init__(self, gen_cfg: dict, *, target_dir=None, chat_template=None, trust_remote_code=False,
                 resolved_model: str | None = None):
        if not gen_cfg.get("endpoints"):
            raise ConfigError("generation.endpoints is empty; list at least one {base_url: http://host:port/v1}")
        self.cfg = gen_cfg
        self.api = gen_cfg.get("api", "chat")
        self.tok = None
        self._opens_think = False
        if self.api == "completions":
            if target_dir is None:
                raise ConfigError(
                    "generation.api=completions renders prompts locally and needs the target's tokenizer "
                    "and chat template (target.path)"
                )
            if "chat_template_kwargs" in (gen_cfg.get("extra_body") or {}):
                raise ConfigError(
                    "generation.extra_body.chat_template_kwargs is not applied with generation.api=completions "
                    "(the prompt is rendered locally; generation.thinking sets the template kwargs)"
                )
            self.tok = load_tokenizer(target_dir, chat_template=chat_template, trust_remote_code=trust_remote_code)
            # Templates that open <think> in the generation prompt (DeepSeek-R1, Qwen3 thinking-2507) make
            # the completion start inside the reasoning; known once per template and mode.
            probe = render(self.tok, [{"role": "user", "content": "x"}], thinking=gen_cfg["thinking"], add_generation_prompt=True)
            self._opens_think = probe.rstrip().endswith("<think>")
        self.model = gen_cfg.get("model") or resolved_model or ""
        self._probed = False  # whether resolve_model/_discover checked the fleet's /models in this process
        # what a client process needs to build its own copy (keys come from its inherited environment)
        self._init_kw = {"target_dir": target_dir, "chat_template": chat_template, "trust_remote_code": trust_remote_code}
        self._keys = []
        for i, ep in enumerate(gen_cfg["endpoints"]):
            env = ep.get("api_key_env")
            if env:
                if env not in os.environ:
                    raise ConfigError(
                        f"generation.endpoints[{i}].api_key_env names ${env}, which is not set; export it "
                        f"(the key itself never goes into the config)"
                    )
                self._keys.append(os.environ[env])
            else:
                self._keys.append("EMPTY")
        self.stats: Counter = Counter()

    def _make_fleet(self) -> _Fleet:
        import openai

        eps = []
        for ep_cfg, key in zip(self.cfg["endpoints"], self._keys):
            cap = int(ep_cfg.get("max_concurrency", 64))
            http_client = _aiohttp_client(cap, float(self.cfg["request_timeout_s"]))
            client = openai.AsyncOpenAI(
                base_url=ep_cfg["base_url"], api_key=key, max_retries=0,
                timeout=float(self.cfg["request_timeout_s"]), http_client=http_client,
            )
            eps.append(_Endpoint(url=redact_url(ep_cfg["base_url"]), client=client, max_concurrency=cap,
                                 key_env=ep_cfg.get("api_key_env")))
        return _Fleet(eps, self.cfg, model=self.model or None)

    def _request_kwargs(self, history: list[dict]) -> dict:
        cfg = self.cfg
        kw: dict[str, Any] = {
            "model": self.model, "messages": history, "max_tokens": cfg["max_tokens"],
            "temperature": cfg["temperature"], "top_p": cfg["top_p"],
        }
        if self.api == "completions":  # token ids of the local render (no second BOS; see the module doc)
            del kw["messages"]
            kw["prompt"] = render(self.tok, history, thinking=cfg["thinking"], add_generation_prompt=True, tokenize=True)
        if cfg.get("seed") is not None:
            kw["seed"] = cfg["seed"]
        extra = dict(cfg.get("extra_body") or {})
        if cfg.get("top_k") is not None:
            extra.setdefault("top_k", cfg["top_k"])
        tk = template_kwargs(cfg["thinking"]) if self.api == "chat" else {}
        if tk:
            extra["chat_template_kwargs"] = {**(extra.get("chat_template_kwargs") or {}), **tk}
        if extra:
            kw["extra_body"] = extra
        return kw

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        cap = float(self.cfg["retry_backoff_max_s"])
        d = min(cap, float(self.cfg["retry_backoff_s"]) * 2 ** (attempt - 1))
        d = d * (0.5 + 0.5 * random.random())
        if retry_after is not None:
            d = max(d, min(retry_after, cap))
        return d

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
        if reasoning is None and "</think>" in content:
            reasoning, content = split_reasoning(content)
        reasoning = check_thinking(self.cfg["thinking"], reasoning, require_reasoning=True)
        return Turn(
            content=content, reasoning_content=reasoning, finish_reason=choice.get("finish_reason") or "stop",
            latency_s=round(latency, 6), endpoint=ep.url, **_response_facts(resp, choice),
        )

    def _parse_text(self, resp, latency: float, ep: _Endpoint) -> Turn:
        """Turn from a ``/completions`` response (``generation.api: completions``): the reasoning is split
        here from ``<think>…</think>`` in ``choices[0].text``. Raises RowError (wrong thinking) or
        ValueError (malformed: retried)."""
        choice = _first_choice(resp)
        text = choice.get("text")
        if not isinstance(text, str):
            raise ValueError("completion choice has no text")
        if self._opens_think and not text.lstrip().startswith("<think>"):
            text = "<think>\n" + text  # the generation prompt opened the reasoning
        reasoning, content = split_reasoning(text)
        if self.cfg["thinking"] == "save" and reasoning is None:
            raise RowError(
                "generation.thinking=save but the completion has no <think>…</think> reasoning (with "
                "generation.api=completions it is split from the text); the target did not think under its "
                "template with enable_thinking=true"
            )
        reasoning = check_thinking(self.cfg["thinking"], reasoning, require_reasoning=False,
                                   disable_hint=DISABLE_HINT_LOCAL)
        return Turn(
            content=content, reasoning_content=reasoning, finish_reason=choice.get("finish_reason") or "stop",
            latency_s=round(latency, 6), endpoint=ep.url, **_response_facts(resp, choice),
        )

    async def _complete(self, fleet: _Fleet, history: list[dict]) -> Turn:
        import openai

        kw = self._request_kwargs(history)
        # Sent with the client's generic post (its documented way to call any endpoint: same auth, headers,
        # transport and APIStatusError/APIConnectionError mapping) and the JSON parsed here: the typed
        # ``create`` spends about half of a request's client CPU transforming the parameters and building
        # pydantic models of the answer (bench/bench_completions.py), which caps the requests/s on few cores.
        body = {k: v for k, v in kw.items() if k != "extra_body"}
        body.update(kw.get("extra_body") or {})  # merged over the body, as the SDK does with extra_body
        path = "/completions" if self.api == "completions" else "/chat/completions"
        timeout = float(self.cfg["request_timeout_s"])
        attempt = 0
        while True:
            ep = await fleet.acquire()
            self.stats["attempts"] += 1
            t0 = time.monotonic()
            retry_after = None
            try:
                resp = json.loads(await asyncio.wait_for(ep.client.post(path, cast_to=bytes, body=body), timeout))
            except openai.APIStatusError as exc:
                fleet.release(ep)
                status = exc.status_code
                err = _describe(exc)
                if status in AUTH_STATUS:
                    raise _auth_error(ep, exc) from None
                if status not in RETRYABLE_STATUS and status < 500:
                    fleet.success(ep)  # the server is alive and answered; the request is at fault
                    raise RowError(f"{err} (not retried: client error) from {ep.url}") from None
                if status == 429:
                    ra = exc.response.headers.get("retry-after") if exc.response is not None else None
                    try:
                        retry_after = float(ra) if ra is not None else None
                    except ValueError:
                        retry_after = None
                    self.stats["rate_limited"] += 1  # backpressure: the endpoint stays in
                else:
                    fleet.failure(ep, err)
            except (openai.APIConnectionError, asyncio.TimeoutError) as exc:
                fleet.release(ep)
                err = _describe(exc)
                fleet.failure(ep, err)
            except (ValueError, openai.APIResponseValidationError) as exc:  # unparseable body
                fleet.release(ep)
                err = f"malformed response: {_describe(exc)}"
                fleet.failure(ep, err)
            else:
                fleet.release(ep)
                try:
                    parse = self._parse_text if self.api == "completions" else self._parse
                    turn = parse(resp, time.monotonic() - t0, ep)
                except (ValueError, AttributeError, TypeError, LookupError) as exc:
                    err = f"malformed response: {exc}"
                    fleet.failure(ep, err)
                else:
                    fleet.success(ep)
                    return turn
            attempt += 1
            if attempt > self.cfg["max_retries"]:
                raise RowError(f"gave up after {attempt} attempts; last: {err} from {ep.url}")
            self.stats["retries"] += 1
            await asyncio.sleep(self._backoff(attempt, retry_after))

    async def _conversation(self, fleet: _Fleet, prompt: dict, info: RunInfo) -> dict:
        history: list[dict] = []
        turns: list[Turn] = []
        for m in prompt["messages"]:
            history.append({"role": m["role"], "content": m["content"]})
            if m["role"] != "user":
                continue
            try:
                turn = await self._complete(fleet, list(history))
            except RowError as exc:
                return build_record(prompt, turns, info, error=f"turn {len(turns) + 1}: {exc}")
            turns.append(turn)
            history.append(turn.history_message())
        return build_record(prompt, turns, info)

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
        return {
            "requests": self.stats["attempts"] - self.stats["retries"],
            "attempts": self.stats["attempts"],
            "retries": self.stats["retries"],
            "rate_limited": self.stats["rate_limited"],
            "endpoints": {
                ep.url: {"attempts": ep.attempts, "failures": ep.failures, "taken_out": ep.taken_out} for ep in fleet.eps
            },
        }

    def resolve_model(self) -> str:
        """The model id sent and recorded: ``generation.model``, else settled from the endpoints'
        ``GET /models`` (one probe round, waiting for an endpoint like :meth:`run` does). Raises what
        :meth:`_Fleet.start` raises."""
        if not self.model:
            asyncio.run(self._discover())
        return self.model

    def run(self, prompts: Sequence[dict], on_done: OnDone, info: RunInfo) -> dict:
        if not prompts:
            return {"requests": 0, "attempts": 0, "retries": 0}
        procs = self._client_processes(len(prompts))
        if procs > 1:
            return _run_client_processes(self, prompts, on_done, info, procs)
        return asyncio.run(self._run(prompts, on_done, info))

    # -- several client processes (generation.client_processes > 1) --------------------------------

    def _client_processes(self, n_prompts: int) -> int:
        """Client processes for ``n_prompts``: ``generation.client_processes``, at most one per prompt and
        at most the smallest per-endpoint cap (every process keeps a slot on every endpoint, so each one's
        fleet, take-out and breaker see the whole fleet)."""
        want = int(self.cfg.get("client_processes", 1) or 1)
        if want <= 1:
            return 1
        cap = min(int(ep.get("max_concurrency", 64)) for ep in self.cfg["endpoints"])
        n = min(want, n_prompts, cap)
        if n < want:
            log.info("generation.client_processes=%d: using %d (prompts left: %d, smallest endpoint max_concurrency: %d)",
                     want, n, n_prompts, cap)
        return n

    async def _discover(self) -> None:
        """Probe the fleet once and set ``self.model`` to the model it settles (as :meth:`_run`; raises what
        :meth:`_Fleet.start` raises)."""
        fleet = self._make_fleet()
        try:
            self.model = await fleet.start()
        finally:
            await fleet.close()
        self._probed = True

    async def _serve(self, tasks, emit: OnDone, info: RunInfo, stop) -> dict | None:
        """One client process's loop: conversations from the shared ``tasks`` queue (batches of prompts,
        ``None`` = no more) through this process's fleet, each finished record to ``emit``. Returns the
        fleet's stats, or None when the parent's ``stop`` event ended it early."""
        import threading

        loop = asyncio.get_running_loop()
        main = asyncio.current_task()
        fleet = self._make_fleet()
        n = sum(ep.max_concurrency for ep in fleet.eps)
        local: asyncio.Queue = asyncio.Queue()  # prompts taken from ``tasks``, not yet started
        want = threading.Event()  # set by the loop: fetch the next batch
        state = {"fetching": True, "low": 0}

        def fetcher() -> None:  # blocking gets off the event loop; a daemon, so a stop never waits on it
            while True:
                want.wait()
                want.clear()
                batch = tasks.get()
                loop.call_soon_threadsafe(deliver, batch)
                if batch is None:
                    return

        def refill() -> None:
            if not state["fetching"] and local.qsize() <= state["low"]:
                state["fetching"] = True
                want.set()

        def deliver(batch) -> None:
            state["fetching"] = False
            if batch is None:
                state["fetching"] = True  # no more fetches
                for _ in range(n):
                    local.put_nowait(None)
                return
            state["low"] = len(batch)
            for p in batch:
                local.put_nowait(p)
            refill()

        def watch_stop() -> None:  # polls: waiting on a multiprocessing.Event blocks its setter once a waiter died
            while not stop.value:
                time.sleep(0.1)
            try:
                loop.call_soon_threadsafe(main.cancel)
            except RuntimeError:  # the loop has already finished
                pass

        async def worker() -> None:
            while True:
                prompt = await local.get()
                if prompt is None:
                    return
                refill()
                emit(await self._conversation(fleet, prompt, info))

        threading.Thread(target=watch_stop, daemon=True, name="stop-watch").start()
        tasks_ = []
        try:
            await fleet.start()
            want.set()
            threading.Thread(target=fetcher, daemon=True, name="prompt-fetch").start()
            tasks_ = [asyncio.ensure_future(worker()) for _ in range(n)]
            await asyncio.gather(*tasks_)
        except asyncio.CancelledError:
            if stop.value:
                return None
            raise
        finally:
            for t in tasks_:
                t.cancel()
            await asyncio.gather(*tasks_, return_exceptions=True)
            await fleet.close()
        return _fleet_stats(self.stats, fleet)


# ------------------------------------------------------------------------------------------------
# several client processes for one shard (generation.client_processes > 1)
#
# The openai client costs about 0.7-1 ms of CPU per request, so one event loop fills one core at about
# 1,000-1,400 requests/s. With client_processes = P the parent starts P "spawn" processes, each with its
# own event loop and fleet (every endpoint's max_concurrency split between them, the shares summing to
# the cap); they take batches of prompts from one shared queue (dynamic: a long conversation does not
# hold up a static part) and send each finished record back. The parent stays the only writer: it
# calls ``on_done`` per record (progress file, error sidecar, bar), so a killed job re-sends its
# in-flight conversations plus those still in the results pipe, never one the progress file holds. Each process has its own take-out/re-probe state and circuit breaker.

#: Prompts per task-queue item (fewer queue round trips; small enough to keep the split dynamic).
_TASK_BATCH = 8
#: Seconds a stopping client process gets to hand back what it finished before it is terminated.
_STOP_GRACE_S = 10.0


def _fleet_stats(counts: Counter, fleet: _Fleet) -> dict:
    return {
        "requests": counts["attempts"] - counts["retries"],
        "attempts": counts["attempts"],
        "retries": counts["retries"],
        "rate_limited": counts["rate_limited"],
        "endpoints": {
            ep.url: {"attempts": ep.attempts, "failures": ep.failures, "taken_out": ep.taken_out} for ep in fleet.eps
        },
    }


def _split_caps(gen_cfg: dict, n: int) -> list[dict]:
    """``n`` copies of ``gen_cfg`` whose endpoints' ``max_concurrency`` add up to the original caps (the
    remainders spread round-robin over the processes); each copy has ``client_processes: 1``."""
    out = [{**gen_cfg, "client_processes": 1, "endpoints": []} for _ in range(n)]
    turn = 0
    for ep in gen_cfg["endpoints"]:
        cap = int(ep.get("max_concurrency", 64))
        base, extra = divmod(cap, n)
        for k in range(n):
            share = base + (1 if (k - turn) % n < extra else 0)
            out[k]["endpoints"].append({**ep, "max_concurrency": share})
        turn = (turn + extra) % n
    return out


class _ForwardLog(logging.Handler):
    """A client process's log records, sent to the parent (which logs them under its own handlers)."""

    def __init__(self, results, wid: int):
        super().__init__()
        self.results, self.wid = results, wid

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
            if record.exc_info:
                msg += "\n" + logging.Formatter().formatException(record.exc_info)
            self.results.put(("log", self.wid, record.name, record.levelno, msg))
        except Exception:  # logging must never take the client down
            pass


def _die_with_parent(ppid: int) -> None:
    """End this process as soon as its parent is gone (a kill -9 of the job must not leave clients
    sending requests): PR_SET_PDEATHSIG on Linux, and a watchdog thread polling ``os.getppid()``."""
    import signal
    import threading

    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except Exception:  # the watchdog still covers it
            pass
    if os.getppid() != ppid:  # the parent died before the prctl
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != ppid:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _client_process(wid: int, ppid: int, gen_cfg: dict, init_kw: dict, info: RunInfo, tasks, results, stop,
                    log_level: int) -> None:
    """Entry point of client process ``wid`` (spawned by :func:`_run_client_processes`)."""
    _die_with_parent(ppid)
    root = logging.getLogger()
    root.handlers[:] = [_ForwardLog(results, wid)]
    root.setLevel(log_level)
    _raise_http_log_levels()  # for the life of this process (its log records travel through the results queue)
    try:
        backend = OpenAIBackend(gen_cfg, **init_kw)  # API keys from the inherited environment, as in the parent
        out: list[dict] = []
        loop_ref: list = []

        def flush() -> None:
            results.put(("recs", list(out)))
            out.clear()

        def emit(record: dict) -> None:  # one message per loop iteration, however many finished in it
            if not out:
                loop_ref[0].call_soon(flush)
            out.append(record)

        async def main() -> dict | None:
            loop_ref.append(asyncio.get_running_loop())
            return await backend._serve(tasks, emit, info, stop)

        stats = asyncio.run(main())
        if out:
            flush()
        results.put(("done", wid, stats))
    except (GenerationError, ConfigError) as exc:  # re-raised by the parent as the same type
        results.put(("error", wid, str(exc), type(exc).__name__))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the job
        log.error("client process %d failed", wid, exc_info=True)
        results.put(("error", wid, f"client process {wid} failed: {type(exc).__name__}: {exc}", "GenerationError"))


class _BareMain:
    """While starting "spawn" children, hide the ``__main__`` module: a child re-imports the parent's
    main script unless it is guarded by ``if __name__ == "__main__"``, and Snakemake's ``script:`` files
    are not (the child would run the job again). The children need nothing from it."""

    def __enter__(self):
        import types

        self.saved = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")

    def __exit__(self, *exc):
        if self.saved is not None:
            sys.modules["__main__"] = self.saved


def _run_client_processes(backend: OpenAIBackend, prompts: Sequence[dict], on_done: OnDone, info: RunInfo, n: int) -> dict:
    """:meth:`OpenAIBackend.run` over ``n`` client processes (see the comment above)."""
    import multiprocessing
    import queue as queue_mod

    if not backend._probed:  # once here: every process sends and records the same, checked model, and a
        asyncio.run(backend._discover())  # configuration error is raised here rather than in each process
    info.model = backend.model
    cfg = backend.cfg
    init_kw = {**backend._init_kw, "resolved_model": backend.model}
    ctx = multiprocessing.get_context("spawn")  # not fork: the parent may hold threads
    tasks, results = ctx.Queue(), ctx.Queue()
    stop = ctx.RawValue("b", 0)  # set by the parent: end in-flight conversations and hand back what finished
    k = max(1, min(_TASK_BATCH, len(prompts) // (4 * n)))
    for i in range(0, len(prompts), k):
        tasks.put(list(prompts[i:i + k]))
    for _ in range(n):
        tasks.put(None)
    level = logging.getLogger(__name__).getEffectiveLevel()
    procs = [
        ctx.Process(
            target=_client_process, name=f"dflash-client-{i}", daemon=True,
            args=(i, os.getpid(), c, init_kw, info, tasks, results, stop, level),
        )
        for i, c in enumerate(_split_caps(cfg, n))
    ]
    finished: dict[int, dict | None] = {}
    error: str | None = None
    error_type: type[Exception] = GenerationError
    exited_at: dict[int, float] = {}
    stop_deadline = None
    try:
        with _BareMain():
            for p in procs:
                p.start()
        next_check = time.monotonic() + 0.5
        while True:
            try:
                msg = results.get(timeout=0.2)
            except queue_mod.Empty:
                msg = None
            if msg is not None:
                kind = msg[0]
                if kind == "recs":
                    for rec in msg[1]:
                        on_done(rec)
                elif kind == "log":
                    _, wid, name, levelno, text = msg
                    logging.getLogger(name).log(levelno, "[client process %d] %s", wid, text)
                elif kind == "done":
                    finished[msg[1]] = msg[2]
                elif kind == "error":
                    finished[msg[1]] = None
                    if error is None:
                        error = msg[2]
                        error_type = ConfigError if msg[3] == "ConfigError" else GenerationError
            now = time.monotonic()
            if msg is None or now >= next_check:
                next_check = now + 0.5
                for i, p in enumerate(procs):
                    if i in finished or p.exitcode is None:
                        continue
                    # its last messages may still be in the pipe: a crash only after a grace period
                    if now - exited_at.setdefault(i, now) > 1.0:
                        finished[i] = None
                        if error is None:
                            error = (f"client process {i} exited with code {p.exitcode} before finishing "
                                     f"(see the log above)")
            if error is not None and stop_deadline is None:
                stop.value = 1  # the others end their in-flight conversations and hand back what finished
                stop_deadline = now + _STOP_GRACE_S
            if len(finished) == n:
                break
            if stop_deadline is not None and now > stop_deadline:
                break
    finally:
        stop.value = 1
        deadline = time.monotonic() + 5.0
        for p in procs:
            if p.pid is not None:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)
        tasks.cancel_join_thread()
        tasks.close()
        results.close()
    if error is not None:
        raise error_type(error)
    total: dict = {"requests": 0, "attempts": 0, "retries": 0, "rate_limited": 0,
                   "endpoints": {redact_url(e["base_url"]): {"attempts": 0, "failures": 0, "taken_out": 0}
                                 for e in backend.cfg["endpoints"]}}
    for part in finished.values():
        for key in ("requests", "attempts", "retries", "rate_limited"):
            total[key] += part[key]
        for url, e in part["endpoints"].items():
            for key in ("attempts", "failures", "taken_out"):
                total["endpoints"][url][key] += e[key]
    total["client_processes"] = n
    return total


# ------------------------------------------------------------------------------------------------
# entry point


def make_backend(gen_cfg: dict, *, target_dir=None, chat_template=None, trust_remote_code=False, dtype="auto") -> Backend:
    """The backend named by ``gen_cfg["backend"]``. Raises ConfigError for an unknown one."""
    if gen_cfg["backend"] == "transformers":
        if int(gen_cfg.get("client_processes", 1) or 1) > 1:
            raise ConfigError("generation.client_processes applies to the openai backend only (transformers generates in-process)")
        if gen_cfg.get("api", "chat") != "chat":
            raise ConfigError("generation.api: completions applies to the openai backend only (transformers renders locally anyway)")
        if target_dir is None:
            raise ConfigError("generation.backend=transformers needs the target directory (target.path)")
        return TransformersBackend(
            target_dir, gen_cfg, chat_template=chat_template, trust_remote_code=trust_remote_code, dtype=dtype
        )
    if gen_cfg["backend"] == "openai":
        return OpenAIBackend(gen_cfg, target_dir=target_dir, chat_template=chat_template, trust_remote_code=trust_remote_code)
    raise ConfigError(f"generation.backend: unknown backend {gen_cfg['backend']!r}; use transformers or openai")


def preflight_template(
    target_dir: str | Path,
    *,
    gen_cfg: dict,
    tokens_cfg: dict,
    chat_template: str | Path | None = None,
    trust_remote_code: bool = False,
) -> list[str]:
    """Before a completions job generates anything: :func:`dflash_pipeline.spans.check_template` on the
    target's tokenizer and template in ``gen_cfg["thinking"]`` (skipped, with a warning, when
    ``tokens_cfg["use_server_token_ids"]`` is set: those records need no render). Warnings are logged and
    returned.

    Raises:
        ConfigError: the tokens stage could not mask conversations of this template in this mode.
    """
    from . import spans  # the string level only: no numpy/pyarrow in this rule's env

    if tokens_cfg.get("use_server_token_ids"):
        log.warning("tokens.use_server_token_ids is set: the chat-template check is skipped; records without "
                    "server token ids will still need the render path")
        return []
    tok = load_tokenizer(target_dir, chat_template=chat_template, trust_remote_code=trust_remote_code)
    name = f"chat template {chat_template}" if chat_template else f"chat template of {target_dir}"
    warnings = spans.check_template(tok, gen_cfg["thinking"], template_name=name)
    for w in warnings:
        log.warning("%s", w)
    return warnings


def generate_shard(
    prompt_shard: str | Path,
    out_path: str | Path,
    *,
    target_dir: str | Path | None,
    gen_cfg: dict,
    chat_template: str | Path | None = None,
    trust_remote_code: bool = False,
    progress_path: str | Path | None = None,
    errors_path: str | Path | None = None,
    stats_path: str | Path | None = None,
    dtype: str = "auto",
    backend: Backend | None = None,
) -> dict:
    """Generate the completion shard for one prompt shard (the ``generate_completions`` rule's entry).

    Args:
        prompt_shard: Parquet file with ``contracts.PROMPT_SCHEMA``.
        out_path: completion shard to write (``contracts.COMPLETION_SCHEMA``, atomic).
        target_dir: the target (weights for the transformers backend; tokenizer and template for openai
            with ``api: completions``; else unused by openai).
        gen_cfg: validated ``config["generation"]`` (all defaults filled).
        chat_template, trust_remote_code, dtype: as ``target.*`` (transformers backend; the first two also
            for ``api: completions``).
        progress_path: resume file (default ``<out_path>.progress.jsonl``), removed once the shard is written.
        errors_path: error sidecar (default ``<out_path>.errors.jsonl``), rewritten each run; removed when
            a run ends with no errors.
        stats_path: if given, the run's stats are written there as JSON.
        backend: an already built backend (tests, benchmarks); default from ``gen_cfg["backend"]``.

    Returns:
        stats (also written to ``stats_path``). Whole shard, from its final records (resumed ones
        included): ``prompts, ok, truncated, error, turns, prompt_tokens, completion_tokens`` (turns =
        assistant turns in the records, error rows' partial turns included). This run only: ``resumed``
        (conversations taken from the progress file), ``generated`` (conversations sent), ``wall_s``
        (seconds of this call), ``conversations_per_s, requests_per_s, output_tokens_per_s``, the
        backend's ``requests, attempts, retries`` (and for openai ``rate_limited``, per-endpoint
        ``endpoints``, ``client_processes``), and ``run``: ``{generated, turns, prompt_tokens,
        completion_tokens, wall_s, conversations_per_s, requests_per_s, output_tokens_per_s}`` with turns
        and tokens of the conversations generated in this run (the rates divide these by ``wall_s``).

    Raises:
        GenerationError: the circuit breaker opened, or more than ``max_error_fraction`` of the shard
            failed (the shard is not written; finished conversations stay in the progress file).
        DataError: malformed prompt shard. ConfigError: bad generation settings.
    """
    t_start = time.monotonic()
    out_path = Path(out_path)
    progress_path = Path(progress_path) if progress_path else Path(str(out_path) + PROGRESS_SUFFIX)
    errors_path = Path(errors_path) if errors_path else Path(str(out_path) + ERRORS_SUFFIX)
    prompts = read_prompts(prompt_shard)
    thinking = gen_cfg["thinking"]
    template_kwargs(thinking)  # validates the mode

    progress = ProgressLog(progress_path, _fingerprint(gen_cfg["backend"], gen_cfg, target_dir, chat_template))
    wanted = {p["prompt_id"] for p in prompts}
    done = {pid: r for pid, r in progress.load().items() if pid in wanted and r.get("status") in ("ok", "truncated")}
    pending = [p for p in prompts if p["prompt_id"] not in done]

    def stopped(exc: GenerationError) -> GenerationError:
        kept = (f"{len(done)} of {len(prompts)} conversations are finished and kept in {progress_path}; rerunning "
                f"sends only the rest" if done else f"none of the {len(prompts)} conversations is finished yet")
        return GenerationError(f"{out_path}: {str(exc).rstrip('.')}. {kept}")

    failed: dict[str, dict] = {}
    backend_stats: dict = {}
    model_name = None
    if done:
        model_name = next(iter(done.values())).get("model")
    if pending:
        if backend is None:
            backend = make_backend(
                gen_cfg, target_dir=target_dir, chat_template=chat_template,
                trust_remote_code=trust_remote_code, dtype=dtype,
            )
        if done:  # resumed records must come from the model this run sends (generation.model unset: /models)
            resolve = getattr(backend, "resolve_model", None)
            try:
                with _quiet_http_logs():
                    model_name = resolve() if resolve is not None else backend.model
            except GenerationError as exc:  # the breaker opened before any endpoint answered
                raise stopped(exc) from None
            if model_name and _drop_other_model(done, model_name, progress_path):
                pending = [p for p in prompts if p["prompt_id"] not in done]
    resumed = len(done)
    if resumed:
        log.info("%s: resuming, %d of %d conversations already finished", out_path, resumed, len(prompts))

    if pending:
        info = RunInfo(model=backend.model, sampling=canonical_json(sampling_params(gen_cfg)), thinking=thinking)
        progress.open(done.values())
        errors_path.parent.mkdir(parents=True, exist_ok=True)
        err_fh = open(errors_path, "w", encoding="utf-8")
        bar = _Progress(len(prompts), resumed, out_path.name, resumed_records=done.values())

        def on_done(record: dict) -> None:
            if record["status"] == "error":
                failed[record["prompt_id"]] = record
                err_fh.write(json.dumps({
                    "prompt_id": record["prompt_id"], "dataset": record["dataset"], "error": record["error"],
                    "turns_done": len(record["turns"]), "model": record["model"],
                }, ensure_ascii=False) + "\n")
                err_fh.flush()
            else:
                done[record["prompt_id"]] = record
                progress.append(record)
            bar.update(record)

        try:
            with _quiet_http_logs():
                backend_stats = backend.run(pending, on_done, info)
        except GenerationError as exc:
            raise stopped(exc) from None
        finally:
            bar.close()
            progress.close()
            err_fh.close()
        model_name = info.model

    missing = [p["prompt_id"] for p in prompts if p["prompt_id"] not in done and p["prompt_id"] not in failed]
    if missing:  # a backend bug, never silently dropped
        raise GenerationError(f"{out_path}: backend returned no record for {len(missing)} prompts (first: {missing[0]})")
    n_err = len(failed)
    if n_err > gen_cfg.get("max_error_fraction", 0.0) * len(prompts):
        first = next(iter(failed.values()))
        raise GenerationError(
            f"{out_path}: {n_err} of {len(prompts)} conversations failed (first: prompt {first['prompt_id']}: "
            f"{first['error']}); all are listed in {errors_path}. The {len(done)} finished ones are kept in "
            f"{progress_path}, so a rerun retries only the failed ones. To accept failures as status=error "
            f"rows instead, raise generation.max_error_fraction"
        )

    records = [done.get(p["prompt_id"]) or failed[p["prompt_id"]] for p in prompts]
    counts = Counter(r["status"] for r in records)
    table = shards.table_from_records(records, COMPLETION_SCHEMA)
    meta = {
        "schema_version": COMPLETION_SCHEMA_VERSION,
        "stage": "completions",
        "backend": gen_cfg["backend"],
        "model": model_name,
        "sampling": sampling_params(gen_cfg),
        "thinking": thinking,
        "prompt_shard": Path(prompt_shard).name,
        "num_records": len(records),
        "status_counts": {k: counts.get(k, 0) for k in ("ok", "truncated", "error")},
    }
    shards.write_parquet(out_path, table, metadata=meta)
    progress_path.unlink(missing_ok=True)
    if n_err == 0:
        errors_path.unlink(missing_ok=True)

    wall = time.monotonic() - t_start
    gen_ids = {p["prompt_id"] for p in pending}
    all_turns = [t for r in records for t in r["turns"]]
    gen_turns = [t for r in records if r["prompt_id"] in gen_ids for t in r["turns"]]

    def tokens(turns: list[dict], key: str) -> int:
        return sum(t.get(key) or 0 for t in turns)

    def rate(n: int) -> float | None:
        return round(n / wall, 3) if wall > 0 else None

    run = {  # this call only
        "generated": len(pending),
        "turns": len(gen_turns),
        "prompt_tokens": tokens(gen_turns, "prompt_tokens"),
        "completion_tokens": tokens(gen_turns, "completion_tokens"),
        "wall_s": round(wall, 3),
        "conversations_per_s": rate(len(pending)),
        "requests_per_s": rate(len(gen_turns)),
        "output_tokens_per_s": rate(tokens(gen_turns, "completion_tokens")),
    }
    stats = {
        "schema_version": COMPLETION_SCHEMA_VERSION,
        "shard": str(out_path),
        "backend": gen_cfg["backend"],
        "model": model_name,
        # the whole shard (its final records, resumed ones included)
        "prompts": len(prompts),
        "ok": counts.get("ok", 0),
        "truncated": counts.get("truncated", 0),
        "error": counts.get("error", 0),
        "turns": len(all_turns),
        "prompt_tokens": tokens(all_turns, "prompt_tokens"),
        "completion_tokens": tokens(all_turns, "completion_tokens"),
        # this run (as before: report.py reads wall_s and retries)
        "resumed": resumed,
        "generated": len(pending),
        "wall_s": run["wall_s"],
        "conversations_per_s": run["conversations_per_s"],
        "requests_per_s": run["requests_per_s"],
        "output_tokens_per_s": run["output_tokens_per_s"],
        "run": run,
        "requests": 0, "attempts": 0, "retries": 0,
        **backend_stats,
    }
    if stats_path is not None:
        shards.write_json(stats_path, stats, skip_if_identical=False)
    return stats
