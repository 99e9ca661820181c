"""SGLang fleets give the exact token ids (issue 26): the completions stage against the test server in
SGLang's answer shapes (``flavor="sglang"``: per-choice ``prompt_token_ids`` / ``token_ids`` of
sgl-project/sglang PR #30917, the response-level ``sglext.input_ids`` / ``output_ids`` of PR #34488), then
the tokens stage builds every row from those ids (``tokens.use_server_token_ids``), in each thinking mode,
for chat and raw completions. An SGLang that ignores the field stops the run at its first answer."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from test_completions import FAST, MULTI, gen_cfg, read_records, write_prompts

from dflash_pipeline.completions import generate_shard
from dflash_pipeline.core.errors import ConfigError
from dflash_pipeline.target.chat import load_tokenizer, render
from dflash_pipeline.testing.server import start_test_server
from dflash_pipeline.tokens import tokenize_shard

# A Qwen3-style template: the generation prompt closes an empty think block when thinking is disabled;
# earlier assistant turns are rendered without their reasoning.
TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{{- '<|im_start|>system\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
ID_FIELDS = {
    "return_token_ids": {"return_token_ids": True},
    "sglext": {"return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True},
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tokenizer directory (tiny ByteLevel BPE, ChatML specials, ``<think>`` tags) with :data:`TEMPLATE`."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "Answer 1 to: What is 2 plus 3? Let me think about turn 2.",
        "Completion of a 9-word prompt.",
        "Natalia sold 48 clips in April. How many in May? Hi there, you are terse.",
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
    hf.chat_template = TEMPLATE
    out = tmp_path_factory.mktemp("sglang_target")
    hf.save_pretrained(out)
    return out


def _raw_text(msg: dict) -> str:
    """What the model wrote for an assistant message, before SGLang's reasoning parser split it."""
    think = f"<think>\n{msg['reasoning_content']}\n</think>\n\n" if msg["reasoning_content"] is not None else ""
    return think + msg["content"]


def _rows_from_server_ids(tmp_path, target_dir, records: list[dict]) -> None:
    """The tokens stage on the shard: one row per turn, exactly the server's prompt + output ids, the loss
    on the output ids; ``server_ids_used`` counts every turn built from them (not the records)."""
    stats = tokenize_shard(
        tmp_path / "c.parquet",
        tmp_path / "t.parquet",
        target_dir=target_dir,
        tokens_cfg={"max_length": 4096, "last_turn_only": False, "use_server_token_ids": True},
    )
    rows = pq.read_table(tmp_path / "t.parquet").to_pylist()
    want = [
        (r["prompt_id"], k, t["prompt_token_ids"] + t["output_token_ids"], len(t["prompt_token_ids"]))
        for r in records
        for k, t in enumerate(r["turns"])
    ]
    assert [(r["prompt_id"], r["turn"], r["input_ids"]) for r in rows] == [w[:3] for w in want]
    for row, (_, _, ids, n_prompt) in zip(rows, want):
        assert row["loss_mask"] == [0] * n_prompt + [1] * (len(ids) - n_prompt)
    assert stats["server_ids_used"] == len(want) == stats["records_out"] == 4 and len(records) < 4


@pytest.mark.parametrize("ids", sorted(ID_FIELDS))
@pytest.mark.parametrize("thinking", ["disable", "save", "none"])
def test_sglang_chat_ids_become_the_token_shard(tmp_path, target_dir, thinking, ids):
    write_prompts(tmp_path / "p.parquet", MULTI)
    eps = [{"base_url": "", "max_concurrency": 4}]
    with start_test_server(flavor="sglang", tokenizer_dir=target_dir, reasoning=True) as srv:
        eps[0]["base_url"] = srv.base_url
        cfg = gen_cfg(backend="openai", endpoints=eps, thinking=thinking, extra_body=ID_FIELDS[ids], **FAST)
        generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=target_dir, gen_cfg=cfg)
        assert all(all(b.get(k) for k in ID_FIELDS[ids]) for b in srv.stats.requests)
    tok = load_tokenizer(target_dir)
    records = read_records(tmp_path / "c.parquet")
    assert [r["status"] for r in records] == ["ok"] * 3
    for rec in records:
        history = []
        for m in rec["messages"]:
            if m["role"] != "assistant":
                history.append({"role": m["role"], "content": m["content"]})
                continue
            turn = rec["turns"][sum(x["role"] == "assistant" for x in history)]
            # the prompt the server rendered (the regenerated history), and the raw ids of the answer
            assert turn["prompt_token_ids"] == render(
                tok, history, thinking=thinking, add_generation_prompt=True, tokenize=True
            )
            assert tok.decode(turn["output_token_ids"], skip_special_tokens=False) == _raw_text(m) + "<|im_end|>"
            assert (m["reasoning_content"] is None) == (thinking == "disable")
            history.append({"role": "assistant", "content": m["content"]})
    _rows_from_server_ids(tmp_path, target_dir, records)


