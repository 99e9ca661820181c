"""Completions stage: regenerate every assistant turn of a prompt shard with the target.

One prompt shard (`contracts.PROMPT_SCHEMA`) becomes one completion shard
(`contracts.COMPLETION_SCHEMA`), via `generate_shard`. Each user turn is answered against the
*regenerated* history, as a serving client would send it: ``system?, user1, assistant1, user2,
assistant2, ...` where every assistant message (its `content`, plus `reasoning_content`` when there is
one, which Qwen3-style templates read) was produced by the target in this run.

Backends (`generation.backend`), behind one interface (`Backend`):

* `transformers` (default): the target in-process; rendered with `chat.render` (the same thinking
  mapping the tokens stage uses), left-padded batches sorted by prompt length, greedy when
  `temperature == 0` else sampled (seeded per batch).
* `openai`: `AsyncOpenAI` clients against one or more OpenAI-compatible servers (SGLang, vLLM), with
  least-outstanding-requests balancing under a per-endpoint concurrency cap, retries with exponential
  backoff and jitter, endpoints taken out after repeated failures and re-probed (`GET /models`; a warning
  every 30 s while none is available), and a circuit breaker (see the `generation.*` keys in the config
  schema for every knob). The model sent is checked against each endpoint's `GET /models` at start and
  when a taken-out endpoint answers again: `generation.model` must be listed by every endpoint that lists
  models; unset, the endpoints must list the same models (the first is sent). A rejected key (401/403) or a
  `/models` that answers 404 (a base_url without `/v1`) is a configuration error, not an outage. Error
  messages carry the cause chain (a refused connection reads `Cannot connect to host`), and the HTTP
  client's per-request INFO lines are silenced while generating.
  `generation.api: completions` (default `chat`) is the raw mode for servers without a chat endpoint:
  the same fleet, but each turn's history is rendered here with the target's own template
  (`chat.render`, the thinking mapping above) and sent to `POST /completions` as **token ids**
  (the render tokenized with `add_special_tokens=False`, exactly what the transformers backend and the
  tokens stage use). A string prompt would be tokenized by vLLM/SGLang with special tokens added, so
  templates that write their own BOS would get it twice. Reasoning is split from `<think>…</think>` in
  the returned text (a generation prompt that already opens `<think>` counts as its start).

**Record.** `messages` holds the system/user messages as given and each generated assistant message
with `content` (the answer; special tokens skipped, as servers decode) and `reasoning_content` (the
text between `<think>` and `</think>` when the target thought, else null). `turns[i]` describes
assistant turn `i`: `finish_reason` (`stop|length`), `prompt_tokens`/`completion_tokens`,
`prompt_token_ids`/`output_token_ids` (transformers: always, `output_token_ids` including the
end-of-turn token when generated; openai: only when the server returns them, e.g. vLLM with
`extra_body: {return_token_ids: true}`), `latency_s` (seconds of the successful request; the whole
batch for transformers) and `endpoint` (base URL without credentials, or `transformers`). `status`
is `truncated` if any turn hit `max_tokens` (later user turns are still answered), `error` with
`error` naming the turn and cause, else `ok`.

**Thinking.** `disable` sends/renders `enable_thinking=False` and rejects (error row, not retried) an
answer that still carries reasoning; `save` sends `enable_thinking=True` and, on the openai backend,
requires `reasoning_content` (or `reasoning`, newer vLLM; or a raw `<think>…</think>` in the content,
which is split locally) — a missing one means the server runs without a reasoning parser; `none` uses
the template's default and keeps whatever reasoning comes back.

**Resume.** Every finished conversation (ok or truncated) is appended as one JSON line, flushed, to the
progress file (default `<out>.progress.jsonl`; its first line is a header with the generation settings,
and a file written under other settings is discarded; so are finished conversations of another model
than the one the endpoints serve now, with `generation.model` unset). A rerun sends only prompts not in
it, so a killed job re-sends at most its in-flight conversations (with `client_processes > 1`, also those a client
process had finished but the parent had not yet written: at most one event-loop turn's worth each). The shard is written atomically in prompt-shard order
with each prompt exactly once, then the progress file is removed.

**Errors.** A conversation that fails after retries (other 4xx, retries exhausted, reasoning in disable
mode, ...) goes to the sidecar `<out>.errors.jsonl` (rewritten each run), never to the progress file, so
the next run retries it. If more than `generation.max_error_fraction` (default 0) of the shard failed,
`generate_shard` raises `GenerationError` without writing the shard (finished conversations
stay in the progress file); otherwise the failed conversations are written as `status: error` rows
with their message, and the sidecar stays next to the shard. Rows never vanish.

**Secrets.** The API key is read from the environment variable named by `api_key_env` and handed only
to the HTTP client; records, sidecars, stats and logs carry base URLs with any `user:pass@` removed.

**Layout** (one module per concern; this package re-exports every name the stage's callers use):

========================  ====================================================================
`records`               `Turn`, `build_record`, thinking checks, `read_prompts`
`resume`                `ProgressLog` and the progress header's fingerprint
`retry`                 retry policy: should-retry, retry delay with jitter, `Retry-After`
`describe`              one-line descriptions of failures (cause chain, no credentials)
`fleet`                 endpoints, least-outstanding selection, take-out/re-probe, breaker, model check
`openai_backend`        `OpenAIBackend` (one request, one conversation, one event loop)
`workers`               `generation.client_processes > 1`: client processes and their parent
`transformers_backend`  `TransformersBackend` (in-process batched generation)
`stats`                 progress bar, request counters, the shard's stats JSON
`generate`              `generate_shard` (the orchestrator), `make_backend`
========================  ====================================================================
"""

