"""The transformers backend (`generation.backend: transformers`): the target generates in-process.

Histories are rendered with `chat.render`, sorted by prompt length into left-padded batches of
`generation.batch_size`, decoded greedily at `temperature == 0`, else sampled (seeded per batch).
Multi-turn prompts go round by round. The target comes from `target.loading.load_target`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from dflash_pipeline.core.contracts import has_tools
from dflash_pipeline.core.errors import ConfigError
from dflash_pipeline.target.chat import load_tokenizer, render

from .records import (
    DISABLE_HINT_LOCAL,
    TOOLS_NEED_CHAT,
    Dialogue,
    OnDone,
    RowError,
    RunInfo,
    Turn,
    build_record,
    check_thinking,
    cut_at_eos,
    skipped_record,
    take_reasoning,
)


@dataclass
class _Conversation:
    """One prompt being answered turn by turn (`Dialogue`) and the token ids of its next request."""

    prompt: dict
    walk: Dialogue = field(init=False)
    ids: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.walk = Dialogue(self.prompt)

    @property
    def turns(self) -> list:
        return self.walk.turns

    @property
    def history(self) -> list:
        return self.walk.history

    def advance(self) -> bool:
        """Add messages up to the next user turn; False when no user turn is left."""
        return self.walk.advance()


class TransformersBackend:
    """In-process batched generation with the target (`generation.backend: transformers`).

    Args:
        target_dir: target directory (config, weights, tokenizer).
        gen_cfg: validated `config["generation"]`.
        chat_template: optional .jinja overriding the tokenizer's template.
        trust_remote_code: allow the target's own code.
        dtype: `auto` (float32 on CPU, bfloat16 on CUDA), `float32`, `bfloat16` or `float16`.
    """

    def __init__(self, target_dir, gen_cfg: dict, *, chat_template=None, trust_remote_code=False, dtype="auto"):
        import torch

        from dflash_pipeline.target.loading import load_target

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
        # a turn whose prompt + generation.max_tokens exceeds this is skipped, never sent to generate()
        text_cfg = self.lm.config.get_text_config() if hasattr(self.lm.config, "get_text_config") else self.lm.config
        self.context_limit = getattr(text_cfg, "max_position_embeddings", None)
        # a template that opens <think> in its generation prompt (DeepSeek-R1, Qwen3 thinking-2507) makes the
        # output start inside the reasoning
        probe = render(
            self.tok, [{"role": "user", "content": "x"}], thinking=gen_cfg["thinking"], add_generation_prompt=True
        )
        self._opens_think = probe.rstrip().endswith("<think>")

    def _generate(self, prompts_ids: list[list[int]]) -> tuple[list[list[int]], float]:
        torch, cfg = self.torch, self.cfg
        width = max(len(p) for p in prompts_ids)
        ids = torch.full((len(prompts_ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts_ids):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        kw: dict[str, Any] = dict(max_new_tokens=cfg["max_tokens"], eos_token_id=self.eos_ids, pad_token_id=self.pad_id)
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
        reasoning, content = take_reasoning(
            self.tok.decode(body, skip_special_tokens=True), self.cfg["thinking"], opened=self._opens_think
        )
        reasoning = check_thinking(
            self.cfg["thinking"], reasoning, require_reasoning=False, disable_hint=DISABLE_HINT_LOCAL
        )
        return Turn(
            content=content,
            reasoning_content=reasoning,
            finish_reason="stop" if stop else "length",
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(new),
            prompt_token_ids=list(prompt_ids),
            output_token_ids=list(new),
            latency_s=round(latency, 6),
            endpoint="transformers",
        )

    def resolve_model(self) -> str:
        """The target directory's name (recorded as `model`)."""
        return self.model

    def _prepare(self, c: _Conversation) -> None:
        """Render `c`'s history (generation prompt added) into the token ids of its next request."""
        c.ids = render(self.tok, c.history, thinking=self.cfg["thinking"], add_generation_prompt=True, tokenize=True)

    def _round(self, active: list[_Conversation], on_done: OnDone, info: RunInfo) -> list[_Conversation]:
        """Answer the next user turn of every conversation in `active` (batches of `batch_size`, longest first);
        finished or failed conversations go to `on_done`. Returns those with a user turn left."""
        bs = self.cfg["batch_size"]
        limit = self.context_limit
        if limit:  # a later turn can outgrow the context (earlier answers): skip that conversation
            fits = []
            for c in active:
                if len(c.ids) + self.cfg["max_tokens"] > limit:
                    on_done(
                        skipped_record(
                            c.prompt,
                            "too_long",
                            turn=len(c.turns),
                            prompt_tokens=len(c.ids),
                            max_tokens=self.cfg["max_tokens"],
                            max_position_embeddings=limit,
                        )
                    )
                else:
                    fits.append(c)
            active = fits
        active.sort(key=lambda c: -len(c.ids))
        still: list[_Conversation] = []
        for b in range(0, len(active), bs):
            batch = active[b : b + bs]
            outs, dt = self._generate([c.ids for c in batch])
            self._requests += len(batch)
            for c, new in zip(batch, outs):
                try:
                    turn = self._turn(c.ids, new, dt)
                except RowError as exc:
                    on_done(build_record(c.prompt, c.turns, info, error=f"turn {len(c.turns) + 1}: {exc}"))
                    continue
                c.walk.add(turn)
                if c.advance():
                    self._prepare(c)
                    still.append(c)
                else:
                    on_done(build_record(c.prompt, c.turns, info))
        return still

    def run(self, prompts: Sequence[dict], on_done: OnDone, info: RunInfo) -> dict:
        """Generate every prompt in chunks of `4 * batch_size` conversations (each chunk round by round
        until its conversations are done). Returns `{requests, attempts, retries}` (no retries here).

        Raises:
            ConfigError: a prompt has tool calls (their parsing needs a server's tool-call parser).
        """
        if any(has_tools(p) for p in prompts):
            raise ConfigError(f"generation.backend: transformers: {TOOLS_NEED_CHAT}")
        convs = [_Conversation(p) for p in prompts]
        for c in convs:
            c.advance()
            self._prepare(c)
        # Longest first: similar lengths share a batch, and an out-of-memory shows up in the first batch.
        convs.sort(key=lambda c: -len(c.ids))
        chunk = self.cfg["batch_size"] * 4
        self._requests = 0
        for start in range(0, len(convs), chunk):
            active = convs[start : start + chunk]
            while active:
                active = self._round(active, on_done, info)
        return {"requests": self._requests, "attempts": self._requests, "retries": 0}
