"""Config probe: layer-id formula, every real config in the model metadata corpus, the demo target,
mask-token resolution, errors and the JSON Schema."""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import time
from pathlib import Path

import pytest
from conftest import models_dir

from dflash_pipeline import probe as probe_mod
from dflash_pipeline.core.contracts import PROBE_SCHEMA_VERSION
from dflash_pipeline.core.errors import ConfigError, ProbeError
from dflash_pipeline.probe import (
    build_target_layer_ids,
    hf_hidden_state_index,
    main,
    resolve_mask_token_id,
    summary,
    validate_probe,
    write_probe,
)


def probe_target(*args, **kwargs) -> dict:
    """:func:`dflash_pipeline.probe.probe_target`, and every record a test gets validates against the
    probe JSON Schema (the issue's "every test output validates")."""
    rec = probe_mod.probe_target(*args, **kwargs)
    validate_probe(rec)
    return rec


# --------------------------------------------------------------------------------------------------
# layer ids


@pytest.mark.parametrize(
    "n, k, expected",
    [
        (36, 5, [1, 9, 17, 25, 33]),
        (32, 5, [1, 8, 15, 22, 29]),
        (24, 5, [1, 6, 11, 16, 21]),
        (40, 5, [1, 10, 19, 28, 37]),
        (64, 5, [1, 16, 31, 46, 61]),
        # N=61 (DeepSeek-V3 / Kimi): 1 + i*57/4 = 1, 15.25, 29.5, 43.75, 58 -> banker's round(29.5) = 30
        (61, 5, [1, 15, 30, 44, 58]),
        # N=30 (Gemma-4): 7.5 -> 8 and 20.5 -> 20 (round half to even)
        (30, 5, [1, 8, 14, 20, 27]),
        (36, 1, [18]),
        (61, 1, [30]),
        (8, 5, [1, 2, 3, 4, 5]),
        (36, 2, [1, 33]),
    ],
)
def test_build_target_layer_ids_reference_formula(n, k, expected):
    assert build_target_layer_ids(n, k) == expected


def test_build_target_layer_ids_rejects_impossible_requests():
    with pytest.raises(ConfigError, match="needs >= 4"):
        build_target_layer_ids(3, 2)
    with pytest.raises(ConfigError, match="repeated ids"):
        build_target_layer_ids(6, 5)  # 1 + i*0.5 -> [1, 2, 2, 2, 3]
    with pytest.raises(ConfigError, match="num_target_features"):
        build_target_layer_ids(36, 0)


def test_hf_hidden_state_index_is_layer_plus_one():
    assert [hf_hidden_state_index(i) for i in [1, 9, 17, 25, 33]] == [2, 10, 18, 26, 34]
    assert hf_hidden_state_index(0) == 1  # index 0 is the embedding output, never a layer
    with pytest.raises(ValueError):
        hf_hidden_state_index(-1)


# --------------------------------------------------------------------------------------------------
# every config.json of the metadata corpus: values read off the file by hand

