"""Loss-mask invariant over every real chat template (DESIGN.md, Token record).

For each template in ``<shared>/data/models/*/chat_template*.jinja`` and ``_trl_training_templates/``,
with a tiny ByteLevel BPE tokenizer carrying that template and its special tokens, for single- and
multi-turn conversations and thinking off (``disable``) / on (``save``, reasoning present):
decoding the masked tokens of each assistant turn gives back exactly that turn's generated text plus its
end-of-turn marker - or, for the combinations listed in ``EXPECTED_FAILURES``, tokenization fails closed
with ``TokenizationError`` (asserted, never skipped).

"Generated text" for a turn = what follows the template's generation prompt: for thinking off, the
content (the empty think block of Qwen3/Qwen3.5 sits in the generation prompt and must be 0); for
thinking on, the reasoning and content with the template's own think markers between them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from dflash_pipeline.core.errors import MarkupWithoutIdsError, TokenizationError
from dflash_pipeline.target import chat
from dflash_pipeline.tokens.shard import conversation_sequences, plain_text_tokenizer, tokenize_sequences

_REPO = Path(__file__).resolve().parents[3]
# same resolution order as conftest.models_dir(): $DFLASH_MODELS_DIR, tests/data/models, ../shared/data/models
MODELS_DIR = next(
    (
        Path(c)
        for c in (
            os.environ.get("DFLASH_MODELS_DIR"),
            _REPO / "tests" / "data" / "models",
            _REPO.parent / "shared" / "data" / "models",
        )
        if c and Path(c).is_dir()
    ),
    None,
)
if MODELS_DIR is None:
    pytest.skip("no chat templates found: set DFLASH_MODELS_DIR or add tests/data/models", allow_module_level=True)


def _template_files() -> list[Path]:
    files = sorted(MODELS_DIR.glob("*/chat_template*.jinja"))
    files += sorted((MODELS_DIR / "_trl_training_templates").glob("*.jinja"))
    return files


TEMPLATES = {f"{p.parent.name}/{p.name}": p for p in _template_files()}

# Template name (substring of "<dir>/<file>") -> (bos, eos, extra special tokens, end-of-turn markers).
# <|...|> and <｜...｜> tokens are found in the template text itself.
FAMILIES = [
    ("deepseek", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", [], ["<｜end▁of▁sentence｜>"]),
    ("DeepSeek", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", [], ["<｜end▁of▁sentence｜>"]),
    ("GLM", None, "<|endoftext|>", ["[gMASK]", "<sop>"], []),
    # the TRL variant ends an assistant turn with the stop token GLM emits (<|user|>); the original
    # template writes no end-of-turn marker at all (the next turn's <|user|> is prompt scaffolding)
    ("glm4moe", None, "<|endoftext|>", ["[gMASK]", "<sop>"], ["<|user|>"]),
    ("Kimi", None, "<|im_end|>", [], ["<|im_end|>"]),
    ("lama", "<|begin_of_text|>", "<|eot_id|>", [], ["<|eot_id|>"]),
    ("MiniMax", None, "[e~[", ["]~!b[", "]~b]", "[e~["], ["[e~["]),
    ("Mistral", "<s>", "</s>", ["[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"], ["</s>"]),
    ("gemma", "<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"], ["<end_of_turn>"]),
    ("gpt", "<|startoftext|>", "<|return|>", [], ["<|return|>", "<|end|>"]),
    ("wen", None, "<|im_end|>", [], ["<|im_end|>"]),
]

# family key -> (think open, think close) as the template writes them (default <think> ... </think>)
THINK_MARKERS = {"gpt": ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant")}

# (template, mode) -> why tokenization must fail closed. mode: "disable" | "save" | "*" (both).
NO_REASONING = "template has no reasoning field: reasoning the target generated would be dropped"
EXPECTED_FAILURES: dict[tuple[str, str], str] = {
    ("DeepSeek-R1/chat_template.current.jinja", "*"): (
        "generation prompt ends with '<think>\\n' but rendered assistant turns drop it and all reasoning: "
        "renders never share the prefix; needs server token ids"
    ),
    ("_trl_training_templates/deepseekv3_training.jinja", "*"): (
        "the R1-style template with generation tags: same '<think>\\n' generation prompt as DeepSeek-R1"
    ),
    ("DeepSeek-V3.1/chat_template.jinja", "save"): (
        "thinking is selected by the `thinking` kwarg (chat.py passes it with enable_thinking) and assistant "
        "turns never render reasoning (the template writes '</think>' + content): reasoning would be dropped"
    ),
    ("Kimi-K2-Thinking/chat_template.jinja", "save"): (
        "the turn being trained is rendered as history with an empty '<think></think>': reasoning dropped"
    ),
    ("MiniMax-M2/chat_template.jinja", "disable"): (
        "always-thinking model: the generation prompt opens '<think>\\n', a turn without reasoning renders without it"
    ),
}
for _name in (
    "Kimi-K2-Instruct/chat_template.jinja",
    "Llama-3.1-8B-Instruct/chat_template.jinja",
    "Llama-3.3-70B-Instruct/chat_template.jinja",
    "Mistral-Small-3.1-24B-Instruct-2503/chat_template.jinja",
    "Qwen2.5-7B-Instruct/chat_template.jinja",
    "Qwen2.5-VL-3B-Instruct/chat_template.jinja",
    "Qwen3-VL-2B-Instruct/chat_template.jinja",
    "gemma-3-4b-it/chat_template.jinja",
    "_trl_training_templates/gemma3_training.jinja",
    "_trl_training_templates/llama3_training.jinja",
    "_trl_training_templates/qwen2_5_training.jinja",
    "_trl_training_templates/qwen2_5_vl_training.jinja",
    "_trl_training_templates/qwen3_instruct_2507_training.jinja",
    "_trl_training_templates/qwen3_vl_training.jinja",
):
    EXPECTED_FAILURES[(_name, "save")] = NO_REASONING


def _expected_failure(name: str, mode: str) -> str | None:
    return EXPECTED_FAILURES.get((name, mode)) or EXPECTED_FAILURES.get((name, "*"))


def _family(name: str):
    for key, bos, eos, extra, eot in FAMILIES:
        if key in name:
            return bos, eos, extra, eot, key
    raise AssertionError(f"no tokenizer family for template {name}; add it to FAMILIES")


CORPUS = [
    "The answer is 42. Let me think step by step about numbers and words.",
    "Hello there! How are you today? I am fine, thank you very much.",
    "def f(x):\n    return x * 2\n\nprint(f(21))",
    "Ünïcode ✓ text, emojis 🙂 and numbers 12345 67890.",
] * 20


@pytest.fixture(scope="session")
def base_bpe_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    return tok.to_str()


_TOK_CACHE: dict[str, object] = {}


def make_tokenizer(base_json: str, name: str):
    """Tiny tokenizer with ``name``'s template, its special tokens (special) and think markers (plain)."""
    if name in _TOK_CACHE:
        return _TOK_CACHE[name]
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    text = TEMPLATES[name].read_text(encoding="utf-8")
    bos, eos, extra, _, _ = _family(name)
    specials = set(re.findall(r"<\|[A-Za-z0-9_]+\|>", text)) | set(re.findall(r"<｜[^｜<>]+｜>", text))
    specials |= set(extra) | {t for t in (bos, eos) if t}
    tok = Tokenizer.from_str(base_json)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in sorted(specials)])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in ("<think>", "</think>")])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token=None)
    hf.chat_template = text
    _TOK_CACHE[name] = hf
    return hf