from .describe import _describe, _first_line, _root_cause
from .fleet import OUTAGE_LOG_S, _auth_error, _Endpoint, _Fleet, _model_list, _not_found_error, _settle_model
from .generate import Backend, context_limit, generate_shard, make_backend, preflight_template, too_long_prompts
from .openai_backend import OpenAIBackend, _aiohttp_client, _first_choice, _response_facts
from .records import (
    DISABLE_HINT_LOCAL,
    DISABLE_HINT_SERVER,
    HTTP_LOGGERS,
    OnDone,
    RowError,
    RunInfo,
    Turn,
    _quiet_http_logs,
    _raise_http_log_levels,
    build_record,
    check_thinking,
    cut_at_eos,
    read_prompts,
    redact_url,
    sampling_params,
    split_reasoning,
    take_reasoning,
)
from .resume import ERRORS_SUFFIX, PROGRESS_SUFFIX, ProgressLog, _drop_other_model, _fingerprint
from .retry import (
    AUTH,
    AUTH_STATUS,
    CLIENT,
    RATE_LIMITED,
    RETRYABLE_STATUS,
    Failure,
    parse_retry_after,
    retry_delay,
    should_retry,
    status_failure,
)
from .stats import _Progress
from .transformers_backend import TransformersBackend
from .workers import _client_process, _split_caps, run_client_processes

_run_client_processes = run_client_processes  # the name before the package split

__all__ = [
    "AUTH_STATUS",
    "Backend",
    "DISABLE_HINT_LOCAL",
    "DISABLE_HINT_SERVER",
    "ERRORS_SUFFIX",
    "HTTP_LOGGERS",
    "OUTAGE_LOG_S",
    "OnDone",
    "OpenAIBackend",
    "PROGRESS_SUFFIX",
    "ProgressLog",
    "RETRYABLE_STATUS",
    "RowError",
    "RunInfo",
    "TransformersBackend",
    "Turn",
    "build_record",
    "check_thinking",
    "cut_at_eos",
    "generate_shard",
    "make_backend",
    "parse_retry_after",
    "preflight_template",
    "read_prompts",
    "redact_url",
    "retry_delay",
    "run_client_processes",
    "sampling_params",
    "should_retry",
    "split_reasoning",
    "take_reasoning",
    "context_limit",
    "too_long_prompts",
]
