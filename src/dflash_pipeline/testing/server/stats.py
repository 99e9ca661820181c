"""What the test server counts (`ServerStats`): requests per first user message and per exact
conversation (so tests can assert that nothing was sent twice), statuses, and the speculative-decoding
counters of an engine with a drafter (verify steps and accepted draft tokens)."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ServerStats:
    """What the server saw. `by_prompt` is keyed by the first user message of the request, `by_conversation` by the
    canonical JSON of the messages sent (role + content); for completions requests both by the prompt text.
    `chat_requests` counts chat and completions requests, `completions_requests` the latter alone, `tool_requests` the
    chat requests that offered `tools`."""

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
    tool_requests: int = 0
    tools_seen: list = field(default_factory=list)

    def record_request(self, body: dict, prompt_key: str, conversation_key: str) -> None:
        """Keep a generation request's `body` and count it under its prompt and conversation keys."""
        self.requests.append(body)
        if body.get("tools"):
            self.tool_requests += 1
            key = json.dumps(body["tools"], sort_keys=True, ensure_ascii=False)
            if key not in self.tools_seen:
                self.tools_seen.append(key)
        self.by_prompt[prompt_key] += 1
        self.by_conversation[conversation_key] += 1

    def count_spec_decode(self, num_tokens: int, accept_length: float) -> int:
        """Count an answer of `num_tokens` completion tokens from an engine of acceptance length τ =
        `accept_length`: ⌈num_tokens / τ⌉ verify steps (at least 1), each accepting all but its last
        token. Returns the verify steps (SGLang's `spec_verify_ct`)."""
        verify = max(1, math.ceil(num_tokens / max(1.0, accept_length)))
        self.spec_drafts += verify
        self.spec_accepted_tokens += num_tokens - verify
        return verify


def first_user(messages: list[dict]) -> str:
    """Content of the first user message ('' if none): the `by_prompt` key of a chat request."""
    return next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")


def conversation_key(messages: list[dict]) -> str:
    """Canonical JSON of the messages' roles and contents: the `by_conversation` key of a chat request."""
    norm = [{"role": m.get("role"), "content": m.get("content")} for m in messages]
    return json.dumps(norm, sort_keys=True, ensure_ascii=False)
