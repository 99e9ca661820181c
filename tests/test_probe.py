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

from dflash_pipeline.contracts import PROBE_SCHEMA_VERSION
from dflash_pipeline.errors import ConfigError, ProbeError
from dflash_pipeline.probe import (
    build_target_layer_ids,
    hf_hidden_state_index,
    main,
    probe_target,
    resolve_mask_token_id,
    validate_probe,
    write_probe,
)

from conftest import models_dir

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
    "MiniMax-M2.7": ("", "minimax_m2", 3072, 62, 200064, "GQA", 48, 8, 256, 8, {"full_attention": 62},
                     [1, 16, 30, 44, 59]),
    "Qwen2.5-7B": ("", "qwen2", 3584, 28, 152064, "GQA", 28, 4, None, None, None, [1, 7, 13, 19, 25]),
    "Qwen3-30B-A3B": ("", "qwen3_moe", 2048, 48, 151936, "GQA", 32, 4, 128, 8, None, [1, 12, 23, 34, 45]),
    "Qwen3-8B": ("", "qwen3", 4096, 36, 151936, "GQA", 32, 8, None, None, None, [1, 9, 17, 25, 33]),
    "Qwen3-Next-80B-A3B-Thinking": ("", "qwen3_next", 2048, 48, 151936, "GQA", 16, 2, 512, 10,
                                    {"full_attention": 12, "linear_attention": 36}, [1, 12, 23, 34, 45]),
    "Qwen3-VL-32B-Instruct": ("text_config", "qwen3_vl", 5120, 64, 151936, "GQA", 64, 8, None, None, None,
                              [1, 16, 31, 46, 61]),
    "Qwen3.5-27B": ("text_config", "qwen3_5", 5120, 64, 248320, "GQA", 24, 4, None, None,
                    {"full_attention": 16, "linear_attention": 48}, [1, 16, 31, 46, 61]),
    "Qwen3.5-35B-A3B": ("text_config", "qwen3_5_moe", 2048, 40, 248320, "GQA", 16, 2, 256, 8,
                        {"full_attention": 10, "linear_attention": 30}, [1, 10, 19, 28, 37]),
    "gemma-4-26B-A4B": ("text_config", "gemma4", 2816, 30, 262144, "GQA", 16, 8, 128, 8,
                        {"full_attention": 5, "sliding_attention": 25}, [1, 8, 14, 20, 27]),
    "gpt-oss-120b": ("", "gpt_oss", 2880, 36, 201088, "GQA", 64, 8, 128, 4,
                     {"full_attention": 18, "sliding_attention": 18}, [1, 9, 17, 25, 33]),
    "gpt-oss-20b": ("", "gpt_oss", 2880, 24, 201088, "GQA", 64, 8, 32, 4,
                    {"full_attention": 12, "sliding_attention": 12}, [1, 6, 11, 16, 21]),
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
    rec = probe_target(real_models_dir / "DeepSeek-V3", block_size=16, num_draft_layers=5,
                       strict=False)
    att = rec["attention"]
    assert (att["kv_lora_rank"], att["q_lora_rank"], att["qk_nope_head_dim"], att["qk_rope_head_dim"],
            att["v_head_dim"]) == (512, 1536, 128, 64, 128)
    assert rec["head_dim"] == 192
    assert rec["moe"]["num_experts_source"] == "n_routed_experts"
    assert rec["moe"]["num_shared_experts"] == 1 and rec["moe"]["first_k_dense_replace"] == 3
    assert rec["rope"]["type"] == "yarn" and rec["rope"]["theta"] == 10000
    assert rec["dtype"] == "bfloat16" and rec["max_position_embeddings"] == 163840


