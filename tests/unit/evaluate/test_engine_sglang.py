"""SGLang as the eval engine (issue 26, ``eval.engine: sglang``) against the SGLang-shaped test server:
τ, per-position acceptance and the histogram pooled from each answer's ``meta_info`` (asked with
``return_meta_info``), the engine record (no dtype asked of a running server, and why), engine τ beside the
loop's in the eval record and the closing summary with the verdict; ``[eval-engine]`` lines reach the
console; the vLLM engine is started in the loop's dtype. (SGLang itself needs CUDA: bench/gpu_check.sh.)"""

from __future__ import annotations

import io
import json
import sys

import pytest

from dflash_pipeline.core.config import validate_config
from dflash_pipeline.core.errors import ConfigError
from dflash_pipeline.evaluate import engine_acceptance as EE
from dflash_pipeline.evaluate import engine_vs_loop as EV
from dflash_pipeline.evaluate.outputs import write_eval_table
from dflash_pipeline.evaluate.sglang_engine import histogram_acceptance_stats
from dflash_pipeline.evaluate.vllm_server import loop_dtype, served_dtype_of_log
from dflash_pipeline.report import tables as report
from dflash_pipeline.testing.server import start_test_server
from dflash_pipeline.workflow import policy as workflow
from dflash_pipeline.workflow.problems import problems

PROMPTS = [
    {"prompt_id": "a", "turns": ["one two three four five six seven eight nine", "again please"], "system": None},
    {"prompt_id": "b", "turns": ["a b c d e f g h i j k l m n o p"], "system": "be brief"},
]


def _pooled(results: list[dict]) -> float:
    """Σ (n+1)·h[n] / Σ h over the choices' meta_info histograms."""
    hists = [r["spec_correct_drafts_histogram"] for r in results]
    steps = sum(sum(h) for h in hists)
    return sum((n + 1) * c for h in hists for n, c in enumerate(h)) / steps


def test_server_acceptance_pools_sglang_meta_info_histograms():
    with start_test_server(flavor="sglang", spec_accept_length=2.5, spec_block_size=4) as srv:
        r = EE.server_acceptance(srv.base_url, PROMPTS, max_tokens=64, block_size=4, meta_info=True, max_concurrency=2)
        assert all(b["return_meta_info"] is True for b in srv.stats.requests)
        with pytest.raises(EE.EngineComparisonError, match="no speculative acceptance"):
            EE.server_acceptance(srv.base_url, PROMPTS, max_tokens=64)  # SGLang answers meta_info only when asked
    assert r["source"] == "meta_info" and r["num_responses"] == 3 and set(r["histogram"]) == {"1", "2", "3", "4"}
    n = r["num_steps"]
    assert n == sum(r["histogram"].values())
    assert r["completion_tokens"] == sum(int(k) * v for k, v in r["histogram"].items())
    assert r["tau"] == pytest.approx(r["completion_tokens"] / n)  # pooled over verify steps
    ge = [n] + [sum(v for k, v in r["histogram"].items() if int(k) > a) for a in range(1, 4)]
    assert r["per_position_acceptance"] == pytest.approx([g / n for g in ge[1:]])
    assert r["tau_mean_response"] == pytest.approx(sum(r["per_response"]) / 3) and len(r["per_response"]) == 3


def test_histograms_of_another_drafter_or_without_steps_are_errors():
    assert histogram_acceptance_stats([[1, 2], [0, 1, 1]], None)["histogram"] == {"1": 1, "2": 3, "3": 1}
    with pytest.raises(EE.EngineComparisonError, match="more than block size 2.*num-draft-tokens 3"):
        histogram_acceptance_stats([[0, 1, 1]], 2, base_url="http://h:30000/v1")
    with pytest.raises(EE.EngineComparisonError, match="count no verify step"):
        histogram_acceptance_stats([[0, 0]], 2)


def _eval_cfg(**over) -> dict:
    sets = {"gsm8k": {"path": "data/gsm8k/test.jsonl", "num_samples": 3}}
    return validate_config({"eval": {"max_new_tokens": 24, "sets": sets, **over}})["eval"]