# name: (text_config_path, model_type, hidden, layers, vocab, attention kind, heads, kv heads,
#        num_experts, experts per token, layer type counts, target ids for K=5)
EXPECTED = {
    "DeepSeek-R1": ("", "deepseek_v3", 7168, 61, 129280, "MLA", 128, 128, 256, 8, None, [1, 15, 30, 44, 58]),
    "DeepSeek-V3": ("", "deepseek_v3", 7168, 61, 129280, "MLA", 128, 128, 256, 8, None, [1, 15, 30, 44, 58]),
    "DeepSeek-V3.1": ("", "deepseek_v3", 7168, 61, 129280, "MLA", 128, 128, 256, 8, None, [1, 15, 30, 44, 58]),
    "Kimi-K2-Instruct": ("", "kimi_k2", 7168, 61, 163840, "MLA", 64, 64, 384, 8, None, [1, 15, 30, 44, 58]),
    "Kimi-K2.5": ("text_config", "kimi_k25", 7168, 61, 163840, "MLA", 64, 64, 384, 8, None, [1, 15, 30, 44, 58]),
    "Meta-Llama-3.1-8B": ("", "llama", 4096, 32, 128256, "GQA", 32, 8, None, None, None, [1, 8, 15, 22, 29]),
    "MiniMax-M2.7": (
        "",
        "minimax_m2",
        3072,
        62,
        200064,
        "GQA",
        48,
        8,
        256,
        8,
        {"full_attention": 62},
        [1, 16, 30, 44, 59],
    ),
    "Qwen2.5-7B": ("", "qwen2", 3584, 28, 152064, "GQA", 28, 4, None, None, None, [1, 7, 13, 19, 25]),
    "Qwen3-30B-A3B": ("", "qwen3_moe", 2048, 48, 151936, "GQA", 32, 4, 128, 8, None, [1, 12, 23, 34, 45]),
    "Qwen3-8B": ("", "qwen3", 4096, 36, 151936, "GQA", 32, 8, None, None, None, [1, 9, 17, 25, 33]),
    "Qwen3-Next-80B-A3B-Thinking": (
        "",
        "qwen3_next",
        2048,
        48,
        151936,
        "GQA",
        16,
        2,
        512,
        10,
        {"full_attention": 12, "linear_attention": 36},
        [1, 12, 23, 34, 45],
    ),
    "Qwen3-VL-32B-Instruct": (
        "text_config",
        "qwen3_vl",
        5120,
        64,
        151936,
        "GQA",
        64,
        8,
        None,
        None,
        None,
        [1, 16, 31, 46, 61],
    ),
    "Qwen3.5-27B": (
        "text_config",
        "qwen3_5",
        5120,
        64,
        248320,
        "GQA",
        24,
        4,
        None,
        None,
        {"full_attention": 16, "linear_attention": 48},
        [1, 16, 31, 46, 61],
    ),
    "Qwen3.5-35B-A3B": (
        "text_config",
        "qwen3_5_moe",
        2048,
        40,
        248320,
        "GQA",
        16,
        2,
        256,
        8,
        {"full_attention": 10, "linear_attention": 30},
        [1, 10, 19, 28, 37],
    ),
    "gemma-4-26B-A4B": (
        "text_config",
        "gemma4",
        2816,
        30,
        262144,
        "GQA",
        16,
        8,
        128,
        8,
        {"full_attention": 5, "sliding_attention": 25},
        [1, 8, 14, 20, 27],
    ),
    "gpt-oss-120b": (
        "",
        "gpt_oss",
        2880,
        36,
        201088,
        "GQA",
        64,
        8,
        128,
        4,
        {"full_attention": 18, "sliding_attention": 18},
        [1, 9, 17, 25, 33],
    ),
    "gpt-oss-20b": (
        "",
        "gpt_oss",
        2880,
        24,
        201088,
        "GQA",
        64,
        8,
        32,
        4,
        {"full_attention": 12, "sliding_attention": 12},
        [1, 6, 11, 16, 21],
    ),
}


def _config_dirs() -> list[str]:
    d = models_dir()
    return sorted(p.parent.name for p in d.glob("*/config.json")) if d else []


def test_every_config_in_the_corpus_has_expectations(real_models_dir):
    assert set(_config_dirs()) == set(EXPECTED), "add a row to EXPECTED for each new config.json"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_probe_real_config(name, real_models_dir):
    target = real_models_dir / name
    if not (target / "config.json").is_file():
        pytest.skip(f"{target} not present")
    path, mtype, hidden, layers, vocab, kind, heads, kv, n_exp, topk, lt_counts, ids = EXPECTED[name]
    rec = probe_target(target, block_size=16, num_draft_layers=5, strict=False)
    validate_probe(rec)
    assert rec["schema_version"] == PROBE_SCHEMA_VERSION
    assert rec["text_config_path"] == path
    assert rec["model_type"] == mtype
    assert (rec["hidden_size"], rec["num_hidden_layers"], rec["vocab_size"]) == (hidden, layers, vocab)
    assert rec["embedding_rows"] == vocab  # no weights: the config's vocab_size
    assert rec["attention"]["kind"] == kind
    assert (rec["num_attention_heads"], rec["num_key_value_heads"]) == (heads, kv)
    if n_exp is None:
        assert rec["moe"] is None
    else:
        assert (rec["moe"]["num_experts"], rec["moe"]["num_experts_per_tok"]) == (n_exp, topk)
    if lt_counts is not None:
        assert rec["layer_type_counts"] == lt_counts
        assert len(rec["layer_types"]) == layers
    assert rec["drafter"]["target_layer_ids"] == ids
    assert rec["drafter"]["hf_hidden_state_indices"] == [i + 1 for i in ids]
    assert rec["tie_word_embeddings"] is (name == "gemma-4-26B-A4B")
    # none of these directories ship a vocabulary file, so the tokenizer is reported missing
    assert rec["tokenizer"]["present"] is False
    assert rec["drafter"]["mask_token_id"] is None and "unresolved" in rec["drafter"]["mask_token_source"]