@pytest.mark.parametrize("thinking", ["disable", "save", "none"])
def test_sglang_raw_completions_ids_become_the_token_shard(tmp_path, target_dir, thinking):
    write_prompts(tmp_path / "p.parquet", MULTI)
    with start_test_server(flavor="sglang", tokenizer_dir=target_dir, reasoning=True) as srv:
        eps = [{"base_url": srv.base_url, "max_concurrency": 4}]
        cfg = gen_cfg(
            backend="openai",
            api="completions",
            endpoints=eps,
            thinking=thinking,
            max_tokens=64,
            extra_body={"return_token_ids": True},
            **FAST,
        )
        generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=target_dir, gen_cfg=cfg)
        sent = [b["prompt"] for b in srv.stats.requests]
    records = read_records(tmp_path / "c.parquet")
    assert [r["status"] for r in records] == ["ok"] * 3
    assert sorted(t["prompt_token_ids"] for r in records for t in r["turns"]) == sorted(sent)
    tok = load_tokenizer(target_dir)
    for rec in records:
        for turn, m in zip(rec["turns"], [m for m in rec["messages"] if m["role"] == "assistant"]):
            assert (m["reasoning_content"] is None) == (thinking == "disable")
            assert tok.decode(turn["output_token_ids"], skip_special_tokens=False).endswith(m["content"] + "<|im_end|>")
    _rows_from_server_ids(tmp_path, target_dir, records)


def test_an_sglang_that_ignores_return_token_ids_stops_the_run_at_its_first_answer(tmp_path, target_dir):
    write_prompts(tmp_path / "p.parquet", MULTI)
    with start_test_server(flavor="sglang-legacy", tokenizer_dir=target_dir) as srv:
        eps = [{"base_url": srv.base_url, "max_concurrency": 1}]
        cfg = gen_cfg(backend="openai", endpoints=eps, extra_body={"return_token_ids": True}, **FAST)
        with pytest.raises(
            ConfigError,
            match=r"answered without token ids although generation.extra_body sets "
            r"return_token_ids.*v0\.5\.18.*PR #30917",
        ):
            generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=target_dir, gen_cfg=cfg)
        assert srv.stats.answered == 1  # nothing after the first answer
    assert not (tmp_path / "c.parquet").exists()


def test_the_kimi_recipe_runs_on_an_sglang_fleet_with_thinking_saved(tmp_path, target_dir):
    """config/examples/kimi-k2.6.yaml's generation and tokens sections, its fleet replaced by two SGLang-shaped
    servers: the reasoning is kept and every turn is trained from the servers' ids."""
    import yaml
    from conftest import REPO_ROOT

    from dflash_pipeline.core.config import validate_config

    recipe = yaml.safe_load((REPO_ROOT / "config" / "examples" / "kimi-k2.6.yaml").read_text())
    assert recipe["generation"]["thinking"] == "save" and recipe["tokens"]["use_server_token_ids"] is True
    write_prompts(tmp_path / "p.parquet", MULTI)
    model = recipe["generation"]["model"]
    with (
        start_test_server(flavor="sglang", tokenizer_dir=target_dir, reasoning=True, model_name=model) as a,
        start_test_server(flavor="sglang", tokenizer_dir=target_dir, reasoning=True, model_name=model) as b,
    ):
        gen = {
            **recipe["generation"],
            **FAST,
            "endpoints": [{"base_url": s.base_url, "max_concurrency": 2} for s in (a, b)],
        }
        cfg = validate_config({"generation": gen})["generation"]
        generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=target_dir, gen_cfg=cfg)
        assert a.stats.answered + b.stats.answered == 4
    records = read_records(tmp_path / "c.parquet")
    assert all(m["reasoning_content"] for r in records for m in r["messages"] if m["role"] == "assistant")
    tokens_cfg = validate_config({"tokens": {**recipe["tokens"], "max_length": 4096}})["tokens"]
    stats = tokenize_shard(tmp_path / "c.parquet", tmp_path / "t.parquet", target_dir=target_dir, tokens_cfg=tokens_cfg)
    assert stats["server_ids_used"] == stats["records_out"] == 4  # every turn of every record
