"""A local OpenAI-compatible server (chat and raw completions) for tests, benchmarks and end-to-end runs, with fault injection.

It stands in for SGLang/vLLM (DESIGN.md §4): `GET /v1/models`, `POST /v1/chat/completions`,
`POST /v1/completions` (raw prompts: a string, or token ids as `generation.api: completions` sends),
`GET /health`, `GET /metrics` (Prometheus-style counters) and `GET /stats` (everything
`ServerStats` counts, per-prompt request counts included, as JSON), on 127.0.0.1 by default.

Two answer modes:

* **canned** (default): a deterministic answer computed from the conversation, e.g.
  `"Answer 2 to: <last user message>"`; one "token" per whitespace-separated word, so `max_tokens`
  smaller than the answer gives `finish_reason: length`. With `reasoning=True` the server acts like a
  thinking model behind a reasoning parser: `reasoning_content` is returned unless the request sends
  `chat_template_kwargs: {enable_thinking: false}`.
* **target**: the tiny target at `target_dir`, rendered with its own chat template (honoring
  `chat_template_kwargs`) and decoded greedily; `<think>…</think>` is split into `reasoning_content`
  like SGLang's `--reasoning-parser qwen3`.

Tools: a canned-mode chat request that offers `tools` and ends with a user turn is answered with a call of
the first tool, `{"query": <last user message>}` (`finish_reason: tool_calls`, `content: ""`), as a server
with a tool-call parser answers; with a tokenizer its output ids are the chat template's render of that call
(Qwen3: `<tool_call>` as its added token). After the tool results it answers in text. `/stats` counts the
requests that offered tools (`tool_requests`) and lists the distinct `tools` it received (`tools_seen`).

Token ids are returned as vLLM does when the request body has `return_token_ids: true`
(`prompt_token_ids` at the top level, `choices[0].token_ids`; on `/v1/completions` both in
`choices[0]`). `flavor="sglang"` answers in SGLang's exact shapes instead (`.sglang`): ids per choice
(`return_token_ids`) and in the response-level `sglext` (`return_input_ids_in_sglext` /
`return_output_ids_in_sglext`), `meta_info` per choice (`return_meta_info`, with the `spec_*`
acceptance figures of a drafter), server-sent events for `stream: true`, and the 400 SGLang gives when a
streamed chat asks for ids; with a tokenizer (`tokenizer_dir`) canned answers then carry the real ids of
the rendered prompt and of the raw text (think block included). `flavor="sglang-legacy"` is an SGLang from
before PR #30917, which ignores `return_token_ids`.

`/v1/completions` answers `choices[0].text` in the OpenAI completions format. A token-id prompt is
decoded with the target's tokenizer (target mode) or `tokenizer_dir`'s (canned mode; without one the
ids stand for themselves); a string prompt is tokenized with special tokens added, as vLLM/SGLang do.
Target mode continues the prompt greedily; canned mode answers ``"Completion <sha8> of a <n>-word
prompt."`, and with `reasoning=True` puts a `<think>…</think>`` block before it unless the prompt
already ends with a closed one (the template's "thinking disabled" generation prompt); a prompt that
ends with an open `<think>` gets only the rest of the block, as a model would write it.

Speculative-decoding metrics (`spec_accept_length=τ`): every answer then carries SGLang-style
`meta_info` (`spec_accept_length`, `spec_verify_ct` = ⌈completion tokens / τ⌉) unless
`spec_meta_info=False`, and `/metrics` exposes vLLM's counters `vllm:spec_decode_num_drafts_total`
(one per verify step) and `vllm:spec_decode_num_accepted_tokens_total` (completion tokens − verify
steps), so `evaluate.server_acceptance` can be tested in both modes.

Faults (a mutable `Faults`, changeable while the server runs) apply to generation requests (chat
and completions, counted together and numbered 1, 2, … in order of arrival): first `drop_first`
requests get their connection dropped, the next `hang_first` get no answer for `hang_s` seconds (then
a dropped connection), the next `fail_first` get HTTP `fail_status` (with `Retry-After` if set);
after that, request numbers that are multiples of `drop_every` / `hang_every` / `fail_every` get
the same faults (checked in that order), and every other request is answered after `delay_s` seconds.
After `die_after` such requests every request (`/v1/models` and `/health` included; not
`/metrics` and `/stats`) is dropped, like a crashed server. Marker strings in the last user message
(anywhere in a completions prompt) force a 400 (`bad_request_marker`), an answer that carries reasoning
although thinking was disabled (`wrong_content_marker`), or a malformed 200 body
(`malformed_marker`). Every request is counted (`ServerStats`) per first user message and per
exact conversation (a completions prompt: its text for both), so tests can assert that nothing was sent
twice; `GET /stats` returns the same counts to other processes.

Use `start_test_server` (a context manager; the server runs in a background thread) or the CLI
(`--help` lists a flag for every field of `Faults`)::

    python -m dflash_pipeline.testing.server --port 0 --target resources/demo-target --port-file p.txt
    python -m dflash_pipeline.testing.server --port 31001 --fail-every 5 --delay-s 0.5 --die-after 300
"""

from __future__ import annotations

# The package by concern: `faults` (the fault plan and its injection), `stats` (what is counted:
# requests, statuses, speculative-decoding counters), `answers` (canned and target answers, prompt
# tokenization), `sglang` (SGLang's answer shapes and streams), `app` (`TestServer`: lifecycle
# and HTTP handlers), `cli` (the command line; `__main__` runs it).
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