def _drafter(tmp_path, block_size=4):
    d = tmp_path / "final"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "block_size": block_size,
                "num_hidden_layers": 1,  # a drafter's fields
                "dflash_config": {"target_layer_ids": [1], "mask_token_id": 0},
            }
        )
    )
    return d


def _loop_record(engine_record: dict) -> dict:
    """The loop's eval record for the same settings and prompts (its figures made up)."""
    st = engine_record["settings"]
    hist = {"1": 40, "2": 30, "3": 20, "4": 10}
    stats = {
        "tau": 2.0,
        "tokens_per_step": 2.0,
        "histogram": hist,
        "num_steps": 100,
        "num_responses": 3,
        "per_position_acceptance": [0.6, 0.3, 0.1],
    }
    settings = {k: st[k] for k in ("block_size", "max_new_tokens", "temperature", "thinking")}
    return {
        "settings": {**settings, "dtype": "float32"},
        "sets": engine_record["sets"],
        "drafters": {"trained": {"sets": {"gsm8k": stats}, "settings": {**settings, "dtype": "float32"}}},
    }


def test_eval_engine_sglang_writes_engine_tau_beside_ours(tmp_path, capsys):
    with pytest.raises(ConfigError, match="eval.engine: sglang measures τ on a running SGLang server"):
        EE.evaluate_engine(
            target_dir=tmp_path,
            drafter_dir=_drafter(tmp_path),
            eval_cfg=_eval_cfg(engine="sglang"),
            thinking="disable",
            out_json=tmp_path / "x.json",
            log_path=tmp_path / "x.log",
        )
    with start_test_server(flavor="sglang", spec_accept_length=2.0, spec_block_size=4) as srv:
        cfg = _eval_cfg(engine="sglang", engine_base_url=srv.base_url)
        eng = EE.evaluate_engine(
            target_dir=tmp_path,
            drafter_dir=tmp_path / "final",
            eval_cfg=cfg,
            thinking="disable",
            out_json=tmp_path / "engine.json",
            log_path=tmp_path / "engine.log",
        )
        assert srv.stats.chat_requests == 3 and all(b["return_meta_info"] for b in srv.stats.requests)
    printed = capsys.readouterr().out
    assert f"[eval-engine] SGLang at {srv.base_url}" in printed and "engine tau=" in printed
    assert json.loads((tmp_path / "engine.json").read_text()) == eng
    e = eng["engine"]
    assert e["name"] == "sglang" and e["started"] is False and e["metrics_url"] is None and e["exact"] is None
    assert e["dtype"] is None and "its own launch line (--dtype)" in e["dtype_note"] and e["loop_dtype"] == "float32"
    res = eng["results"]["gsm8k"]
    assert res["source"] == "meta_info" and len(res["per_position_acceptance"]) == 3 and res["num_steps"] > 0

    record = _loop_record(eng)
    warnings = EV.attach_engine_tau(record, eng)
    s = record["drafters"]["trained"]["sets"]["gsm8k"]["engine"]
    assert s["tau"] == res["tau"] and s["per_position_acceptance"] == res["per_position_acceptance"]
    assert isinstance(s["agrees"], bool) and s["loop_tau_pooled"] == 2.0  # the histogram makes the test possible
    assert len(warnings) == (0 if s["agrees"] else 1)  # no dtype warning: a running server's dtype is not known
    write_eval_table(record, tmp_path / "acceptance.tsv")
    lines = report.console_summary(tmp_path / "acceptance.tsv").splitlines()
    i = lines.index("engine τ beside our loop's (pooled over verify steps, eval.engine):")
    verdict = "agrees" if s["agrees"] else "DISAGREES (beyond 3 standard errors)"
    assert lines[i + 1].split()[:6] == ["trained", "gsm8k", "ours", "2.0", "engine", str(round(res["tau"], 3))]
    assert lines[i + 1].endswith(verdict)


def test_console_summary_without_engine_has_no_engine_lines(tmp_path):
    record = {
        "settings": {"block_size": 4, "max_new_tokens": 8, "temperature": 0.0, "thinking": "disable"},
        "drafters": {
            "trained": {"sets": {"gsm8k": {"tau": 2.0, "tokens_per_step": 2.0, "num_steps": 3, "num_responses": 1}}}
        },
    }
    write_eval_table(record, tmp_path / "acceptance.tsv")
    assert "engine τ" not in report.console_summary(tmp_path / "acceptance.tsv")


