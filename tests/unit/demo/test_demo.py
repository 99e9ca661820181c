"""Demo target: tokenizer, Qwen3-faithful chat template, sizes, determinism, atomic output."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from conftest import GSM8K_TRAIN, SHIPPED_DEMO_SETTINGS, models_dir

from dflash_pipeline import demo
from dflash_pipeline.core.errors import DataError
from dflash_pipeline.demo import (
    CHAT_TEMPLATE,
    build_demo_target,
    encode_conversation,
    padded_vocab_size,
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}],
    [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}],
    [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", "reasoning_content": "think hard"}],
    [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nr\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2", "reasoning_content": "r2"},
    ],
    [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "r1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2"},
        {"role": "system", "content": "late system"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer(demo_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_target))


def test_padded_vocab_size_is_strictly_greater_multiple_of_64():
    assert padded_vocab_size(1026) == 1088
    assert padded_vocab_size(1024) == 1088
    assert padded_vocab_size(1) == 64


def test_build_facts_and_sizes(demo_target, tokenizer):
    facts = json.loads((demo_target / "demo_target.json").read_text())
    cfg = json.loads((demo_target / "config.json").read_text())
    assert facts["train_steps"] == SHIPPED_DEMO_SETTINGS["train_steps"] and facts["seed"] == 0
    assert facts["final_loss"] < facts["first_loss"] - 1.0  # it learned something
    assert facts["len_tokenizer"] == len(tokenizer)
    assert cfg["vocab_size"] == facts["vocab_size"] == padded_vocab_size(len(tokenizer))
    assert cfg["vocab_size"] % 64 == 0 and cfg["vocab_size"] > len(tokenizer)
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert (
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
        cfg["intermediate_size"],
    ) == (128, 8, 4, 2, 32, 384)
    gen = json.loads((demo_target / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    ]
    assert (demo_target / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert not list(demo_target.parent.glob(".*tmp*"))


def test_special_tokens(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None and tokenizer.model_max_length == demo.MODEL_MAX_LENGTH
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        ids = tokenizer(t, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids[0]) == t
    # think markers are added tokens but not special (kept by skip_special_tokens), as in Qwen3
    ids = tokenizer("<think>\nx\n</think><|im_end|>", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>\nx\n</think>"
    text = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_generation_prompt_thinking_modes(tokenizer):
    msgs = CONVERSATIONS[0]
    off = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    on = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    default = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert off == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert on == default == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_template_matches_real_qwen3(tokenizer, i, kwargs):
    d = models_dir()
    if d is None or not (d / "Qwen3-8B" / "chat_template.jinja").is_file():
        pytest.skip("Qwen3-8B chat template not available")
    qwen3 = (d / "Qwen3-8B" / "chat_template.jinja").read_text()
    msgs = CONVERSATIONS[i]
    gen = msgs[-1]["role"] != "assistant"
    ours = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **kwargs)
    theirs = tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=gen, chat_template=qwen3, **kwargs
    )
    assert ours == theirs


def test_encode_conversation_masks_answer_only(tokenizer):
    msgs = [{"role": "user", "content": "How many?"}, {"role": "assistant", "content": "5 + 3 = 8\n#### 8"}]
    ids, mask = encode_conversation(tokenizer, msgs)
    assert len(ids) == len(mask)
    rendered = tokenizer.apply_chat_template(msgs, tokenize=False, enable_thinking=False)
    assert tokenizer.decode(ids) == rendered.rstrip("\n")  # the trailing "\n" after <|im_end|> is not trained
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "5 + 3 = 8\n#### 8<|im_end|>"
    assert tokenizer.decode([t for t, m in zip(ids, mask) if not m]).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_greedy_generation_is_not_degenerate(demo_target):
    """The shipped target (the default settings) answers with structure."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = demo_target
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target)).eval()
    questions = [
        json.loads(line)["question"] for line in (GSM8K_TRAIN.parent / "test.jsonl").read_text().splitlines()[1:4]
    ]
    structured = 0
    for q in questions:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        enc = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=60, do_sample=False)
        new = out[0, enc["input_ids"].shape[1] :].tolist()
        text = tokenizer.decode(new, skip_special_tokens=True)
        # GSM8K-style: computes something (digits, "=") with varied tokens
        structured += len(set(new)) >= 8 and any(ch.isdigit() for ch in text) and "=" in text
    assert structured >= 2


def _small_corpus(tmp_path: Path, n: int = 200) -> Path:
    lines = GSM8K_TRAIN.read_text().splitlines()[:n]
    p = tmp_path / "small.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def _digest(d: Path) -> dict:
    return {
        f: hashlib.sha256((d / f).read_bytes()).hexdigest()
        for f in ("model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja")
    }


def test_build_is_deterministic_and_replaces_atomically(tmp_path):
    corpus = _small_corpus(tmp_path)
    kw = dict(seed=3, vocab_size=400, hidden_size=64, num_hidden_layers=4, train_steps=3, batch_size=4, log=None)
    a = build_demo_target(tmp_path / "a", [corpus], **kw)
    b = build_demo_target(tmp_path / "b", [corpus], **kw)
    assert _digest(a) == _digest(b)
    c = build_demo_target(tmp_path / "a", [corpus], **{**kw, "seed": 4})  # replaces the existing dir
    assert _digest(c)["model.safetensors"] != _digest(b)["model.safetensors"]
    assert json.loads((c / "demo_target.json").read_text())["seed"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "small.jsonl"]


def test_crash_leaves_no_half_target(tmp_path, monkeypatch):
    corpus = _small_corpus(tmp_path, 50)

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(demo, "write_json", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        build_demo_target(
            tmp_path / "t",
            [corpus],
            vocab_size=300,
            hidden_size=64,
            num_hidden_layers=4,
            train_steps=1,
            batch_size=2,
            log=None,
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.jsonl"]


def test_bad_corpus_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1.*answer"):
        demo.load_corpus([bad])
    with pytest.raises(DataError, match="does not exist"):
        demo.load_corpus([tmp_path / "nope.jsonl"])


def test_build_records_the_settings_that_key_its_directory(demo_target, tmp_path):
    """demo_target.json records the `target.demo` settings (workflow.keyed_paths keys the directory by them); a
    target built before that key gives the same settings back from its build facts."""
    from dflash_pipeline.workflow.keyed_paths import recorded_demo_params

    facts = json.loads((demo_target / "demo_target.json").read_text())
    want = SHIPPED_DEMO_SETTINGS
    assert facts["params"] == want and recorded_demo_params(demo_target) == want
    old = tmp_path / "old-release"
    old.mkdir(exist_ok=True)
    (old / "demo_target.json").write_text(json.dumps({k: v for k, v in facts.items() if k != "params"}))
    assert recorded_demo_params(old) == want  # vocab_size asked = len(tokenizer) - the two think tokens
