"""Tokens stage: loss-mask semantics, splitting, truncation, drops, dtypes and shard metadata."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from dflash_pipeline.core import shards
from dflash_pipeline.core.contracts import COMPLETION_SCHEMA, TOKEN_SCHEMA, TOKEN_SCHEMA_VERSION
from dflash_pipeline.core.errors import TokenizationError
from dflash_pipeline.tokens.shard import (
    conversation_sequences,
    mask_from_offsets,
    span_token_ranges,
    supervised_length,
    tokenize_sequences,
    tokenize_shard,
)

# Qwen3-style: reasoning rendered only for assistant turns after the last user query; the generation
# prompt carries the empty think block when enable_thinking is false.
QWEN3_STYLE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(found=false, last_query_index=messages|length - 1) %}"
    "{%- for m in messages[::-1] %}{%- if m.role == 'user' and not ns.found %}{%- set ns.found = true %}"
    "{%- set ns.last_query_index = (messages|length - 1) - loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set rc = m.reasoning_content if m.reasoning_content is string else '' %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + rc.strip('\\n') + '\\n</think>\\n\\n' + m.content }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + m.content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# A template that rewrites the turn it generates (R1-style): must fail closed.
REWRITING = (
    "{%- for m in messages %}{%- if m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory):
    """Tokenizer dir with a Qwen3-style template (tiny ByteLevel BPE, ChatML specials)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "The answer is 42. Let me think step by step.",
        "Hello there, how are you today?",
        "What is six times seven? Numbers 0123456789.",
    ] * 30
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = QWEN3_STYLE
    out = tmp_path_factory.mktemp("qwen3_style_target")
    hf.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tok(target_dir):
    from dflash_pipeline.target.chat import load_tokenizer

    return load_tokenizer(target_dir)


def conv(turns, system=None, reasoning=None):
    msgs = [{"role": "system", "content": system, "reasoning_content": None}] if system else []
    for k, (u, a) in enumerate(turns):
        msgs.append({"role": "user", "content": u, "reasoning_content": None})
        msgs.append({"role": "assistant", "content": a, "reasoning_content": reasoning[k] if reasoning else None})
    return msgs


def completion(pid, msgs, thinking="disable", status="ok"):
    n = sum(m["role"] == "assistant" for m in msgs)
    turn = {
        "finish_reason": "stop",
        "prompt_tokens": 1,
        "completion_tokens": 1,
        "prompt_token_ids": None,
        "output_token_ids": None,
        "latency_s": 0.1,
        "endpoint": "local",
    }
    return {
        "prompt_id": pid,
        "dataset": "t",
        "messages": msgs,
        "turns": [dict(turn) for _ in range(n)],
        "model": "m",
        "sampling": "{}",
        "thinking": thinking,
        "status": status,
        "error": "boom" if status == "error" else None,
    }


def write_completions(path, records):
    shards.write_parquet(path, shards.table_from_records(records, COMPLETION_SCHEMA))
    return path


def masked_texts(tok, ids, mask):
    runs, cur = [], []
    for t, m in zip(list(ids), list(mask)):
        if m:
            cur.append(int(t))
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def test_empty_think_block_is_masked_zero(tok):
    msgs = conv([("What is six times seven?", "The answer is 42.")])
    (seq,) = conversation_sequences(tok, msgs, thinking="disable")
    assert "<think>\n\n</think>\n\nThe answer" in seq.text
    ((ids, mask, straddling),) = tokenize_sequences(tok, [seq])
    assert masked_texts(tok, ids, mask) == ["The answer is 42.<|im_end|>"]
    assert straddling == 0
    # the newline the template writes after <|im_end|> is not supervised
    assert tok.decode(ids[-1:]) == "\n" and mask[-1] == 0 and mask[-2] == 1


def test_thinking_on_supervises_reasoning(tok):
    msgs = conv([("What is six times seven?", "The answer is 42.")], reasoning=["six times seven"])
    (seq,) = conversation_sequences(tok, msgs, thinking="save")
    ((ids, mask, _),) = tokenize_sequences(tok, [seq])
    assert masked_texts(tok, ids, mask) == ["<think>\nsix times seven\n</think>\n\nThe answer is 42.<|im_end|>"]