def test_eval_engine_lines_reach_the_console(tmp_path, monkeypatch):
    term = io.StringIO()
    monkeypatch.setattr(sys, "stderr", term)
    with workflow.log_to(tmp_path / "logs" / "evaluate_engine" / "demo.log"):
        print("[eval-engine] vLLM ready at http://127.0.0.1:1/v1 after 31 s")
        print("[eval-engine]      gsm8k: engine tau=2.400 (metrics, 10 steps, 3 responses, 1.0 s)")
    assert term.getvalue().splitlines() == [
        "[evaluate_engine demo] [eval-engine] vLLM ready at http://127.0.0.1:1/v1 after 31 s",
        "[evaluate_engine demo] [eval-engine]      gsm8k: engine tau=2.400 (metrics, 10 steps, 3 responses, 1.0 s)",
    ]


def test_plan_time_problem_for_sglang_without_a_url():
    cfg = {"target": {"path": "demo"}, "datasets": {}, "eval": {"engine": "sglang"}}
    assert any("eval.engine: sglang measures τ on a running SGLang server" in p for p in problems(cfg))
    cfg["eval"]["engine_base_url"] = "http://h:30000/v1"
    assert not any("eval.engine: sglang" in p for p in problems(cfg))


VLLM_LOG = (
    "INFO 12-01 19:00:01 [model.py:2495] Downcasting torch.float32 to torch.bfloat16.\n"
    "INFO 12-01 19:00:02 [core.py:134] Initializing a V1 LLM engine (v0.32.0) with config: model='/t', "
    "dtype=torch.bfloat16, max_seq_len=1024, kv_cache_dtype=auto, device_config=cpu\n"
)


def test_vllm_is_started_in_the_loops_dtype_and_the_record_says_what_it_served(tmp_path, monkeypatch):
    from dflash_pipeline.evaluate import vllm_server

    started = {}

    class FakeVLLM:  # stands in for the vLLM process: records its arguments, logs what vLLM logs
        def __init__(self, target, **kw):
            started.update(kw)
            self.started_s, self.base_url, self.metrics_url = 1.0, "http://127.0.0.1:9/v1", "http://127.0.0.1:9/metrics"

        def start(self, timeout_s):
            return self

        def log_tail(self, n):
            return VLLM_LOG.replace("bfloat16, max", f"{started['extra_args'][-1]}, max")

    monkeypatch.setattr(vllm_server, "VLLMServer", FakeVLLM)
    assert loop_dtype("auto") == "float32" and loop_dtype("bfloat16") == "bfloat16"  # as the loop on this CPU
    assert served_dtype_of_log(VLLM_LOG) == "bfloat16" and served_dtype_of_log("no engine line") is None
    engine = {"loop_dtype": "float32"}
    EE._open_engine(
        engine,
        _eval_cfg(engine="vllm", engine_args=["--max-model-len", "1024"]),
        target_dir=tmp_path,
        drafter_dir=tmp_path,
        block_size=4,
        chat_template=None,
        log_path=tmp_path / "v.log",
    )
    assert started["extra_args"] == ["--max-model-len", "1024", "--dtype", "float32"]
    assert engine["dtype"] == "float32" and engine["served_dtype"] == "float32"
    assert engine["dtype_source"] == "target.dtype (the loop's)" and engine["args"] == started["extra_args"]
    engine = {"loop_dtype": "float32"}  # the user's --dtype wins, and the record says whose it is
    EE._open_engine(
        engine,
        _eval_cfg(engine="vllm", engine_args=["--dtype", "float16"]),
        target_dir=tmp_path,
        drafter_dir=tmp_path,
        block_size=4,
        chat_template=None,
        log_path=tmp_path / "v.log",
    )
    assert started["extra_args"] == ["--dtype", "float16"] and engine["dtype_source"] == "eval.engine_args"


