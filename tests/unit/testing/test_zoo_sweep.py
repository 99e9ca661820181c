"""Every causal LM transformers ships (:mod:`dflash_pipeline.testing.zoo_extra`): each model type probes right
from its config class's defaults or is refused with the reason, never a crash or a raw attribute error; the
supported-types page is the generator's output; a sample runs the whole in-process pipeline (DeepSeek-V4's
hyper-connection streams, ZAYA's hybrid cache, and a rotating pick), and their speculative output equals
the target's greedy output."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import transformers
from conftest import GSM8K_TRAIN, REPO_ROOT

from dflash_pipeline.evaluate.acceptance import speculative_generate
from dflash_pipeline.probe.checks import REASONS
from dflash_pipeline.target import loading as T
from dflash_pipeline.target.chat import load_tokenizer, render
from dflash_pipeline.testing import zoo, zoo_extra
from dflash_pipeline.train.run import build_drafter


@pytest.fixture(scope="module")
def rows() -> list[zoo_extra.SweepRow]:
    return zoo_extra.sweep()


def test_every_causal_lm_type_probes_right_or_is_refused_with_a_reason(rows):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    by_type = {r.model_type: r for r in rows}
    assert set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) <= set(by_type)
    assert sum(r.kind == "image-text" for r in rows) >= 40  # the wrappers around a decoder
    assert [r for r in rows if r.status not in ("ok", "refused")] == []  # no crash, no wrong layer count
    for r in rows:
        if r.status == "refused":
            assert r.reason in REASONS + ("settings",), r
            assert "Traceback" not in r.detail and "AttributeError" not in r.detail, r
    expected = {
        "mamba": "attention-free",
        "rwkv": "attention-free",
        "xlstm": "attention-free",
        "dory": "looped layers",
        "gemma3n": "per-layer values",
        "recurrent_gemma": "no context length",
        "blt": "no language-model config",
        "bart": "encoder-decoder",
        "electra": "embedding width",
        "longcat_flash": "sublayer count",
    }
    assert {t: by_type[t].reason for t in expected} == expected
    # found in config.json alone (listed with the config problems) vs through the config class (the gate)
    assert by_type["mamba"].refused_at == "config.json" and by_type["longcat_flash"].refused_at == "config class"
    for ok in ("deepseek_v4", "zaya", "nemotron_h", "mpt", "qwen3", "kimi_k25", "dots3_note"):
        assert by_type[ok].status == "ok", by_type[ok]
    assert by_type["nemotron_h"].detail.startswith("4 layers")  # len(layers_block_type)


def test_model_types_page_is_the_generators_output(rows):
    """docs/reference/model-types.md is what ``python -m dflash_pipeline.testing.zoo_extra --write`` writes
    (regenerate it after a transformers upgrade or a probe change)."""
    page = (REPO_ROOT / zoo_extra.PAGE).read_text(encoding="utf-8")
    expected = zoo_extra.table_markdown(rows, transformers.__version__)
    assert page == expected, f"regenerate it: python -m dflash_pipeline.testing.zoo_extra --write ({zoo_extra.PAGE})"
    assert "| `deepseek_v4` | causal-lm | `DeepseekV4ForCausalLM` | ok (full pipeline) |" in page


def test_rotating_sample_walks_the_verified_types(rows, monkeypatch):
    pool = ("a", "b", "c", "deepseek_v4")
    picks = {tuple(zoo_extra.rotating_sample(pool, day=datetime.date(2026, 1, d))) for d in range(1, 4)}
    assert picks == {("a",), ("b",), ("c",)}
    monkeypatch.setenv("DFLASH_SWEEP_DAY", "2026-01-02")
    assert zoo_extra.rotating_sample(pool) == zoo_extra.rotating_sample(pool, day=datetime.date(2026, 1, 2))
    ok = {r.model_type for r in rows if r.status == "ok"}
    assert set(zoo_extra.PIPELINE_SAMPLE + zoo_extra.PIPELINE_VERIFIED) <= ok


def _sample() -> list[str]:
    """The full-pipeline sample: :data:`~dflash_pipeline.testing.zoo_extra.PIPELINE_SAMPLE` and today's pick
    (``$DFLASH_SWEEP_DAY`` replays a day) of the verified types."""
    return list(zoo_extra.PIPELINE_SAMPLE) + zoo_extra.rotating_sample()


@pytest.fixture(scope="module")
def stage_run(tmp_path_factory, real_models_dir):
    """``stage_run(model_type) -> (stage results, work dir)``: :func:`zoo.run_stages` on the type's twin, run
    on first use and kept for the module."""
    root = tmp_path_factory.mktemp("sweep")
    eval_set = REPO_ROOT / "data" / "gsm8k" / "test.jsonl"
    done: dict[str, tuple[dict, Path]] = {}

    def get(model_type: str) -> tuple[dict, Path]:
        if model_type not in done:
            work = root / model_type
            res = zoo.run_stages(real_models_dir, zoo_extra.TYPE_PREFIX + model_type, work, GSM8K_TRAIN, eval_set)
            done[model_type] = (res, work)
        return done[model_type]

    return get


@pytest.mark.parametrize("model_type", _sample())
def test_sample_runs_the_whole_in_process_pipeline(stage_run, model_type):
    """Twin build, probe, completions, tokens, train fp32 and bf16, eval: DeepSeek-V4 (hidden states
    [b, t, 4, h], collapsed by its own hc_head), ZAYA (linear-attention layers that record only their last
    recurrent state: snapshotted in the eval loop), and today's pick of the verified types."""
    assert stage_run(model_type)[0] == {s: "ok" for s in zoo.STAGES}


def _greedy(target, prompt: list[int], n: int) -> list[int]:
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(target(input_ids=ids, use_cache=False).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


@pytest.mark.parametrize("model_type", ["deepseek_v4", "zaya"])
def test_speculative_output_equals_greedy(stage_run, model_type):
    """The eval loop on the twins' caches gives the target's own greedy continuation: layers that cannot be
    cut back (DeepSeek-V4's compressed-attention caches; ZAYA's linear attention, which records only its
    last recurrent state) are snapshotted and the accepted tokens re-run (``recompute``)."""
    twin: Path = stage_run(model_type)[1] / "target"
    target, tok = T.load_target(twin, dtype="float32"), load_tokenizer(twin)
    probe = {
        "drafter": {
            "block_size": 4,
            "num_draft_layers": 1,
            "target_layer_ids": [1, T.num_decoder_layers(target) - 2],
            "mask_token_id": len(tok),
        }
    }
    drafter = build_drafter(target, probe).eval()
    msgs = [{"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. How many?"}]
    prompt = render(tok, msgs, thinking="none", add_generation_prompt=True, tokenize=True)
    res = speculative_generate(target, drafter, prompt, block_size=4, max_new_tokens=6)
    assert res.output_ids == _greedy(target, prompt, 6) and res.cache_policy == "recompute"
    hidden = T.hidden_states_of(target, torch.tensor([prompt[:6]])).hidden_states
    assert all(h.shape == (1, 6, T.text_config(target.config).hidden_size) for h in hidden)