def test_multi_turn_splits_when_template_rewrites_history(tok):
    msgs = conv(
        [("Hello there", "Hello, how are you?"), ("What is six times seven?", "The answer is 42.")], system="Be terse."
    )
    seqs = conversation_sequences(tok, msgs, thinking="disable")
    # turn 0 was generated after an empty think block that the full render drops -> own sequence
    assert [s.turns for s in seqs] == [[0], [1]]
    out = tokenize_sequences(tok, seqs)
    assert masked_texts(tok, *out[0][:2]) == ["Hello, how are you?<|im_end|>"]
    assert masked_texts(tok, *out[1][:2]) == ["The answer is 42.<|im_end|>"]
    assert "<think>" not in seqs[1].text.split("Hello, how are you?")[0][-30:]


def test_multi_turn_prefix_stable_template_gives_one_sequence(tok):
    import copy

    t2 = copy.copy(tok)
    t2.chat_template = REWRITING.replace("<think>\\n", "")
    msgs = conv([("Hello there", "Hello, how are you?"), ("What is six times seven?", "The answer is 42.")])
    (seq,) = conversation_sequences(t2, msgs, thinking="none")
    ((ids, mask, _),) = tokenize_sequences(t2, [seq])
    assert masked_texts(t2, ids, mask) == ["Hello, how are you?<|im_end|>", "The answer is 42.<|im_end|>"]
    (seq,) = conversation_sequences(t2, msgs, thinking="none", last_turn_only=True)
    ((ids, mask, _),) = tokenize_sequences(t2, [seq])
    assert masked_texts(t2, ids, mask) == ["The answer is 42.<|im_end|>"]


def test_rewriting_template_fails_closed(tok):
    import copy

    t2 = copy.copy(tok)
    t2.chat_template = REWRITING
    msgs = conv([("Hello there", "Hello, how are you?")])
    with pytest.raises(TokenizationError, match=r"prompt_id=abc turn=0: .*does not start with"):
        conversation_sequences(t2, msgs, thinking="none", prompt_id="abc")


def test_supervised_length_rules():
    sp = ("<|im_end|>", "<|endoftext|>")
    assert supervised_length("hi<|im_end|>\n", sp) == len("hi<|im_end|>")
    assert supervised_length("hi<|im_end|>\n<|endoftext|>", sp) == len("hi<|im_end|>")
    assert supervised_length("\nhi  \n", sp) == len("\nhi")  # no end-of-turn marker (GLM-4.5)


def test_mask_from_offsets_straddling_is_zero():
    offsets = np.array([[0, 3], [3, 6], [6, 9], [9, 12], [12, 12]])
    mask, straddle = mask_from_offsets(offsets, [(4, 9)])
    # [3,6) straddles the span start -> 0; [6,9) inside -> 1; zero-width -> 0
    assert mask.tolist() == [0, 0, 1, 0, 0] and straddle == 1
    mask, straddle = mask_from_offsets(offsets, [(3, 12)])
    assert mask.tolist() == [0, 1, 1, 1, 0] and straddle == 0


def test_span_token_ranges_match_per_token_reference(tok):
    """The boundary-only mask equals the per-token reference on random texts and random spans, including
    spans that cut words, multi-byte characters (byte-split tokens), special tokens and the text ends."""
    import random

    rng = random.Random(7)
    pieces = [
        "The answer",
        " is",
        " 42",
        ".",
        " Let me think",
        "\n\n",
        "  ",
        "é",
        "数学",
        "🙂",
        "<|im_end|>",
        "<|im_start|>",
        "assistant\n",
        "step by step",
        "0123",
        "\t",
        "x",
    ]
    backend = tok.backend_tokenizer
    checked = straddled = 0
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 14)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, 2 * rng.randint(1, 3))))
        spans = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)]
        enc = backend.encode(text, add_special_tokens=False)
        want, want_straddling = mask_from_offsets(np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2), spans)
        found = span_token_ranges(enc, spans, len(text))
        assert found is not None, text
        ranges, straddling = found
        got = np.zeros(len(enc.ids), dtype=np.uint8)
        for a, b in ranges:
            got[a:b] = 1
        assert got.tolist() == want.tolist(), (text, spans)
        assert straddling == want_straddling, (text, spans)
        checked += 1
        straddled += straddling > 0
    assert checked == 300 and straddled > 20  # the straddling branch was exercised