def test_nested_kimi_k25(real_models_dir):
    rec = probe_target(real_models_dir / "Kimi-K2.5", block_size=16, num_draft_layers=5,
                       strict=False)
    assert rec["model_type"] == "kimi_k25"
    assert rec["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert rec["text_config_path"] == "text_config"
    assert rec["text_model_type"] == "kimi_k2"
    assert rec["text_architectures"] == ["DeepseekV3ForCausalLM"]
    assert rec["max_position_embeddings"] == 262144


def test_remote_code_config_falls_back_to_raw_json(real_models_dir):
    rec = probe_target(real_models_dir / "Kimi-K2-Instruct", block_size=16, num_draft_layers=5,
                       strict=False)
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
    assert srcs["gemma-4-26B-A4B"] == ("text_config.num_experts", "text_config.top_k_experts") or \
        srcs["gemma-4-26B-A4B"] == ("num_experts", "top_k_experts")


def test_generation_config_eos_without_tokenizer(real_models_dir):
    # gpt-oss-20b ships tokenizer_config.json but no vocabulary file, and several eos ids
    rec = probe_target(real_models_dir / "gpt-oss-20b", block_size=16, num_draft_layers=5,
                       strict=False)
    assert rec["tokenizer"]["present"] is False
    assert "without a vocabulary file" in rec["tokenizer"]["missing_reason"]
    assert rec["generation_config_eos_token_ids"] == [200002, 199999]
    assert rec["eos_token_ids"] == [200002, 199999]


def test_missing_tokenizer_is_an_error_by_default(real_models_dir):
    with pytest.raises(ProbeError, match="tokenizer"):
        probe_target(real_models_dir / "Qwen3-8B", block_size=16, num_draft_layers=5)
    # an explicit mask id needs no tokenizer; it must still lie inside the embedding
    rec = probe_target(real_models_dir / "Qwen3-8B", block_size=16, num_draft_layers=5, mask_token_id=151669,
                       strict=False)
    assert rec["drafter"]["mask_token_id"] == 151669
    with pytest.raises(ConfigError, match=r"drafter.mask_token_id.*0\.\.151935"):
        probe_target(real_models_dir / "Qwen3-8B", block_size=16, num_draft_layers=5, mask_token_id=151936,
                     strict=False)


@pytest.mark.parametrize("ids, match", [([1, 9, 61], r"\[61\] out of range.*0\.\.60"),
                                        ([1, 9, 9], r"duplicated ids \[9\].*0\.\.60"),
                                        ([-1, 3], r"out of range.*0\.\.60")])
def test_bad_layer_ids(ids, match, real_models_dir):
    with pytest.raises(ConfigError, match=match):
        probe_target(real_models_dir / "DeepSeek-V3", block_size=16, num_draft_layers=5, target_layer_ids=ids,
                     strict=False)


def test_explicit_layer_ids_and_k_decoupled_from_draft_layers(real_models_dir):
    rec = probe_target(real_models_dir / "DeepSeek-V3", block_size=8, num_draft_layers=2,
                       target_layer_ids=[0, 30, 60], strict=False)
    d = rec["drafter"]
    assert d["target_layer_ids"] == [0, 30, 60] and d["hf_hidden_state_indices"] == [1, 31, 61]
    assert d["num_target_features"] == 3 and d["target_layer_ids_source"].startswith("explicit")
    rec = probe_target(real_models_dir / "Qwen3.5-35B-A3B", block_size=16, num_draft_layers=8,
                       num_target_features=5, strict=False)
    assert rec["drafter"]["target_layer_ids"] == [1, 10, 19, 28, 37]  # released Qwen3.5-35B-A3B drafter


def test_unusable_config_errors(tmp_path):
    with pytest.raises(ProbeError, match="config.json: not found"):
        probe_target(tmp_path, block_size=16, num_draft_layers=5)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ProbeError, match="not readable JSON"):
        probe_target(tmp_path, block_size=16, num_draft_layers=5)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x", "vision_config": {"hidden_size": 3,
                                                                                          "num_hidden_layers": 2}}))
    with pytest.raises(ProbeError, match="no language-model config"):
        probe_target(tmp_path, block_size=16, num_draft_layers=5)


def test_deeply_nested_text_config(tmp_path):
    cfg = {"model_type": "omni_like", "thinker_config": {"model_type": "thinker",
           "audio_config": {"hidden_size": 1, "num_hidden_layers": 1},
           "text_config": {"model_type": "qwen3", "hidden_size": 256, "num_hidden_layers": 12,
                           "vocab_size": 1000, "num_attention_heads": 4}}}
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
        7, "explicit (drafter.mask_token_id)")
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
    assert "0..7" in capsys.readouterr().err


def test_probe_never_reads_weights(demo_target, tmp_path):
    """A 600 GB sparse weight file: only its header is read, well under a second."""
    target = tmp_path / "huge"
    target.mkdir()
    for f in demo_target.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, target / f.name)
    rows = json.loads((demo_target / "config.json").read_text())["vocab_size"]
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "BF16", "shape": [rows, 128],
                                                       "data_offsets": [0, rows * 128 * 2]}}).encode()
    index = {"metadata": {"total_size": 600 * 2**30},
             "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
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
    (target / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "TinyTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_tiny.TinyTokenizer", None]}}))
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