REASONING = ["Let me think: 6 * 7 = 42.\nYes.", "Second thought, ✓ quick."]
CONTENT = ["The answer is 42.\nDone!", "Ünïcode ✓ and `code` 🙂 fine."]


def conversation(multi: bool, thinking: str) -> list[dict]:
    def asst(k):
        return {
            "role": "assistant",
            "content": CONTENT[k],
            "reasoning_content": REASONING[k] if thinking == "save" else None,
        }

    msgs = [{"role": "user", "content": "What is 6 times 7?"}, asst(0)]
    if multi:
        msgs = [{"role": "system", "content": "You are terse."}] + msgs
        msgs += [{"role": "user", "content": "And in words?"}, asst(1)]
    return msgs


def masked_runs(ids: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    runs, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def check_turn_text(decoded: str, k: int, thinking: str, eots: list[str], prompt: str, family: str = "") -> None:
    body = decoded
    if eots:
        hit = [e for e in eots if decoded.endswith(e)]
        assert hit, f"turn {k}: masked text {decoded!r} does not end with an end-of-turn marker {eots}"
        body = decoded[: -len(hit[0])]
    if prompt.rstrip().endswith("</think>"):  # template put the (empty) think block in the prompt
        assert body.strip() == CONTENT[k], f"turn {k}: think scaffolding must be 0: {decoded!r}"
    b = body.strip()
    think_open, think_close = THINK_MARKERS.get(family, ("<think>", "</think>"))
    if b.startswith(think_open):
        b = b[len(think_open) :]
    if think_close in b:
        r, _, c = b.partition(think_close)
        assert r.strip() == (REASONING[k] if thinking == "save" else ""), f"turn {k}: reasoning {r!r}"
        b = c.strip()
    else:
        assert thinking != "save", f"turn {k}: reasoning not supervised: {decoded!r}"
    # gpt-oss writes the channel header after the generation prompt: the target generates it
    for head in ("<|channel|>final<|message|>",):
        if b.startswith(head):
            b = b[len(head) :]
    assert b == CONTENT[k], f"turn {k}: masked text {decoded!r} != content {CONTENT[k]!r}"


CASES = [(name, multi, mode) for name in TEMPLATES for multi in (False, True) for mode in ("disable", "save")]


def test_templates_found():
    assert len(TEMPLATES) >= 25, f"expected the shared chat templates under {MODELS_DIR}"


@pytest.mark.parametrize("name,multi,mode", CASES, ids=[f"{n}-{'multi' if m else 'single'}-{t}" for n, m, t in CASES])
def test_mask_invariant(base_bpe_json, name, multi, mode):
    tok = make_tokenizer(base_bpe_json, name)
    _, _, _, eots, family = _family(name)
    msgs = conversation(multi, mode)
    reason = _expected_failure(name, mode)
    if reason is not None:
        with pytest.raises(TokenizationError, match=r"prompt_id=p1 turn="):
            conversation_sequences(tok, msgs, thinking=mode, prompt_id="p1")
        return
    seqs = conversation_sequences(tok, msgs, thinking=mode, prompt_id="p1")
    a_idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    assert sorted(k for s in seqs for k in s.turns) == list(range(len(a_idx)))  # each turn exactly once
    for seq, (ids, mask, _straddling) in zip(seqs, tokenize_sequences(tok, seqs)):
        assert ids.dtype == np.int32 and mask.dtype == np.uint8
        runs = masked_runs(ids, mask)
        assert len(runs) == len(seq.turns), (name, seq.text, runs)
        for k, run in zip(seq.turns, runs):
            decoded = tok.decode(run, skip_special_tokens=False)
            prompt = chat.render(tok, msgs[: a_idx[k]], thinking=mode, add_generation_prompt=True)
            check_turn_text(decoded, k, mode, eots, prompt, family)
            # the sequence text up to the turn is exactly its generation-time render
            assert seq.text.startswith(prompt)


def test_expected_failures_are_real_templates():
    for name, _mode in EXPECTED_FAILURES:
        assert name in TEMPLATES, f"EXPECTED_FAILURES names a template that does not exist: {name}"


RENDER_CASES = [
    (name, multi, mode) for name in TEMPLATES for multi in (False, True) for mode in ("none", "disable", "save")
]


@pytest.mark.parametrize(
    "name,multi,mode", RENDER_CASES, ids=[f"{n}-{'multi' if m else 'single'}-{t}" for n, m, t in RENDER_CASES]
)
def test_fast_render_equals_apply_chat_template(base_bpe_json, name, multi, mode):
    """chat.render_many (the compiled template called directly) renders exactly what
    apply_chat_template(tokenize=False) renders, for every prefix the tokens stage renders."""
    tok = make_tokenizer(base_bpe_json, name)
    msgs = conversation(multi, "save" if mode == "save" else "disable")
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        for sub, gen in ((msgs[:i], True), (msgs[: i + 1], False)):
            want = tok.apply_chat_template(
                chat.template_messages(sub), tokenize=False, add_generation_prompt=gen, **chat.template_kwargs(mode)
            )
            assert chat.render_many(tok, [sub], thinking=mode, add_generation_prompt=gen) == [want]


def test_thinking_kwargs_reach_deepseek_v31(base_bpe_json):
    """DeepSeek-V3.1 selects thinking with the `thinking` kwarg: save opens '<think>', disable closes it."""
    name = "DeepSeek-V3.1/chat_template.jinja"
    tok = make_tokenizer(base_bpe_json, name)
    msgs = [{"role": "user", "content": "hi"}]
    assert chat.render(tok, msgs, thinking="save", add_generation_prompt=True).endswith("<｜Assistant｜><think>")
    assert chat.render(tok, msgs, thinking="disable", add_generation_prompt=True).endswith("<｜Assistant｜></think>")


def test_gpt_oss_reads_reasoning_as_thinking(base_bpe_json):
    name = next(n for n in TEMPLATES if n.startswith("gpt-oss-20b/"))
    tok = make_tokenizer(base_bpe_json, name)
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning_content": "R-E-A-S-O-N"},
    ]
    assert "R-E-A-S-O-N" in chat.render(tok, msgs, thinking="save", add_generation_prompt=False)