def test_tokenize_shard_end_to_end(tmp_path, target_dir, tok):
    recs = [
        completion("p0", conv([("What is six times seven?", "The answer is 42.")])),
        completion("p1", conv([("Hello there", "Hello, how are you?"), ("What is six?", "Six.")])),
        completion("p2", conv([("Hello there", "x")]), status="error"),
        completion("p3", [{"role": "user", "content": "Hello", "reasoning_content": None}]),
        completion("p4", conv([("Hello there", "Hi, " + "numbers 0123456789 " * 20)]), status="truncated"),
    ]
    src = write_completions(tmp_path / "c.parquet", recs)
    out = tmp_path / "t.parquet"
    stats = tokenize_shard(src, out, target_dir=target_dir, tokens_cfg={"max_length": 96, "last_turn_only": False})
    t = pq.read_table(out)
    assert t.schema.remove_metadata() == TOKEN_SCHEMA
    assert t.schema.field("input_ids").type.value_type == "int32"
    assert t.schema.field("loss_mask").type.value_type == "uint8"
    rows = t.to_pylist()
    assert [r["prompt_id"] for r in rows] == ["p0", "p1", "p1", "p4"]
    for r in rows:
        assert r["num_tokens"] == len(r["input_ids"]) == len(r["loss_mask"]) <= 96
        assert r["num_loss_tokens"] == sum(r["loss_mask"]) > 0
    assert rows[-1]["truncated"] and not rows[0]["truncated"]
    assert stats["dropped"]["status_error"] == 1 and stats["dropped"]["no_assistant_turn"] == 1
    assert stats["truncated"] == 1 and stats["split_conversations"] == 1 and stats["records_out"] == 4
    meta = shards.read_shard_metadata(out)
    assert meta["schema_version"] == TOKEN_SCHEMA_VERSION
    assert len(meta["tokenizer_sha256"]) == 64 and len(meta["chat_template_sha256"]) == 64
    assert meta["thinking"] == ["disable"] and meta["max_length"] == 96
    assert meta["counts"]["dropped"]["status_error"] == 1
    # deterministic: a rerun leaves the file untouched
    mtime = out.stat().st_mtime_ns
    tokenize_shard(src, out, target_dir=target_dir, tokens_cfg={"max_length": 96, "last_turn_only": False})
    assert out.stat().st_mtime_ns == mtime


def test_truncation_that_removes_all_loss_tokens_drops(tmp_path, target_dir):
    recs = [completion("p0", conv([("Hello there " * 20, "The answer is 42.")]))]
    src = write_completions(tmp_path / "c.parquet", recs)
    stats = tokenize_shard(
        src, tmp_path / "t.parquet", target_dir=target_dir, tokens_cfg={"max_length": 16, "last_turn_only": False}
    )
    assert stats["records_out"] == 0 and stats["dropped"]["truncated_no_loss"] == 1
    assert stats["dropped"]["no_loss_tokens"] == 0 and stats["turns_supervised"] == 0


def test_last_turn_only_and_non_strict(tmp_path, target_dir, tok):
    recs = [completion("p1", conv([("Hello there", "Hello, how are you?"), ("What is six?", "Six.")]))]
    src = write_completions(tmp_path / "c.parquet", recs)
    out = tmp_path / "t.parquet"
    tokenize_shard(src, out, target_dir=target_dir, tokens_cfg={"max_length": 512, "last_turn_only": True})
    (row,) = pq.read_table(out).to_pylist()
    assert masked_texts(tok, row["input_ids"], row["loss_mask"]) == ["Six.<|im_end|>"]
    tpl = tmp_path / "rewrite.jinja"
    tpl.write_text(REWRITING)
    with pytest.raises(TokenizationError, match="prompt_id=p1"):
        tokenize_shard(
            src, out, target_dir=target_dir, chat_template=tpl, tokens_cfg={"max_length": 512, "last_turn_only": False}
        )
    stats = tokenize_shard(
        src,
        out,
        target_dir=target_dir,
        chat_template=tpl,
        tokens_cfg={"max_length": 512, "last_turn_only": False, "strict": False},
    )
    assert stats["dropped"]["tokenization_error"] == 1 and stats["records_out"] == 0


def test_server_token_ids_are_used_exactly(tmp_path, target_dir):
    rec = completion("p0", conv([("Hello there", "Hi."), ("What is six?", "Six.")]))
    rec["turns"][0].update(prompt_token_ids=[1, 2, 3], output_token_ids=[4, 5])
    rec["turns"][1].update(prompt_token_ids=[1, 2, 3, 4, 5, 6], output_token_ids=[7, 8, 2])
    src = write_completions(tmp_path / "c.parquet", [rec])
    out = tmp_path / "t.parquet"
    stats = tokenize_shard(
        src,
        out,
        target_dir=target_dir,
        tokens_cfg={"max_length": 64, "last_turn_only": False, "use_server_token_ids": True},
    )
    rows = pq.read_table(out).to_pylist()
    assert [r["input_ids"] for r in rows] == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8, 2]]
    assert [r["loss_mask"] for r in rows] == [[0, 0, 0, 1, 1], [0] * 6 + [1, 1, 1]]
    assert stats["server_ids_used"] == 2  # both turns built from the server's ids (one record)


