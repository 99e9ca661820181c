"""String level of the tokens stage: supervised character spans from render differences (the method:
docs/DESIGN.md §5; `tokens.shard` turns the spans into token masks). No numpy or pyarrow,
so the completions job can run `check_template` before generating.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from dflash_pipeline.core.errors import ConfigError, MarkupWithoutIdsError, TokenizationError
from dflash_pipeline.target import chat

# --- String level: supervised character spans from render differences


@dataclass
class TrainSequence:
    """One training sequence before tokenization.

    Attributes:
        text: the rendered string (a prefix-closed render of the conversation up to its last turn).
        spans: supervised character spans `[(start, end), ...]`, sorted, non-overlapping.
        turns: assistant-turn indices (0-based among assistant turns) supervised in this sequence.
    """

    text: str
    spans: list[tuple[int, int]] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    #: `[(start, end, ids), ...]` sorted, non-overlapping, each inside a span: text the target generated
    #: that the tokens stage must not re-tokenize like template text. `ids` = the target's output ids of
    #: exactly `text[start:end]`; None = encode that text as ordinary text (special-token strings in it
    #: stay plain characters, `tokens.loss_masks.tokenize_sequences`).
    verbatim: list[tuple[int, int, tuple[int, ...] | None]] = field(default_factory=list)


def special_token_strings(tokenizer) -> tuple[str, ...]:
    """Contents of the tokenizer's *special* added tokens (end-of-turn candidates), longest first."""
    out = set()
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(tok, "special", False) and tok.content:
            out.add(str(tok.content))
    for name in ("eos_token", "bos_token", "pad_token"):
        val = getattr(tokenizer, name, None)
        if isinstance(val, str) and val:
            out.add(val)
    return tuple(sorted(out, key=lambda s: (-len(s), s)))


#: A non-special added token is control text too when it looks like markup (`<think>`, `<tool_call>`,
#: `[TOOL_CALLS]`); added tokens that are words or whitespace runs are ordinary text.
_MARKUP_TOKEN = re.compile(r"^[<\[].*[>\]]$", re.S)


def control_token_strings(tokenizer) -> tuple[str, ...]:
    """Strings the tokenizer turns into a control id when it meets them in text, longest first: every
    *special* added token (plus eos/bos/pad) and every non-special added token that looks like markup
    (`<think>`, `</think>`, `<tool_call>`; no whitespace inside). Text the target generated or a user
    wrote that contains one of them is data, never control: the tokens stage encodes such answer text
    without parsing them, the prompts stage counts and drops prompts whose user/system text holds one."""
    out = set(special_token_strings(tokenizer))
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        c = str(getattr(tok, "content", "") or "")
        if c and not any(ch.isspace() for ch in c) and _MARKUP_TOKEN.match(c):
            out.add(c)
    return tuple(sorted(out, key=lambda s: (-len(s), s)))


def find_control_strings(text: str, strings: Sequence[str]) -> list[str]:
    """The control-token strings (`control_token_strings`) that occur in `text`, in `strings`
    order."""
    return [s for s in strings if s in text] if text else []


def supervised_length(suffix: str, specials: Sequence[str], *, include_eot: bool = True) -> int:
    """Length of the supervised head of `suffix` (= render after the generation prompt).

    Trailing whitespace is template scaffolding; if what remains ends with a run of special tokens
    (optionally separated by whitespace), only the first of that run is kept: it is the stop token the
    target emitted, later ones are template text (e.g. a trailing `<|endoftext|>`). With
    `include_eot=False` (generation cut at max_tokens: the target never emitted a stop token) the whole
    run is excluded.
    """
    end = len(suffix.rstrip())
    first_special_end = None
    while end > 0:
        hit = next((s for s in specials if suffix.endswith(s, 0, end)), None)
        if hit is None:
            break
        first_special_end = end
        end = len(suffix[: end - len(hit)].rstrip())
    if first_special_end is None or not include_eot:
        return end
    return first_special_end


#: Completion messages -> template messages (one definition, shared with generation: chat.py).
render_messages = chat.template_messages