def test_mla_details_deepseek_v3(real_models_dir):
    rec = probe_target(real_models_dir / "DeepSeek-V3", block_size=16, num_draft_layers=5, strict=False)
    att = rec["attention"]
    assert (
        att["kv_lora_rank"],
        att["q_lora_rank"],
        att["qk_nope_head_dim"],
        att["qk_rope_head_dim"],
        att["v_head_dim"],
    ) == (512, 1536, 128, 64, 128)
    assert rec["head_dim"] == 192
    assert rec["moe"]["num_experts_source"] == "n_routed_experts"
    assert rec["moe"]["num_shared_experts"] == 1 and rec["moe"]["first_k_dense_replace"] == 3
    assert rec["rope"]["type"] == "yarn" and rec["rope"]["theta"] == 10000
    assert rec["dtype"] == "bfloat16" and rec["max_position_embeddings"] == 163840


def test_nested_kimi_k25(real_models_dir):
    rec = probe_target(real_models_dir / "Kimi-K2.5", block_size=16, num_draft_layers=5, strict=False)
    assert rec["model_type"] == "kimi_k25"
    assert rec["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert rec["text_config_path"] == "text_config"
    assert rec["text_model_type"] == "kimi_k2"
    assert rec["text_architectures"] == ["DeepseekV3ForCausalLM"]
    assert rec["max_position_embeddings"] == 262144


def test_remote_code_config_falls_back_to_raw_json(real_models_dir):
    rec = probe_target(real_models_dir / "Kimi-K2-Instruct", block_size=16, num_draft_layers=5, strict=False)
    assert rec["config_source"]["loader"] == "raw_json"
    assert rec["config_source"]["autoconfig_error"]
    assert any("raw JSON" in w for w in rec["warnings"])
    assert rec["trust_remote_code"] is False


def test_moe_names_normalized(real_models_dir):
    srcs = {}
    for name in ("DeepSeek-V3", "Qwen3-30B-A3B", "gpt-oss-20b", "gemma-4-26B-A4B"):
        rec = probe_target(real_models_dir / name, block_size=16, num_draft_layers=5, strict=False)
        srcs[name] = (rec["moe"]["num_experts_source"], rec["moe"]["num_experts_per_tok_source"])
    assert srcs["DeepSeek-V3"] == ("n_routed_experts", "num_experts_per_tok")
    assert srcs["Qwen3-30B-A3B"] == ("num_experts", "num_experts_per_tok")
    assert srcs["gpt-oss-20b"] == ("num_local_experts", "num_experts_per_tok")
    assert srcs["gemma-4-26B-A4B"] == ("text_config.num_experts", "text_config.top_k_experts") or srcs[
        "gemma-4-26B-A4B"
    ] == ("num_experts", "top_k_experts")


def test_generation_config_eos_without_tokenizer(real_models_dir):
    # gpt-oss-20b ships tokenizer_config.json but no vocabulary file, and several eos ids
    rec = probe_target(real_models_dir / "gpt-oss-20b", block_size=16, num_draft_layers=5, strict=False)
    assert rec["tokenizer"]["present"] is False
    assert "without a vocabulary file" in rec["tokenizer"]["missing_reason"]
    assert rec["generation_config_eos_token_ids"] == [200002, 199999]
    assert rec["eos_token_ids"] == [200002, 199999]


def test_missing_tokenizer_is_an_error_by_default(real_models_dir):
    with pytest.raises(ProbeError, match="tokenizer"):
        probe_target(real_models_dir / "Qwen3-8B", block_size=16, num_draft_layers=5)
    # an explicit mask id needs no tokenizer; it must still lie inside the embedding
    rec = probe_target(
        real_models_dir / "Qwen3-8B", block_size=16, num_draft_layers=5, mask_token_id=151669, strict=False
    )
    assert rec["drafter"]["mask_token_id"] == 151669
    with pytest.raises(ConfigError, match=r"drafter.mask_token_id.*0\.\.151935"):
        probe_target(
            real_models_dir / "Qwen3-8B", block_size=16, num_draft_layers=5, mask_token_id=151936, strict=False
        )


@pytest.mark.parametrize(
    "ids, match",
    [
        ([1, 9, 61], r"\[61\] out of range.*0\.\.59"),
        ([1, 9, 9], r"duplicated ids \[9\].*0\.\.59"),
        ([-1, 3], r"out of range.*0\.\.59"),
        ([17, 1, 9], r"not in ascending order; use \[1, 9, 17\].*layer order"),
        ([1, 60], r"60 is the last decoder layer.*after the final norm"),
    ],
)
def test_bad_layer_ids(ids, match, real_models_dir):
    with pytest.raises(ConfigError, match=match):
        probe_target(
            real_models_dir / "DeepSeek-V3", block_size=16, num_draft_layers=5, target_layer_ids=ids, strict=False
        )


def test_explicit_layer_ids_and_k_decoupled_from_draft_layers(real_models_dir):
    rec = probe_target(
        real_models_dir / "DeepSeek-V3", block_size=8, num_draft_layers=2, target_layer_ids=[0, 30, 59], strict=False
    )
    d = rec["drafter"]
    assert d["target_layer_ids"] == [0, 30, 59] and d["hf_hidden_state_indices"] == [1, 31, 60]
    assert d["num_target_features"] == 3 and d["target_layer_ids_source"].startswith("explicit")
    rec = probe_target(
        real_models_dir / "Qwen3.5-35B-A3B", block_size=16, num_draft_layers=8, num_target_features=5, strict=False
    )
    assert rec["drafter"]["target_layer_ids"] == [1, 10, 19, 28, 37]  # released Qwen3.5-35B-A3B drafter


def test_unusable_config_errors(tmp_path):
    with pytest.raises(ProbeError, match="config.json: not found"):
        probe_target(tmp_path, block_size=16, num_draft_layers=5)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ProbeError, match="not readable JSON"):
        probe_target(tmp_path, block_size=16, num_draft_layers=5)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "x", "vision_config": {"hidden_size": 3, "num_hidden_layers": 2}})
    )
    with pytest.raises(ProbeError, match="no language-model config"):
        probe_target(tmp_path, block_size=16, num_draft_layers=5)