def test_demo_target_masks_answer_and_end_of_turn(tmp_path, demo_target):
    from dflash_pipeline.target.chat import load_tokenizer

    tok = load_tokenizer(demo_target)
    recs = [completion("p0", conv([("What is six times seven?", "The answer is 42.")]))]
    src = write_completions(tmp_path / "c.parquet", recs)
    out = tmp_path / "t.parquet"
    tokenize_shard(src, out, target_dir=demo_target, tokens_cfg={"max_length": 512, "last_turn_only": False})
    (row,) = pq.read_table(out).to_pylist()
    assert masked_texts(tok, row["input_ids"], row["loss_mask"]) == ["The answer is 42." + tok.eos_token]


def test_generation_cut_at_max_tokens_has_no_supervised_end_of_turn(tok):
    msgs = conv([("What is six times seven?", "The answer is")])
    (seq,) = conversation_sequences(tok, msgs, thinking="disable", finish_reasons=["length"])
    ((ids, mask, _),) = tokenize_sequences(tok, [seq])
    assert masked_texts(tok, ids, mask) == ["The answer is"]


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_template_think_block_the_target_never_generated_is_zero(tmp_path, target_dir, tok):
    """thinking=none: the template renders an empty think block before a turn without reasoning; the
    output ids show the target went straight to its answer, so the block is scaffolding (0)."""
    answer = "The answer is 42."
    msgs = conv([("What is six times seven?", answer), ("Hello there", "Six.")])
    rec = completion("p0", msgs, thinking="none")
    for t, a in zip(rec["turns"], [answer, "Six."]):
        t["output_token_ids"] = _ids(tok, a) + [tok.convert_tokens_to_ids("<|im_end|>")]
    counts: dict = {}
    seqs = conversation_sequences(
        tok, msgs, thinking="none", counts=counts, generated=[tok.decode(t["output_token_ids"]) for t in rec["turns"]]
    )
    last = seqs[-1]
    assert "<think>\n\n</think>\n\nSix." in last.text  # rendered, but not generated
    assert counts["scaffolding_excluded"] == 2  # each turn, rendered in its own generation context
    for seq, want in zip(seqs, [answer, "Six."]):
        ((ids, mask, _),) = tokenize_sequences(tok, [seq])
        assert masked_texts(tok, ids, mask) == [f"{want}<|im_end|>"]
    # without output ids the render is all there is: the block stays supervised, as before
    (no_ids,) = conversation_sequences(tok, msgs[:2], thinking="none")
    ((ids, mask, _),) = tokenize_sequences(tok, [no_ids])
    assert masked_texts(tok, ids, mask) == [f"<think>\n\n</think>\n\n{answer}<|im_end|>"]
    # through the shard entry point: the stats carry the count
    src = write_completions(tmp_path / "c.parquet", [rec])
    stats = tokenize_shard(
        src, tmp_path / "t.parquet", target_dir=target_dir, tokens_cfg={"max_length": 512, "last_turn_only": True}
    )
    assert stats["scaffolding_excluded"] == 1 and stats["render_differs_from_output_ids"] == 0
    row = pq.read_table(tmp_path / "t.parquet").to_pylist()[0]
    assert masked_texts(tok, row["input_ids"], row["loss_mask"]) == ["Six.<|im_end|>"]


def test_generated_think_block_stays_supervised(tok):
    """The target did generate the think block (output ids start with it): nothing moves."""
    msgs = conv([("What is six times seven?", "The answer is 42.")], reasoning=["Six sevens."])
    gen = "<think>\nSix sevens.\n</think>\n\nThe answer is 42.<|im_end|>"
    counts: dict = {}
    (seq,) = conversation_sequences(tok, msgs, thinking="save", generated=[gen], counts=counts)
    ((ids, mask, _),) = tokenize_sequences(tok, [seq])
    assert masked_texts(tok, ids, mask) == [gen]
    assert counts.get("scaffolding_excluded", 0) == 0 and counts.get("render_differs_from_output_ids", 0) == 0
    # the template normalizes the reasoning's whitespace: counted, the render's mask kept
    (seq,) = conversation_sequences(
        tok,
        msgs,
        thinking="save",
        counts=counts,
        generated=["<think>\nSix sevens.\n\n\n</think>\n\nThe answer is 42.<|im_end|>"],
    )
    ((ids, mask, _),) = tokenize_sequences(tok, [seq])
    assert masked_texts(tok, ids, mask) == [gen] and counts["render_differs_from_output_ids"] == 1


