"""A local OpenAI-compatible server (chat and raw completions) for tests, benchmarks and end-to-end runs, with fault injection.

It stands in for SGLang/vLLM: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions` (a
string or token ids), `GET /health`, `GET /metrics` (Prometheus-style counters, vLLM's spec-decode counters
included) and `GET /stats` (everything `ServerStats` counts, as JSON), on 127.0.0.1 by default.

Answers are **canned** (default: deterministic text from the conversation, one "token" per word, so a small
`max_tokens` gives `finish_reason: length`; `reasoning=True` acts like a thinking model behind a reasoning
parser) or from the tiny **target** at `target_dir` (its chat template, greedy, `<think>` split into
`reasoning_content`). A canned chat request that offers `tools` is answered with a call of the first tool.
Token ids come back as vLLM returns them when the body asks `return_token_ids: true`; `flavor="sglang"`
answers in SGLang's shapes (`.sglang`), `flavor="sglang-legacy"` ignores `return_token_ids`. With
`spec_accept_length=τ` answers carry SGLang-style `meta_info` and `/metrics` vLLM's draft counters.

Faults (`Faults`, changeable while the server runs) drop, hang or fail generation requests by number, or
kill the server after `die_after` requests; marker strings force a 400, a wrong answer or a malformed body.
Every request is counted per first user message and per conversation, so tests can assert that nothing
was sent twice. The flags: docs/how-to/server-fleet.md ("The local test server").

Use `start_test_server` (a context manager; a background thread) or the CLI::

    python -m dflash_pipeline.testing.server --port 0 --target resources/demo-target --port-file p.txt
    python -m dflash_pipeline.testing.server --port 31001 --fail-every 5 --delay-s 0.5 --die-after 300
"""

from __future__ import annotations

# Modules: `faults`, `stats`, `answers`, `sglang`, `app` (`TestServer`), `cli`.
from .answers import split_think
from .app import DEFAULT_MODEL_NAME, FLAVORS, TestServer, start_test_server
from .cli import _parser, main  # noqa: F401  (_parser: tests build the CLI parser)
from .faults import Faults, faults_summary
from .stats import ServerStats

__all__ = [
    "DEFAULT_MODEL_NAME",
    "FLAVORS",
    "Faults",
    "ServerStats",
    "TestServer",
    "faults_summary",
    "main",
    "split_think",
    "start_test_server",
]