def test_deeply_nested_text_config(tmp_path):
    cfg = {
        "model_type": "omni_like",
        "thinker_config": {
            "model_type": "thinker",
            "audio_config": {"hidden_size": 1, "num_hidden_layers": 1},
            "text_config": {
                "model_type": "qwen3",
                "hidden_size": 256,
                "num_hidden_layers": 12,
                "vocab_size": 1000,
                "num_attention_heads": 4,
            },
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rec = probe_target(tmp_path, block_size=4, num_draft_layers=1, strict=False)
    validate_probe(rec)
    assert rec["text_config_path"] == "thinker_config.text_config"
    assert (rec["hidden_size"], rec["num_hidden_layers"], rec["vocab_size"]) == (256, 12, 1000)
    assert rec["attention"]["kind"] == "MHA" and rec["head_dim"] == 64
    assert rec["drafter"]["target_layer_ids"] == [6]
    assert rec["config_source"]["loader"] == "raw_json"


# --------------------------------------------------------------------------------------------------
# mask token resolution


def test_mask_token_resolution_order():
    tok = {"present": True, "len": 151669, "mask_token": None, "mask_token_id": None}
    assert resolve_mask_token_id(explicit=None, tokenizer=tok, embedding_rows=151936)[0] == 151669
    assert resolve_mask_token_id(explicit=7, tokenizer=tok, embedding_rows=151936) == (
        7,
        "explicit (drafter.mask_token_id)",
    )
    with_mask = dict(tok, mask_token="<mask>", mask_token_id=5)
    mid, why = resolve_mask_token_id(explicit=None, tokenizer=with_mask, embedding_rows=151936)
    assert mid == 5 and "tokenizer mask token" in why
    full = dict(tok, len=151936)
    with pytest.raises(ProbeError, match="drafter.mask_token_id"):
        resolve_mask_token_id(explicit=None, tokenizer=full, embedding_rows=151936)
    with pytest.raises(ConfigError, match="outside the target embedding"):
        resolve_mask_token_id(explicit=151936, tokenizer=tok, embedding_rows=151936)


# --------------------------------------------------------------------------------------------------
# the demo target: full record with tokenizer


def test_probe_demo_target(demo_target):
    facts = json.loads((demo_target / "demo_target.json").read_text())
    rec = probe_target(demo_target, block_size=8, num_draft_layers=3)
    validate_probe(rec)
    assert rec["model_type"] == "qwen3" and rec["text_config_path"] == ""
    assert rec["config_source"]["loader"] == "AutoConfig"
    assert (rec["hidden_size"], rec["num_hidden_layers"], rec["vocab_size"]) == (128, 8, facts["vocab_size"])
    assert rec["embedding_rows"] == facts["vocab_size"]
    assert rec["embedding_rows_source"].startswith("safetensors header")
    assert (rec["num_attention_heads"], rec["num_key_value_heads"], rec["head_dim"]) == (4, 2, 32)
    assert rec["attention"]["kind"] == "GQA" and rec["moe"] is None
    assert rec["tie_word_embeddings"] is True
    tok = rec["tokenizer"]
    assert tok["present"] and tok["backend"] == "fast" and tok["len"] == facts["len_tokenizer"]
    assert tok["chat_template"] and tok["template_uses_thinking"]
    assert tok["bos_token_id"] is None and tok["remote_code"] is False and tok["trust_remote_code_used"] is False
    im_end, eot = tok["eos_token_id"], tok["pad_token_id"]
    assert rec["eos_token_ids"] == [im_end, eot]  # tokenizer eos, then generation_config's second id
    assert tok["thinking_markers"]["open"]["id"] is not None
    assert tok["thinking_markers"]["close"]["id"] == tok["thinking_markers"]["open"]["id"] + 1
    d = rec["drafter"]
    assert d["target_layer_ids"] == [1, 3, 5] and d["hf_hidden_state_indices"] == [2, 4, 6]
    assert d["mask_token_id"] == facts["len_tokenizer"] < facts["vocab_size"]
    assert "first embedding row past the real tokens" in d["mask_token_source"]
    assert d["block_size"] == 8 and d["num_draft_layers"] == 3


def test_write_probe_is_atomic_and_stable(demo_target, tmp_path):
    rec = probe_target(demo_target, block_size=16, num_draft_layers=5)
    out = tmp_path / "probe" / "target.json"
    assert write_probe(rec, out) is True
    again = probe_target(demo_target, block_size=16, num_draft_layers=5)
    assert write_probe(again, out) is False  # identical bytes: file (and its mtime) untouched
    on_disk = json.loads(out.read_text())
    validate_probe(on_disk)
    assert "probe_seconds" not in on_disk
    assert [p.name for p in out.parent.iterdir()] == ["target.json"]


def test_cli_prints_summary_and_json(demo_target, capsys):
    assert main([str(demo_target), "--block-size", "8", "--num-draft-layers", "2"]) == 0
    cap = capsys.readouterr()
    rec = json.loads(cap.out)
    validate_probe(rec)
    assert rec["drafter"]["target_layer_ids"] == [1, 5]
    assert "mask token" in cap.err and "qwen3" in cap.err
    assert main([str(demo_target), "--target-layer-ids", "1,8"]) == 2
    assert "0..6" in capsys.readouterr().err


def test_probe_never_reads_weights(demo_target, tmp_path):
    """A 600 GB sparse weight file: only its header is read, well under a second."""
    target = tmp_path / "huge"
    target.mkdir()
    for f in demo_target.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, target / f.name)
    rows = json.loads((demo_target / "config.json").read_text())["vocab_size"]
    header = json.dumps(
        {"model.embed_tokens.weight": {"dtype": "BF16", "shape": [rows, 128], "data_offsets": [0, rows * 128 * 2]}}
    ).encode()
    index = {
        "metadata": {"total_size": 600 * 2**30},
        "weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": "model-00002-of-00002.safetensors",
        },
    }
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    for i in (1, 2):
        with open(target / f"model-0000{i}-of-00002.safetensors", "wb") as fh:
            fh.write(struct.pack("<Q", len(header)) + header)
        os.truncate(target / f"model-0000{i}-of-00002.safetensors", 300 * 2**30)
    probe_target(target, block_size=16, num_draft_layers=5)  # warm imports
    t0 = time.perf_counter()
    rec = probe_target(target, block_size=16, num_draft_layers=5)
    assert time.perf_counter() - t0 < 1.0
    assert rec["embedding_rows"] == rows and "model-00001-of-00002" in rec["embedding_rows_source"]