CHECK_CASES = [(name, mode) for name in TEMPLATES for mode in ("disable", "save")]


@pytest.mark.parametrize("name,mode", CHECK_CASES, ids=[f"{n}-{t}" for n, t in CHECK_CASES])
def test_check_template_before_generation_agrees_with_the_invariant(base_bpe_json, name, mode):
    """The completions job's pre-flight check rejects exactly the combinations the tokens stage rejects,
    so an unsupported template fails before any generation."""
    from dflash_pipeline.core.errors import ConfigError
    from dflash_pipeline.tokens.shard import check_template

    tok = make_tokenizer(base_bpe_json, name)
    if _expected_failure(name, mode) is not None:
        with pytest.raises(ConfigError, match=r"generation.thinking=.*Nothing was generated.*use_server_token_ids"):
            check_template(tok, mode, template_name=name)
    else:
        warnings = check_template(tok, mode, template_name=name)
        _, _, _, eots, _ = _family(name)
        assert bool(warnings) == (not eots), warnings  # only a template without an end-of-turn marker warns


# --------------------------------------------------------------------------------------------------
# Text is data: special-token strings in an answer are ordinary text in its supervised span
# --------------------------------------------------------------------------------------------------

#: (template, mode) -> why an answer quoting every control string cannot be masked (fails closed).
CONTROL_TEXT_FAILURES = {
    ("DeepSeek-V3.1/chat_template.jinja", "disable"): (
        "the template keeps only what follows the first '</think>' of an assistant content, reasoning or not: "
        "the answer is not rendered verbatim"
    ),
}