def test_an_engine_in_another_dtype_than_the_loop_is_flagged():
    st = {"block_size": 4, "max_new_tokens": 8, "temperature": 0.0, "thinking": "disable"}
    sets = {"gsm8k": {"path": "g.jsonl", "num_prompts": 1}}
    loop = {"tau": 2.0, "tokens_per_step": 2.0, "histogram": {"2": 10}, "num_steps": 10, "num_responses": 1}
    for served, flagged in (("bfloat16", True), ("float32", False)):
        record = {
            "settings": {**st, "dtype": "float32"},
            "sets": sets,
            "drafters": {"trained": {"sets": {"gsm8k": dict(loop)}}},
        }
        eng = {
            "settings": st,
            "sets": sets,
            "engine": {"name": "vllm", "dtype": "float32", "served_dtype": served},
            "results": {"gsm8k": {"tau": 2.0, "histogram": {"2": 10}, "num_steps": 10, "source": "metrics"}},
        }
        warnings = EV.attach_engine_tau(record, eng)
        expected = (
            "the engine served bfloat16, our loop ran the target in float32: the two τ differ by "
            "precision as well (eval.engine_args --dtype)"
        )
        assert (warnings == [expected]) == flagged
        assert record["engine"]["served_dtype"] == served


LONG = " ".join(f"w{i}" for i in range(300))
BUCKET_PROMPTS = [
    {"prompt_id": "s", "turns": ["short question"], "system": None},
    {"prompt_id": "l", "turns": [LONG], "system": None},
]


@pytest.mark.parametrize("flavor", ["sglang", "vllm"])
def test_engine_tau_by_context_length_per_request(flavor):
    """Acceptance that collapses on long prompts shows in the engine's τ by context length: SGLang's
    per-request meta_info, or vLLM's counters read around each request (requests one at a time)."""
    edges = [64]
    kw = {"spec_long_context": (64, 1.5), "spec_accept_length": 3.0}
    if flavor == "vllm":
        kw["spec_meta_info"] = False
    with start_test_server(flavor=flavor, spec_block_size=4, **kw) as srv:
        metrics = EE.default_metrics_url(srv.base_url) if flavor == "vllm" else None
        r = EE.server_acceptance(
            srv.base_url,
            BUCKET_PROMPTS,
            max_tokens=48,
            block_size=4,
            meta_info=flavor == "sglang",
            metrics_url=metrics,
            max_concurrency=1,
            context_length_buckets=edges,
        )
    by = r["by_context_length"]
    assert set(by) == {"<64", "≥64"}, by
    assert by["<64"]["num_responses"] == by["≥64"]["num_responses"] == 1
    assert by["<64"]["tau"] == pytest.approx(3.0, abs=0.1) and by["≥64"]["tau"] == pytest.approx(1.5, abs=0.1)
    assert all(b["basis"] == "prompt_tokens" and b["num_steps"] > 0 for b in by.values())


def test_engine_tau_by_context_length_needs_requests_one_at_a_time_on_vllm():
    """vLLM's counters pool concurrent requests: no buckets then, and the record says how to get them."""
    with start_test_server(spec_accept_length=3.0, spec_meta_info=False) as srv:
        r = EE.server_acceptance(
            srv.base_url,
            BUCKET_PROMPTS * 2,
            max_tokens=32,
            metrics_url=EE.default_metrics_url(srv.base_url),
            max_concurrency=3,
            context_length_buckets=[64],
        )
    assert "by_context_length" not in r and "engine_max_concurrency: 1" in r["by_context_length_note"]
    assert r["source"] == "metrics"  # the set's pooled τ is still there


def test_tau_by_prompt_length_means_requests_per_bucket():
    from dflash_pipeline.evaluate.context_length import tau_by_prompt_length

    by = tau_by_prompt_length([(10, 3.0, 4), (20, 2.0, 6), (5000, 1.0, None)], [1024, 4096])
    assert list(by) == ["<1K", "≥4K"]
    assert by["<1K"] == {"tau": 2.5, "num_responses": 2, "num_steps": 10, "range": [0, 1024], "basis": "prompt_tokens"}
    assert by["≥4K"]["num_steps"] is None and by["≥4K"]["range"] == [4096, None]
