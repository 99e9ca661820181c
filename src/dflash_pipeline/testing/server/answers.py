"""How the test server answers: canned answers computed from the request, or greedy generation with the
tiny target (`TargetModel`); and the `(text, token ids)` of a completions prompt.

Canned answers count one "token" per whitespace-separated word; their token ids are fake but stable
(`fake_id`), ending in id 2 when the answer stopped rather than hit `max_tokens`.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any


def fake_id(word: str) -> int:
    """A stable fake token id (100 … 30099) for one canned "token"."""
    return int.from_bytes(hashlib.sha256(word.encode("utf-8")).digest()[:2], "little") % 30000 + 100


def split_think(text: str) -> tuple[str | None, str]:
    """Split generated text into (reasoning, content) like a Qwen3 reasoning parser (the pipeline's own
    `completions.split_reasoning`)."""
    from ...completions import split_reasoning

    return split_reasoning(text)


def last_user(messages: list[dict]) -> str:
    """Content of the last user message ('' if none): what canned answers and markers look at."""
    return next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "user"), "")


class TargetModel:
    """Greedy generation with the tiny target (runs in one worker thread; requests are serialized)."""

    def __init__(self, target_dir: str | Path):
        import torch
        from transformers import AutoModelForCausalLM

        from dflash_pipeline.target.chat import load_tokenizer

        self.torch = torch
        self.tok = load_tokenizer(target_dir)
        self.model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tok.eos_token_id is not None and self.tok.eos_token_id not in eos:
            eos.append(self.tok.eos_token_id)
        self.eos_ids = eos
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else eos[0]

    def answer(self, messages: list[dict], template_kwargs: dict, max_tokens: int):
        """Greedy answer to `messages` rendered with the target's chat template (`template_kwargs` =
        the request's `chat_template_kwargs`): `(text, finish_reason, prompt ids, output ids)`."""
        msgs = [{k: v for k, v in m.items() if v is not None} for m in messages]
        text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **template_kwargs)
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return self.complete(ids, max_tokens)

    def complete(self, ids: list[int], max_tokens: int):
        """Greedy continuation of prompt `ids`: `(text, finish_reason, ids, output ids)`."""
        with self.torch.inference_mode():
            out = self.model.generate(
                self.torch.tensor([ids]),
                attention_mask=self.torch.ones(1, len(ids), dtype=self.torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=self.eos_ids,
                pad_token_id=self.pad_id,
            )
        from ...completions import cut_at_eos

        new, stop = cut_at_eos(out[0, len(ids) :].tolist(), self.eos_ids)
        body = new[:-1] if stop else new
        generated = self.tok.decode(body, skip_special_tokens=True)  # as SGLang/vLLM by default
        return generated, ("stop" if stop else "length"), ids, new


def canned_chat(messages: list[dict], kwargs: dict, max_tokens: int, *, reasoning: bool):
    """Canned chat answer `"Answer <n> to: <last user message>"` (n = user turns): `(reasoning, content,
    finish_reason, prompt ids, output ids)`; with `reasoning` a thought unless `kwargs` (the
    request's `chat_template_kwargs`) disable thinking."""
    n_user = sum(1 for m in messages if m.get("role") == "user")
    words = f"Answer {n_user} to: {last_user(messages)}".split()
    finish = "stop"
    if len(words) > max_tokens:
        words, finish = words[:max_tokens], "length"
    thought = None
    if reasoning and kwargs.get("enable_thinking") is not False:
        thought = f"Let me think about turn {n_user}."
    prompt_words = " ".join(f"{m.get('role')}: {m.get('content') or ''}" for m in messages).split()
    out_ids = [fake_id(w) for w in words] + ([2] if finish == "stop" else [])
    return thought, " ".join(words), finish, [fake_id(w) for w in prompt_words], out_ids


def canned_tool_call(messages: list[dict], tools: list[dict], n: int) -> list[dict]:
    """The canned tool call of a request that offers `tools` and ends with a user turn: the first tool, called with
    `{"query": <last user message>}`, as an OpenAI `tool_calls` list."""
    name = (tools[0].get("function") or tools[0])["name"]
    args = json.dumps({"query": last_user(messages)}, ensure_ascii=False)
    return [{"id": f"call_{n}_0", "type": "function", "function": {"name": name, "arguments": args}}]


def tool_turn_ids(tok, messages: list[dict], tools: list[dict], calls: list[dict], kwargs: dict) -> list[int]:
    """The output ids of an assistant turn that makes `calls`, as the chat template writes it (`tok`'s
    template, `tools` and `kwargs` as the request sends them): the render of the conversation with the turn,
    less the render of the prompt, without the whitespace after the end-of-turn token (Qwen3:
    `<tool_call>\n{...}\n</tool_call><|im_end|>`, the added tokens as the model emits them)."""
    msgs = [{k: v for k, v in m.items() if v is not None} for m in messages]
    prompt = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
    turn = {"role": "assistant", "content": "", "tool_calls": [_parsed_args(c) for c in calls]}
    full = tok.apply_chat_template(msgs + [turn], tools=tools, tokenize=False, **kwargs)
    if not full.startswith(prompt):
        raise ValueError("the chat template rewrites the prompt when a tool call follows")
    return list(tok(full[len(prompt) :].rstrip(), add_special_tokens=False)["input_ids"])


def _parsed_args(call: dict) -> dict:
    fn = dict(call["function"])
    if isinstance(fn.get("arguments"), str):
        fn["arguments"] = json.loads(fn["arguments"])
    return {**call, "function": fn}


def canned_text(prompt: str, max_tokens: int, wrong: bool, *, reasoning: bool) -> tuple[str, str, list[int]]:
    """Canned continuation of a raw prompt: `(text, finish_reason, output ids)`; one "token" per whitespace-separated
    piece. `wrong` (or `reasoning`, unless the prompt ends with `</think>`) puts a think block first."""
    digest = hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:8]
    answer = f"Completion {digest} of a {len(prompt.split())}-word prompt."
    tail = prompt.rstrip()
    think = ""
    if wrong or (reasoning and not tail.endswith("</think>")):
        thought = "unexpected reasoning" if wrong else f"Let me think about prompt {digest}."
        think = f"{thought}\n</think>\n\n" if tail.endswith("<think>") else f"<think>\n{thought}\n</think>\n\n"
    pieces = re.findall(r"\S+\s*", think + answer)
    finish = "stop"
    if len(pieces) > max_tokens:
        pieces, finish = pieces[:max_tokens], "length"
    out_ids = [fake_id(p.strip()) for p in pieces] + ([2] if finish == "stop" else [])
    return "".join(pieces), finish, out_ids


def prompt_of(prompt: Any, tok) -> tuple[str, list[int]]:
    """`(text, token ids)` of a completions `prompt`: a string (tokenized with special tokens, as
    vLLM/SGLang do) or a list of token ids (decoded verbatim), with tokenizer `tok` (None: fake ids
    for a string, the ids themselves as text). Raises ValueError on anything else."""
    if isinstance(prompt, str):
        if tok is not None:
            return prompt, list(tok(prompt, add_special_tokens=True)["input_ids"])
        return prompt, [fake_id(w) for w in prompt.split()]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if tok is not None:
            return tok.decode(prompt, skip_special_tokens=False), list(prompt)
        return " ".join(str(t) for t in prompt), list(prompt)
    raise ValueError("`prompt` must be a string or a non-empty list of token ids (one prompt per request)")