# --------------------------------------------------------------------------------------------------
# tokenizer errors that name the fix


def _remote_tokenizer_dir(tmp_path: Path, demo_target: Path, module_src: str) -> Path:
    target = tmp_path / "remote"
    target.mkdir()
    shutil.copy(demo_target / "config.json", target / "config.json")
    (target / "tiktoken.model").write_text("")
    (target / "tokenization_tiny.py").write_text(module_src)
    (target / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "TinyTokenizer",
                "auto_map": {"AutoTokenizer": ["tokenization_tiny.TinyTokenizer", None]},
            }
        )
    )
    return target


def test_remote_code_tokenizer_needs_trust_remote_code(tmp_path, demo_target):
    target = _remote_tokenizer_dir(tmp_path, demo_target, "raise RuntimeError('must not be imported')\n")
    with pytest.raises(ProbeError, match=r"target.trust_remote_code: true"):
        probe_target(target, block_size=16, num_draft_layers=5)


def test_missing_tiktoken_names_package_and_env(tmp_path, demo_target, monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # `import tiktoken` now fails as if not installed
    src = "import tiktoken\nfrom transformers import PreTrainedTokenizer\nclass TinyTokenizer(PreTrainedTokenizer):\n    pass\n"
    target = _remote_tokenizer_dir(tmp_path, demo_target, src)
    with pytest.raises(ProbeError, match=r"`tiktoken`.*envs/probe.yaml"):
        probe_target(target, block_size=16, num_draft_layers=5, trust_remote_code=True)


def test_missing_chat_template_names_the_key(tmp_path, demo_target):
    target = tmp_path / "notemplate"
    shutil.copytree(demo_target, target)
    (target / "chat_template.jinja").unlink()
    with pytest.raises(ConfigError, match="target.chat_template"):
        probe_target(target, block_size=16, num_draft_layers=5)
    rec = probe_target(target, block_size=16, num_draft_layers=5, strict=False)
    assert rec["tokenizer"]["chat_template"] is False and any("chat_template" in w for w in rec["warnings"])
    rec = probe_target(target, block_size=16, num_draft_layers=5, chat_template=demo_target / "chat_template.jinja")
    validate_probe(rec)
    assert rec["tokenizer"]["chat_template"] and rec["tokenizer"]["chat_template_source"].startswith("override")


# --------------------------------------------------------------------------------------------------
# tokenizer backends built locally: Kimi-style tiktoken + remote code, and sentencepiece

#: A small Kimi-style tokenizer module (shipped next to the weights and named in tokenizer_config.json's
#: auto_map): tiktoken BPE ranks from ``tiktoken.model`` plus a block of reserved special tokens after the
#: base vocabulary, named by ``added_tokens_decoder`` — the structure of Kimi's tokenization_kimi.py.
TIKTOKEN_TOKENIZER_MODULE = r'''
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer

PAT_STR = r"""[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class TinyTikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]
    num_reserved_special_tokens = 16

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token=None, pad_token=None,
                 added_tokens_decoder=None, **kwargs):
        names = {int(i): getattr(t, "content", t) for i, t in (added_tokens_decoder or {}).items()}
        self.vocab_file = vocab_file
        ranks = load_tiktoken_bpe(vocab_file)
        n = len(ranks)
        self.special_tokens = {names.get(i, f"<|reserved_token_{i}|>"): i
                               for i in range(n, n + self.num_reserved_special_tokens)}
        self.model = tiktoken.Encoding(name=Path(vocab_file).name, pat_str=PAT_STR, mergeable_ranks=ranks,
                                       special_tokens=self.special_tokens)
        enc = _bytes_to_unicode()
        self.decoder = {i: "".join(enc[b] for b in self.model.decode_single_token_bytes(i))
                        for i in range(self.model.n_vocab)}
        self.encoder = {v: k for k, v in self.decoder.items()}
        self.byte_decoder = {v: k for k, v in enc.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         added_tokens_decoder=added_tokens_decoder, **kwargs)

    @property
    def vocab_size(self):
        return self.model.n_vocab

    def get_vocab(self):
        return dict(self.encoder)

    def _tokenize(self, text, **kwargs):
        return [self.decoder[t] for t in self.model.encode(text, allowed_special="all")]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.encoder.get(str(self.unk_token)))

    def _convert_id_to_token(self, index):
        return self.decoder.get(index)

    def convert_tokens_to_string(self, tokens):
        return bytearray(self.byte_decoder[c] for c in "".join(tokens)).decode("utf-8", "replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return (self.vocab_file,)
'''

KIMI_SPECIALS = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "[EOT]",
    "<think>",
    "</think>",
    "[PAD]",
    "[UNK]",
]
#: Kimi-K2-Thinking's chat template shape (role markers, <|im_middle|>, <think> in assistant turns).
KIMI_STYLE_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif m.role == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|><think>{{ m.reasoning_content or '' }}</think>{%- endif -%}"
    "{{ m.content }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def _sparse_weights(target: Path, rows: int, hidden: int, total_gb: int, n_files: int = 2) -> None:
    """Safetensors index + ``n_files`` sparse shards totalling ``total_gb`` GiB: a real JSON header naming
    the embedding, then a hole. Reading any tensor data would take minutes; the probe reads the header."""
    header = json.dumps(
        {
            "model.embed_tokens.weight": {
                "dtype": "BF16",
                "shape": [rows, hidden],
                "data_offsets": [0, rows * hidden * 2],
            }
        }
    ).encode()
    names = [f"model-{i:05d}-of-{n_files:05d}.safetensors" for i in range(1, n_files + 1)]
    index = {
        "metadata": {"total_size": total_gb * 2**30},
        "weight_map": {"model.embed_tokens.weight": names[0], "lm_head.weight": names[-1]},
    }
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in names:
        with open(target / name, "wb") as fh:
            fh.write(struct.pack("<Q", len(header)) + header)
        os.truncate(target / name, total_gb * 2**30 // n_files)


@pytest.fixture(scope="module")
def kimi_style_dir(tmp_path_factory) -> Path:
    """A Kimi-style target directory built here: Kimi-K2's config shape (kimi_k2, MLA + 384 experts, an
    AutoConfig auto_map whose configuration_deepseek.py is *not* shipped), a tiktoken BPE ranks file of our
    own, the tokenizer module named in tokenizer_config.json's auto_map, generation_config.json with a
    second eos id, and 548 GB of sparse placeholder weights."""
    import base64

    target = tmp_path_factory.mktemp("kimi") / "Kimi-tiny"
    target.mkdir()
    ranks = {bytes([b]): b for b in range(256)}
    for merge in (b"th", b"he", b"in", b"er", b"an", b" t", b" a", b"the", b" the", b"ing", b"at", b"is", b" is"):
        ranks.setdefault(merge, len(ranks))
    (target / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    n = len(ranks)
    (target / "tokenization_tiny_kimi.py").write_text(TIKTOKEN_TOKENIZER_MODULE)
    added = {
        str(n + i): {
            "content": tok,
            "special": True,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        }
        for i, tok in enumerate(KIMI_SPECIALS)
    }
    (target / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "TinyTikTokenTokenizer",
                "auto_map": {"AutoTokenizer": ["tokenization_tiny_kimi.TinyTikTokenTokenizer", None]},
                "bos_token": "[BOS]",
                "eos_token": "[EOS]",
                "pad_token": "[PAD]",
                "unk_token": "[UNK]",
                "added_tokens_decoder": added,
                "model_max_length": 262144,
            }
        )
    )
    (target / "chat_template.jinja").write_text(KIMI_STYLE_TEMPLATE)
    (target / "generation_config.json").write_text(json.dumps({"bos_token_id": n, "eos_token_id": n + 2}))
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        },
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 384,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "moe_intermediate_size": 2048,
        "vocab_size": 512,
        "bos_token_id": n,
        "eos_token_id": n + 1,
        "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    (target / "config.json").write_text(json.dumps(cfg))
    _sparse_weights(target, rows=512, hidden=7168, total_gb=548, n_files=4)
    return target


