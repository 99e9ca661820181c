"""Exception types. Every message names the file, record and field involved, and the fix."""

import re

#: The `user:password@` part of a URL (up to the host's last `@`, so a password holding `@` goes
#: whole), as it may appear in any message text.
_CREDENTIALS_IN_URL = re.compile(r"(?<=://)[^/?#\s'\"]*@")


def strip_url_credentials(text: str) -> str:
    """`text` with the `user:password@` of every URL in it removed: safe for messages, logs and outputs."""
    return _CREDENTIALS_IN_URL.sub("", text)


class PipelineError(Exception):
    """Base class for all errors raised by dflash-pipeline."""


class ConfigError(PipelineError):
    """A config value is missing, out of range or inconsistent (message names the config key)."""


class ProbeError(PipelineError):
    """The target directory cannot be probed (message names the file and what to install or set)."""


class ProbeRefusal(ProbeError):
    """The target is a model the drafter cannot be built for; `reason` names the kind in a few words and the message
    says which config field shows it and what (if anything) to set."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class DataError(PipelineError):
    """A dataset record is malformed (message names file, line/record and field)."""


class GenerationError(PipelineError):
    """Completion generation failed in a way retries cannot fix (e.g. circuit breaker open)."""


class TokenizationError(PipelineError):
    """A conversation cannot be rendered or masked exactly (message names the prompt_id and turn)."""


class MarkupWithoutIdsError(TokenizationError):
    """An answer's text holds a template's control-token string (`<think>`, `<tool_call>`,
    `<|channel|>` ...) and no output token ids say whether the model emitted it as one token (markup) or
    wrote it as text (a quote): the turn cannot be supervised as what the model emitted."""