def control_answer(tok, k: int) -> str:
    """An answer quoting every control-token string of ``tok`` (special tokens, think markers)."""
    from dflash_pipeline.target.spans import control_token_strings

    quoted = " ".join(f"`{s}`" for s in sorted(control_token_strings(tok)))
    return f"{CONTENT[k]} Tags: {quoted} - and the tag <think></think> does nothing."


def _added_ids(tok) -> set[int]:
    return {int(i) for i in tok.added_tokens_decoder}


CONTROL_CASES = [
    (name, mode) for name in TEMPLATES for mode in ("disable", "save") if _expected_failure(name, mode) is None
]


@pytest.mark.parametrize("name,mode", CONTROL_CASES, ids=[f"{n}-{t}" for n, t in CONTROL_CASES])
def test_special_token_strings_in_answers_stay_text(base_bpe_json, name, mode):
    """Without output ids, an answer quoting control strings is refused (markup it may have emitted and a
    quote look alike). With output ids that show them as text, every control string quoted in an answer
    (and in its reasoning) is encoded as ordinary text: the
    supervised run holds exactly the added-token ids the same conversation with a plain answer holds (the
    template's own markers, the end of turn), it decodes to the answer verbatim, and every turn is
    supervised exactly once."""
    tok = make_tokenizer(base_bpe_json, name)
    plain = conversation(True, mode)
    quoted = [dict(m) for m in plain]
    k = 0
    for m in quoted:
        if m["role"] == "assistant":
            m["content"] = control_answer(tok, k)
            if m.get("reasoning_content"):
                m["reasoning_content"] = REASONING[k] + " (quoting <|im_end|> and </think>)"
            k += 1
    reason = CONTROL_TEXT_FAILURES.get((name, mode))
    if reason is not None:
        with pytest.raises(TokenizationError, match=r"prompt_id=p1 turn="):
            conversation_sequences(tok, quoted, thinking=mode, prompt_id="p1")
        return
    added = _added_ids(tok)
    with pytest.raises(MarkupWithoutIdsError, match=r"prompt_id=p1 turn=0: the answer holds .*no output token ids"):
        conversation_sequences(tok, quoted, thinking=mode, prompt_id="p1")
    # output ids that spell the strings as text (what a server returns for a quote) show they were text
    as_text = plain_text_tokenizer(tok)
    text_ids = [as_text.encode(m["content"], add_special_tokens=False).ids for m in quoted if m["role"] == "assistant"]
    counts: dict = {}
    got = conversation_sequences(tok, quoted, thinking=mode, prompt_id="p1", counts=counts, generated_ids=text_ids)
    ref = conversation_sequences(tok, plain, thinking=mode, prompt_id="p1")
    assert sorted(k for s in got for k in s.turns) == [0, 1]
    assert counts.get("control_text_kept") == 2
    ref_runs = [r for seq, (ids, mask, _) in zip(ref, tokenize_sequences(tok, ref)) for r in masked_runs(ids, mask)]
    got_runs = []
    for seq, (ids, mask, _) in zip(got, tokenize_sequences(tok, got)):
        assert len(ids) == len(mask) and ids.dtype == np.int32 and mask.dtype == np.uint8
        got_runs += masked_runs(ids, mask)
        # the unsupervised part of the sequence is still the template's own tokenization (what the target saw)
        assert tok.decode(ids.tolist(), skip_special_tokens=False) == seq.text
    assert len(got_runs) == len(ref_runs) == 2
    a_msgs = [m for m in quoted if m["role"] == "assistant"]
    for k, (g, r) in enumerate(zip(got_runs, ref_runs)):
        assert [t for t in g if t in added] == [t for t in r if t in added], (k, tok.convert_ids_to_tokens(g))
        decoded = tok.decode(g, skip_special_tokens=False)
        assert a_msgs[k]["content"] in decoded, (k, decoded)
        if mode == "save":
            assert a_msgs[k]["reasoning_content"] in decoded