def test_kimi_style_tiktoken_remote_code_tokenizer(kimi_style_dir):
    rec = probe_target(kimi_style_dir, block_size=16, num_draft_layers=5, trust_remote_code=True)
    n = 256 + 13  # byte tokens + merges in tiktoken.model; the 16 reserved specials follow
    ids = {tok: n + i for i, tok in enumerate(KIMI_SPECIALS)}
    tok = rec["tokenizer"]
    assert tok["class"] == "TinyTikTokenTokenizer" and tok["module"].endswith("tokenization_tiny_kimi")
    assert (tok["backend"], tok["runtime"], tok["vocab_file"]) == ("tiktoken", "python", "tiktoken.model")
    assert tok["len"] == n + 16 and tok["base_vocab_size"] == n + 16
    assert (tok["bos_token_id"], tok["eos_token_id"], tok["pad_token_id"], tok["unk_token_id"]) == (
        ids["[BOS]"],
        ids["[EOS]"],
        ids["[PAD]"],
        ids["[UNK]"],
    )
    # several eos ids: the tokenizer's [EOS] and generation_config's <|im_end|>
    assert rec["eos_token_ids"] == [ids["[EOS]"], ids["<|im_end|>"]]
    assert tok["chat_template"] and tok["chat_template_source"] == "tokenizer" and tok["template_uses_thinking"]
    assert tok["thinking_markers"] == {
        "open": {"token": "<think>", "id": ids["<think>"]},
        "close": {"token": "</think>", "id": ids["</think>"]},
    }
    assert tok["remote_code"] is True and tok["trust_remote_code_used"] is True and rec["trust_remote_code"] is True
    # the config's own remote code (configuration_deepseek.py) is absent: raw JSON, and the tokenizer still loads
    assert rec["config_source"]["loader"] == "raw_json" and rec["model_type"] == "kimi_k2"
    assert rec["attention"]["kind"] == "MLA" and rec["moe"]["num_experts"] == 384
    assert rec["embedding_rows"] == 512 and "model-00001-of-00004" in rec["embedding_rows_source"]
    assert rec["drafter"]["target_layer_ids"] == [1, 15, 30, 44, 58]
    assert rec["drafter"]["mask_token_id"] == n + 16  # first embedding row past the real tokens
    # and it is a working tokenizer: the probe saw the same object the pipeline will render with
    from transformers import AutoTokenizer, PretrainedConfig

    t = AutoTokenizer.from_pretrained(
        str(kimi_style_dir), trust_remote_code=True, local_files_only=True, config=PretrainedConfig()
    )
    text = "the thing is <think>x</think>"
    ids_ = t.encode(text, add_special_tokens=False)
    assert ids["<think>"] in ids_ and t.decode(ids_) == text
    assert "tiktoken" in summary(rec) and "remote code" in summary(rec)


