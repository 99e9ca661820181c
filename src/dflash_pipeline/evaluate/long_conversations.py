"""Long eval conversations: multi-turn chats built up to a context length, to measure τ where it collapses.

An eval set with `build_to_tokens: N` reads a chat file with assistant turns (ShareGPT or OpenAI
messages), leaves out training prompts, shuffles the rest with `eval.seed` and strings their exchanges
together until the history, rendered with the target's template, reaches `N` tokens; the next user turn
is the one the loop answers.
"""

from __future__ import annotations

import os
import random
from typing import Callable, Iterable, Iterator, Mapping, Sequence

from dflash_pipeline.core.contracts import prompt_id
from dflash_pipeline.core.errors import ConfigError, DataError

_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "system": "system",
}


def chat_messages(record: Mapping, where: str) -> list[dict]:
    """`[{role, content}]` of a ShareGPT (`conversations`: `from`/`value`) or OpenAI (`messages`:
    `role`/`content`) record, assistant turns kept.

    Raises:
        DataError: neither shape, or a turn without string text or with an unknown role (names `where`).
    """
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list):
        raise DataError(f"{where}: a long-conversation record needs `conversations` (ShareGPT) or `messages` (OpenAI)")
    out = []
    for i, t in enumerate(turns):
        role = _ROLES.get(str(t.get("from", t.get("role"))).lower()) if isinstance(t, Mapping) else None
        text = t.get("value", t.get("content")) if isinstance(t, Mapping) else None
        if role is None or not isinstance(text, str):
            raise DataError(f"{where}: turn {i} needs a known role (human/gpt/user/assistant/system) and string text")
        out.append({"role": role, "content": text})
    return out


def exchanges(messages: Sequence[dict]) -> Iterator[tuple[str, str]]:
    """The `(user, assistant)` pairs of a chat, in order (system turns and an unanswered last user turn left out)."""
    pending = None
    for m in messages:
        if m["role"] == "user":
            pending = m["content"]
        elif m["role"] == "assistant" and pending is not None:
            yield pending, m["content"]
            pending = None


def build_long_conversations(
    chats: Iterable[list[dict]],
    *,
    build_to_tokens: int,
    num_samples: int,
    count_tokens: Callable[[list[dict]], int],
) -> list[dict]:
    """Up to `num_samples` eval records `{prompt_id, system: None, history, turns: [user turn]}` whose `history`
    (user/assistant messages) renders to at least `build_to_tokens` tokens (`count_tokens(history + [final user
    turn])`), built from the exchanges of `chats` in order. `prompt_id` hashes the whole conversation sent."""
    if build_to_tokens < 1:
        raise ConfigError(f"eval.sets.*.build_to_tokens must be >= 1, got {build_to_tokens}")
    stream = (ex for chat in chats for ex in exchanges(chat))
    records: list[dict] = []
    history: list[dict] = []
    for user, assistant in stream:
        final = [{"role": "user", "content": user}]
        if history and count_tokens(history + final) >= build_to_tokens:
            records.append(
                {"prompt_id": prompt_id(history + final), "system": None, "history": history, "turns": [user]}
            )
            history = []
            if len(records) == num_samples:
                break
            continue  # this exchange was the final turn of the record
        history = history + [*final, {"role": "assistant", "content": assistant}]
    return records


def load_long_conversations(
    path: str | os.PathLike,
    *,
    build_to_tokens: int,
    num_samples: int,
    seed: int,
    count_tokens: Callable[[list[dict]], int],
    exclude_prompt_ids: Iterable[str] = (),
) -> tuple[list[dict], dict]:
    """The long eval records of one set (module docstring) and `{available, excluded_training_prompts}`.

    Raises:
        DataError: unreadable file or a record of neither chat shape (`chat_messages`).
    """
    from dflash_pipeline.prompts import RejectedRecord, normalize_record, read_records

    exclude = set(exclude_prompt_ids)
    chats, excluded, available = [], 0, 0
    for loc, rec in read_records(path, strict=True):
        available += 1
        messages = chat_messages(rec, str(loc))
        try:
            pid = prompt_id(normalize_record(rec))
        except (RejectedRecord, DataError):  # a record the prompts stage drops was never a training prompt
            pid = None
        if pid is not None and pid in exclude:
            excluded += 1
            continue
        chats.append(messages)
    random.Random(seed).shuffle(chats)
    records = build_long_conversations(
        chats, build_to_tokens=build_to_tokens, num_samples=num_samples, count_tokens=count_tokens
    )
    return records, {"available": available, "excluded_training_prompts": excluded}
