"""Completions stage: regenerate every assistant turn of a prompt shard with the target.

One prompt shard (`contracts.PROMPT_SCHEMA`) becomes one completion shard (`contracts.COMPLETION_SCHEMA`)
via `generate_shard`; each user turn is answered against the regenerated history. Backends
(`generation.backend`) share one interface (`Backend`): `transformers` (the target in-process, batched,
greedy at `temperature == 0`) and `openai` (`AsyncOpenAI` clients over a fleet of SGLang/vLLM servers:
balancing, retries, take-out and re-probe, a circuit breaker, the served-model check; `generation.api:
completions` sends token ids rendered here). The API key comes from the variable named by `api_key_env`;
records, sidecars, stats and logs carry base URLs without credentials.

The record, thinking modes, resume and error rows: docs/how-to/server-fleet.md. This package re-exports
every name the stage's callers use from its modules (docs/reference/layout.md).
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