def test_kimi_style_needs_trust_remote_code(kimi_style_dir):
    with pytest.raises(ProbeError, match=r"target.trust_remote_code: true"):
        probe_target(kimi_style_dir, block_size=16, num_draft_layers=5)


def test_probe_of_548_gb_target_reads_metadata_only(kimi_style_dir):
    """548 GB of sparse weight shards (Kimi K2's size): the probe reads one safetensors header, well
    under a second (after the one-off imports and the remote module's first compile)."""
    total = sum(f.stat().st_size for f in kimi_style_dir.glob("*.safetensors"))
    assert total == 548 * 2**30
    probe_target(kimi_style_dir, block_size=16, num_draft_layers=5, trust_remote_code=True)  # warm imports
    t0 = time.perf_counter()
    rec = probe_target(kimi_style_dir, block_size=16, num_draft_layers=5, trust_remote_code=True)
    assert time.perf_counter() - t0 < 1.0
    assert rec["embedding_rows"] == 512


def test_cli_on_kimi_style_dir(kimi_style_dir, capsys):
    assert main([str(kimi_style_dir), "--trust-remote-code"]) == 0
    cap = capsys.readouterr()
    validate_probe(json.loads(cap.out))
    assert "TinyTikTokenTokenizer (backend tiktoken, from tiktoken.model)" in cap.err
    assert "MLA" in cap.err and "384 experts" in cap.err
    assert main([str(kimi_style_dir)]) == 2 and "--trust-remote-code" in capsys.readouterr().err