def test_output_ids_are_the_supervised_tokens(base_bpe_json):
    """When the target's output ids are known and their text is the rendered turn, the supervised tokens
    are those ids (a tokenization the re-encoding would not produce), the prompt part is unchanged."""
    name = "Qwen2.5-7B-Instruct/chat_template.jinja"
    tok = make_tokenizer(base_bpe_json, name)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is 42."}]
    text_ids = [
        tok.convert_tokens_to_ids(c)
        for c in tok.convert_ids_to_tokens(tok("The answer is 42.", add_special_tokens=False)["input_ids"])
    ]
    # one id per character: certainly not what BPE re-encoding gives
    chars = [i for ch in "The answer is 42." for i in tok(ch, add_special_tokens=False)["input_ids"]]
    assert chars != text_ids
    out_ids = chars + [tok.convert_tokens_to_ids("<|im_end|>")]
    gen = tok.decode(out_ids, skip_special_tokens=False)
    counts: dict = {}
    (seq,) = conversation_sequences(
        tok, msgs, thinking="disable", generated=[gen], generated_ids=[out_ids], counts=counts
    )
    assert counts["output_ids_spliced"] == 1
    ((ids, mask, _),) = tokenize_sequences(tok, [seq])
    assert masked_runs(ids, mask) == [out_ids]
    prompt = chat.render(tok, msgs[:1], thinking="disable", add_generation_prompt=True, tokenize=True)
    assert ids[: len(prompt)].tolist() == prompt