def test_preflight_rejects_before_generation_and_warns_on_foreign_template(tmp_path, target_dir):
    from dflash_pipeline.completions import preflight_template
    from dflash_pipeline.core.errors import ConfigError

    gen = {"thinking": "disable"}
    rewriting = tmp_path / "r1_style.jinja"
    rewriting.write_text(REWRITING)
    with pytest.raises(ConfigError, match=r"r1_style.jinja with generation.thinking='disable'.*does not start with"):
        preflight_template(target_dir, gen_cfg=gen, tokens_cfg={}, chat_template=rewriting)
    # server token ids need no render: the check is skipped
    assert (
        preflight_template(target_dir, gen_cfg=gen, tokens_cfg={"use_server_token_ids": True}, chat_template=rewriting)
        == []
    )
    assert preflight_template(target_dir, gen_cfg=gen, tokens_cfg={}) == []  # its own template: fine
    # a Llama template on a ChatML tokenizer: <|eot_id|> is plain text here, so no stop token is supervised
    llama = tmp_path / "llama.jinja"
    llama.write_text(
        "{%- for m in messages %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content"
        " + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}"
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
    )
    (warning,) = preflight_template(target_dir, gen_cfg=gen, tokens_cfg={}, chat_template=llama)
    assert "<|eot_id|>'" in warning and "not with a special token" in warning


def test_check_template_only_warns_when_the_template_rejects_system_turns(tok):
    """gemma-2 style: `raise_exception('System role not supported')` - a warning, not a failed job."""
    from dflash_pipeline.tokens.shard import check_template

    tok2 = tok.__class__.from_pretrained(tok.name_or_path)
    tok2.chat_template = (
        "{%- if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{%- endif %}"
        + QWEN3_STYLE
    )
    (warning,) = check_template(tok2, "disable", template_name="gemma2-style")
    assert "system turn cannot be masked" in warning and "System role not supported" in warning


def test_answer_quoting_special_tokens_is_text_in_the_token_shard(tmp_path, target_dir, tok):
    """Issue #18: an answer quoting `<|im_end|>` and `</think>`: its supervised span holds one end-of-turn id
    (the real stop) and no think-marker id; the answer is kept verbatim. The output ids show the think
    markers were text; without them the record is refused (the model could have emitted `<think>`), while
    a quoted `<|im_end|>` alone needs no ids (the model stops at a real one)."""
    from dflash_pipeline.core.errors import MarkupWithoutIdsError
    from dflash_pipeline.tokens.shard import plain_text_tokenizer

    answer = "Write <|im_end|> to stop; the tag <think></think> does nothing."
    eot, think_ids = tok.convert_tokens_to_ids("<|im_end|>"), set(tok.convert_tokens_to_ids(["<think>", "</think>"]))
    rec = completion("p0", conv([("Explain chat templates.", answer)]))
    text_ids = plain_text_tokenizer(tok).encode(answer, add_special_tokens=False).ids + [eot]
    rec["turns"][0]["output_token_ids"] = text_ids
    cfg = {"max_length": 512, "last_turn_only": False}
    out = tmp_path / "t.parquet"
    stats = tokenize_shard(write_completions(tmp_path / "c.parquet", [rec]), out, target_dir=target_dir, tokens_cfg=cfg)
    (row,) = pq.read_table(out).to_pylist()
    sup = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
    assert sup.count(eot) == 1 and sup[-1] == eot and not think_ids & set(sup)
    assert masked_texts(tok, row["input_ids"], row["loss_mask"]) == [answer + "<|im_end|>"]
    assert stats["output_ids_spliced"] + stats["control_text_kept"] == 1 and stats["records_out"] == 1
    rec["turns"][0]["output_token_ids"] = None
    with pytest.raises(MarkupWithoutIdsError, match=r"prompt_id=p0 turn=0: the answer holds \['</think>', '<think>'\]"):
        tokenize_shard(write_completions(tmp_path / "c2.parquet", [rec]), out, target_dir=target_dir, tokens_cfg=cfg)
    quote = "Write <|im_end|> to stop."
    rec = completion("p1", conv([("Explain chat templates.", quote)]))
    stats = tokenize_shard(
        write_completions(tmp_path / "c3.parquet", [rec]), out, target_dir=target_dir, tokens_cfg=cfg
    )
    (row,) = pq.read_table(out).to_pylist()
    assert masked_texts(tok, row["input_ids"], row["loss_mask"]) == [quote + "<|im_end|>"]
    assert stats["control_text_kept"] == 1 and stats["records_out"] == 1