def _sentencepiece_dir(target: Path) -> Path:
    """A Llama-style target with only a sentencepiece ``tokenizer.model`` (no tokenizer.json), trained here."""
    import io

    import sentencepiece as spm

    target.mkdir(parents=True)
    lines = [json.loads(l)["question"] for l in (REPO_DATA / "gsm8k" / "train.jsonl").read_text().splitlines()[:300]]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=300,
        model_type="bpe",
        user_defined_symbols=["<think>", "</think>", "<|im_start|>", "<|im_end|>"],
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    (target / "tokenizer.model").write_bytes(model.getvalue())
    (target / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}",
            }
        )
    )
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 6]}))
    (target / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 64,
                "num_hidden_layers": 8,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 128,
                "vocab_size": 320,
            }
        )
    )
    return target


REPO_DATA = Path(__file__).resolve().parents[3] / "data"


def test_sentencepiece_tokenizer(tmp_path):
    pytest.importorskip("sentencepiece")
    pytest.importorskip("google.protobuf")
    target = _sentencepiece_dir(tmp_path / "sp")
    rec = probe_target(target, block_size=8, num_draft_layers=2)
    tok = rec["tokenizer"]
    assert (tok["backend"], tok["vocab_file"], tok["runtime"]) == ("sentencepiece", "tokenizer.model", "tokenizers")
    assert tok["class"] == "LlamaTokenizer" and tok["remote_code"] is False and tok["len"] == 300
    assert (tok["bos_token_id"], tok["eos_token_id"]) == (1, 2)
    assert rec["eos_token_ids"] == [2, 6]
    assert tok["thinking_markers"] == {"open": {"token": "<think>", "id": 3}, "close": {"token": "</think>", "id": 4}}
    assert tok["chat_template"] and rec["drafter"]["mask_token_id"] == 300 and rec["embedding_rows"] == 320


def test_missing_sentencepiece_names_packages_and_env(tmp_path, monkeypatch):
    target = tmp_path / "sp"
    target.mkdir()
    (target / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "num_hidden_layers": 8,
                "num_attention_heads": 4,
                "vocab_size": 320,
            }
        )
    )
    (target / "tokenizer.model").write_bytes(
        b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02"
    )  # a protobuf, not BPE ranks
    (target / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # `import sentencepiece` now fails
    with pytest.raises(ProbeError, match=r"`sentencepiece`.*pip install .*envs/probe.yaml"):
        probe_target(target, block_size=16, num_draft_layers=5)