def conversation_sequences(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    thinking: str,
    last_turn_only: bool = False,
    prompt_id: str = "?",
    specials: Sequence[str] | None = None,
    finish_reasons: Sequence[str | None] | None = None,
    generated: Sequence[str | None] | None = None,
    counts: dict | None = None,
    generated_ids: Sequence[Sequence[int] | None] | None = None,
    control_strings: Sequence[str] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[TrainSequence]:
    """Training sequences and supervised character spans for one conversation (docs/DESIGN.md §5).

    Args:
        tokenizer: HF tokenizer carrying the target's chat template.
        messages: the completed conversation (`role`, `content`, optional `reasoning_content`).
        thinking: `none|save|disable`, the mode used for generation.
        last_turn_only: supervise only the last assistant turn.
        prompt_id: used in error messages.
        specials: special-token strings (default: `special_token_strings`).
        finish_reasons: per assistant turn; a `"length"` turn gets no supervised end-of-turn token.
        generated: per assistant turn, the decoded `output_token_ids` (None when unknown); template text
            before it in the rendered turn (Qwen3's empty think block) is scaffolding: 0.
        counts: optional dict; increments `scaffolding_excluded`, `render_differs_from_output_ids`,
            `output_ids_spliced` and `control_text_kept`.
        generated_ids: per assistant turn, the target's `output_token_ids`; spliced in as the supervised
            tokens when their text is exactly the turn's supervised text.
        control_strings: strings that tokenize to control ids (default: `control_token_strings`).
        tools: the function schemas (the template's `tools`); `tool` results are never supervised.

    Returns:
        Sequences in turn order (empty if there is no assistant turn).

    Raises:
        TokenizationError: the generation-prompt render is not a prefix of the render with the turn, or
            the template drops the turn's content or reasoning (names prompt_id and turn);
            `MarkupWithoutIdsError`: control strings in a turn without ids to tell text from markup."""
    specials = special_token_strings(tokenizer) if specials is None else specials
    controls = control_token_strings(tokenizer) if control_strings is None else control_strings
    msgs = render_messages(messages)
    a_idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if not a_idx:
        return []
    selected = list(range(len(a_idx)))[-1:] if last_turn_only else list(range(len(a_idx)))
    prompts, renders = _render_turns(
        tokenizer, msgs, a_idx, selected, thinking=thinking, prompt_id=prompt_id, tools=tools
    )
    shared = {"thinking": thinking, "prompt_id": prompt_id, "specials": specials, "controls": controls}
    shared.update(counts=counts, control_ids=_control_ids(tokenizer, controls))
    turn_spans = {
        k: _turn_span(
            p,
            q,
            msgs[a_idx[k]],
            k,
            cut=_at(finish_reasons, k) == "length",
            generated=_at(generated, k),
            generated_ids=_at(generated_ids, k),
            **shared,
        )
        for k, p, q in zip(selected, prompts, renders)
    }
    return _fewest_sequences(turn_spans)


def _control_ids(tokenizer, controls: Sequence[str]) -> dict[int, str]:
    """Token id -> control string, for the control strings the model could emit mid-answer as one token: those that
    are one token of `tokenizer`, less its `eos_token`."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    eos = getattr(tokenizer, "eos_token", None)
    return {vocab[s]: s for s in controls if s in vocab and s != eos}


def _at(per_turn: Sequence | None, k: int):
    """`per_turn[k]`, or None when the list is None or shorter."""
    return per_turn[k] if per_turn is not None and k < len(per_turn) else None


def _count(counts: dict | None, key: str) -> None:
    """Increment `counts[key]` (from 0) when a counts dict is given."""
    if counts is not None:
        counts[key] = counts.get(key, 0) + 1


def _render_turns(
    tokenizer,
    msgs: list[dict],
    a_idx: list[int],
    selected: list[int],
    *,
    thinking: str,
    prompt_id: str,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[list[str], list[str]]:
    """Per selected assistant turn `k` (message `a_idx[k]`): the generation-prompt render `P` of the
    messages before it and the render `Q` with it (both batched, `chat.render_many`).

    Raises:
        TokenizationError: the template fails on one of them;
            the message names prompt_id and the first turn that fails, rendered alone.
    """
    try:
        ps = chat.render_many(
            tokenizer, [msgs[: a_idx[k]] for k in selected], thinking=thinking, add_generation_prompt=True, tools=tools
        )
        qs = chat.render_many(
            tokenizer,
            [msgs[: a_idx[k] + 1] for k in selected],
            thinking=thinking,
            add_generation_prompt=False,
            tools=tools,
        )
    except Exception:  # jinja raise_exception, missing keys, ...: find the turn that fails, for the message
        for k in selected:
            for sub, gen in ((msgs[: a_idx[k]], True), (msgs[: a_idx[k] + 1], False)):
                try:
                    chat.render(tokenizer, sub, thinking=thinking, add_generation_prompt=gen, tools=tools)
                except Exception as exc:
                    raise TokenizationError(
                        f"prompt_id={prompt_id} turn={k}: chat template failed to render: {exc}"
                    ) from exc
        raise
    return ps, qs


def _turn_span(
    p: str,
    q: str,
    message: Mapping[str, Any],
    k: int,
    *,
    thinking: str,
    prompt_id: str,
    specials: Sequence[str],
    controls: Sequence[str],
    cut: bool,
    generated: str | None,
    generated_ids: Sequence[int] | None,
    counts: dict | None,
    control_ids: Mapping[int, str] | None = None,
) -> tuple[str, int, int, list]:
    """`(Q, span_start, span_end, verbatim)` of assistant turn `k` from its generation-prompt render `p`
    and its render `q` (steps 1-2 and 5 of docs/DESIGN.md §5); `message` is the
    turn as the template saw it, `cut`: generation stopped at max_tokens (no end-of-turn supervised).

    Raises:
        TokenizationError: `q` does not start with `p`, or the supervised text lacks the turn's content
            or reasoning.
    """
    _check_prefix(p, q, prompt_id=prompt_id, k=k)
    suffix = q[len(p) :]
    sup = supervised_length(suffix, specials, include_eot=not cut)
    text = suffix[:sup]
    content = message["content"].strip()
    rc = message.get("reasoning_content")
    _check_rendered(text, content, rc, prompt_id=prompt_id, k=k, thinking=thinking)
    start = len(p)
    if generated is not None:
        start += _scaffolding_length(text, generated, specials, counts)
    end = len(p) + sup
    verbatim = _verbatim_ranges(
        q,
        start,
        end,
        content=content,
        reasoning=rc,
        generated=generated,
        generated_ids=generated_ids,
        controls=controls,
        counts=counts,
    )
    if any(ids is None for _, _, ids in verbatim):
        _check_markup_was_text(message, generated_ids, controls, control_ids or {}, prompt_id=prompt_id, k=k)
    return q, start, end, verbatim


def _check_markup_was_text(
    message: Mapping[str, Any],
    generated_ids: Sequence[int] | None,
    controls: Sequence[str],
    control_ids: Mapping[int, str],
    *,
    prompt_id: str,
    k: int,
) -> None:
    """Turn `k`'s content or reasoning holds control-token strings that will be encoded as text: allowed
    only when its output ids show the model wrote them as text (none of their ids among the output ids).

    Raises:
        MarkupWithoutIdsError: no output ids (emitted markup and quoted text look alike), or the output ids
            hold the string's control id.
    """
    emittable = set(control_ids.values())
    text = (message.get("content") or "") + "\n" + (message.get("reasoning_content") or "")
    found = [c for c in find_control_strings(text, controls) if c in emittable]
    if not found:
        return
    if not generated_ids:
        raise MarkupWithoutIdsError(
            f"prompt_id={prompt_id} turn={k}: the answer holds {found[:4]} and the record has no output token "
            f"ids, so whether the model emitted them as markup tokens or wrote them as text cannot be told; "
            f"generate with token ids (vLLM/SGLang: generation.extra_body return_token_ids: true; the "
            f"transformers backend always records them) or drop the record (tokens.strict: false)"
        )
    emitted = sorted({control_ids[t] for t in generated_ids if t in control_ids and control_ids[t] in found})
    if emitted:
        raise MarkupWithoutIdsError(
            f"prompt_id={prompt_id} turn={k}: the model emitted {emitted} as markup tokens (its output ids say "
            f"so) but the template's render of the turn differs from its output; train from the server ids "
            f"(tokens.use_server_token_ids: true)"
        )


def _check_prefix(p: str, q: str, *, prompt_id: str, k: int) -> None:
    """Fail closed when the render with turn `k` does not start with its generation-prompt render.

    Raises:
        TokenizationError: names prompt_id, the turn and the first differing character.
    """
    if not q.startswith(p):
        n = next((j for j, (a, b) in enumerate(zip(p, q)) if a != b), min(len(p), len(q)))
        raise TokenizationError(
            f"prompt_id={prompt_id} turn={k}: the render with the assistant turn does not start with the "
            f"generation-prompt render (they differ at char {n}: prompt {p[n : n + 40]!r} vs "
            f"conversation {q[n : n + 40]!r}); the template rewrites the turn it generates, so the loss "
            f"mask cannot be derived exactly. Use a training variant of the template "
            f"(`target.chat_template`) or server token ids."
        )


def _check_rendered(text: str, content: str, reasoning: str | None, *, prompt_id: str, k: int, thinking: str) -> None:
    """Fail closed when the supervised `text` of turn `k` lacks its (stripped) content or reasoning.

    Raises:
        TokenizationError: the template drops or rewrites what the target generated (names prompt_id, turn).
    """
    if content and content not in text:
        raise TokenizationError(
            f"prompt_id={prompt_id} turn={k}: the template does not render the assistant content "
            f"verbatim after the generation prompt (rendered {text[:80]!r}); cannot mask it exactly"
        )
    if reasoning and reasoning.strip() not in text:
        raise TokenizationError(
            f"prompt_id={prompt_id} turn={k}: the template drops this turn's reasoning_content, which the "
            f"target generated (thinking={thinking!r}); use a template that renders it or thinking=disable"
        )


def _scaffolding_length(text: str, generated: str, specials: Sequence[str], counts: dict | None) -> int:
    """Characters at the head of the supervised `text` that the template wrote before everything the
    target `generated` (Qwen3's empty think block): 0 unless `text` ends with the generated text (end of
    turn and whitespace aside) after non-whitespace template text. Counts `scaffolding_excluded`, or
    `render_differs_from_output_ids` when the render does not end with the generated text."""
    core = generated[: supervised_length(generated, specials, include_eot=False)].strip()
    body = text[: supervised_length(text, specials, include_eot=False)]
    if core and body.endswith(core):
        lead = body[: len(body) - len(core)]
        if lead.strip():  # template text before everything the target generated
            g_ws = generated[: len(generated) - len(generated.lstrip())]  # whitespace the target did generate first
            _count(counts, "scaffolding_excluded")
            return len(lead) - (len(g_ws) if g_ws and lead.endswith(g_ws) else 0)
    elif core:
        _count(counts, "render_differs_from_output_ids")
    return 0


def _verbatim_ranges(
    q: str,
    start: int,
    end: int,
    *,
    content: str,
    reasoning: str | None,
    generated: str | None,
    generated_ids: Sequence[int] | None,
    controls: Sequence[str],
    counts: dict | None,
) -> list:
    """`TrainSequence.verbatim` entries of one turn supervised on `q[start:end]`: the target's output ids when their
    text is exactly that span (`output_ids_spliced`); else the content and the reasoning before it, each when it holds a
    control-token string, to be encoded as plain text (`control_text_kept`)."""
    verbatim: list = []
    if generated_ids and generated is not None and q[start:end] == generated:
        verbatim.append((start, end, tuple(int(t) for t in generated_ids)))
        _count(counts, "output_ids_spliced")
        return verbatim
    hi = end
    for piece in (content, (reasoning or "").strip()):
        pos = q.rfind(piece, start, hi) if piece else -1
        if pos < 0:
            continue
        if find_control_strings(piece, controls):
            verbatim.append((pos, pos + len(piece), None))
        hi = pos
    verbatim.sort()
    if verbatim:
        _count(counts, "control_text_kept")
    return verbatim


def _fewest_sequences(turn_spans: dict[int, tuple[str, int, int, list]]) -> list[TrainSequence]:
    """The fewest sequences that supervise each turn once, in a context it was generated in (step 3 of
    docs/DESIGN.md §5): greedy from the last pending turn `j`, whose render `Q_j`
    supervises every pending turn `k` with `Q_j.startswith(Q_k[:end_k])`. Returned in turn order."""
    pending = sorted(turn_spans)
    seqs: list[TrainSequence] = []
    while pending:
        j = pending[-1]
        q_j = turn_spans[j][0]
        seq = TrainSequence(text=q_j)
        keep = []
        for k in pending:
            q_k, s, e, verbatim = turn_spans[k]
            if k == j or q_j.startswith(q_k[:e]):
                seq.spans.append((s, e))
                seq.turns.append(k)
                seq.verbatim.extend(verbatim)
            else:
                keep.append(k)
        pending = keep
        seqs.append(seq)
    seqs.reverse()
    return seqs


#: Synthetic conversation for `check_template` (system, two user turns, two assistant turns).
_CHECK_TURNS = [
    ("What is 6 times 7?", "Let me think: 6 * 7 = 42.", "The answer is 42."),
    ("And in words?", "Spell it out.", "Forty-two."),
]


def check_template(tokenizer, thinking: str, *, template_name: str = "the target's chat template") -> list[str]:
    """Check, before anything is generated, that the tokens stage can mask conversations of this template
    in this thinking mode (single- and multi-turn, reasoning for `save`; a rejected system turn only warns).

    Returns:
        Warnings, e.g. a rendered assistant turn that does not end with a special token (the drafter would
        never learn the stop).

    Raises:
        ConfigError: the render path cannot derive exact masks (names `target.chat_template`,
            `generation.thinking` and `tokens.use_server_token_ids`)."""
    specials = special_token_strings(tokenizer)
    warnings: list[str] = []
    # (label, system turn, user turns); a template that rejects system turns (gemma-2) only warns
    for label, system, n in (("single-turn", False, 1), ("multi-turn", False, 2), ("system-turn", True, 1)):
        msgs: list[dict] = [{"role": "system", "content": "You are terse."}] if system else []
        for user, reasoning, answer in _CHECK_TURNS[:n]:
            msgs.append({"role": "user", "content": user})
            msgs.append(
                {"role": "assistant", "content": answer, "reasoning_content": reasoning if thinking == "save" else None}
            )
        try:
            seqs = conversation_sequences(tokenizer, msgs, thinking=thinking, prompt_id="(check)", specials=specials)
        except TokenizationError as exc:
            if system:
                warnings.append(
                    f"{template_name}: a conversation with a system turn cannot be masked ({exc}); "
                    f"prompts with a system message will fail in the tokens stage"
                )
                continue
            raise ConfigError(
                f"{template_name} with generation.thinking={thinking!r}: the tokens stage cannot derive exact "
                f"loss masks ({label} check: {exc}). Nothing was generated. Use "
                f"a training variant of the template (`target.chat_template`), another `generation.thinking`, "
                f"or `tokens.use_server_token_ids: true` with a server that returns token ids (vLLM, SGLang >= v0.5.18: "
                f"`generation.extra_body: {{return_token_ids: true}}`)"
            ) from None
        if label == "single-turn":
            (seq,) = seqs
            s, e = seq.spans[-1]
            if not any(seq.text.endswith(t, s, e) for t in specials):
                warnings.append(
                    f"{template_name}: a rendered assistant turn ends with {seq.text[max(s, e - 20) : e]!r}, not with "
                    f"a special token of this tokenizer, so no end-of-turn token is supervised (is "
                    f"`target.chat_template` meant for this tokenizer?)"
                )
    return warnings
