"""Completions stage, ``generation.api: completions`` (raw mode): the conversation rendered locally with the
target's template, sent to ``POST /v1/completions`` as token ids, reasoning split from the text; the
same fleet/retry/resume machinery as chat mode (against the local test server)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_completions import FAST, MULTI, gen_cfg, read_records, single_turn, write_prompts

from dflash_pipeline.completions import PROGRESS_SUFFIX, ProgressLog, _fingerprint, generate_shard
from dflash_pipeline.core.errors import ConfigError
from dflash_pipeline.target import chat
from dflash_pipeline.testing.server import Faults, start_test_server

REPO = Path(__file__).resolve().parents[3]


def raw_cfg(*urls, concurrency=4, **overrides) -> dict:
    eps = [{"base_url": u, "max_concurrency": concurrency} for u in urls]
    # max_tokens within the demo target's context (1024): a longer budget would skip every prompt as too_long
    return gen_cfg(backend="openai", api="completions", endpoints=eps, **{**FAST, "max_tokens": 64, **overrides})


def histories(rec: dict) -> list[list[dict]]:
    """The history sent for each assistant turn of a record (as the client builds it)."""
    out, hist = [], []
    for m in rec["messages"]:
        if m["role"] == "assistant":
            out.append(list(hist))
            msg = {"role": "assistant", "content": m["content"]}
            if m["reasoning_content"] is not None:
                msg["reasoning_content"] = m["reasoning_content"]
            hist.append(msg)
        else:
            hist.append({"role": m["role"], "content": m["content"]})
    return out


def canned_answer(prompt_text: str) -> str:
    """What the test server's canned /v1/completions answers (after any think block)."""
    digest = hashlib.sha256(prompt_text.encode("utf-8")).hexdigest()[:8]
    return f"Completion {digest} of a {len(prompt_text.split())}-word prompt."


def test_raw_multi_turn_sends_local_render_as_token_ids(tmp_path, demo_target):
    write_prompts(tmp_path / "p.parquet", MULTI)
    tok = chat.load_tokenizer(demo_target)
    with start_test_server(tokenizer_dir=demo_target) as srv:
        cfg = raw_cfg(srv.base_url, temperature=0.7, top_k=20, seed=5, extra_body={"return_token_ids": True})
        stats = generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=demo_target, gen_cfg=cfg)
        sent = list(srv.stats.requests)
        assert srv.stats.completions_requests == srv.stats.chat_requests == 4  # no chat request at all
    recs = read_records(tmp_path / "c.parquet")
    assert all(r["status"] == "ok" and r["model"] == "test-model" for r in recs) and stats["turns"] == 4
    assert json.loads(recs[0]["sampling"])["api"] == "completions"
    by_prompt = {tuple(b["prompt"]): b for b in sent}
    for rec in recs:
        assistants = [m for m in rec["messages"] if m["role"] == "assistant"]
        for hist, turn, msg in zip(histories(rec), rec["turns"], assistants):
            text = chat.render(tok, hist, thinking="disable", add_generation_prompt=True)
            ids = chat.render(tok, hist, thinking="disable", add_generation_prompt=True, tokenize=True)
            body = by_prompt[tuple(ids)]  # the server got exactly the local render, as token ids
            assert tok.decode(body["prompt"], skip_special_tokens=False) == text
            assert "messages" not in body and "chat_template_kwargs" not in body
            assert body["top_k"] == 20 and body["seed"] == 5 and body["temperature"] == 0.7
            assert body["max_tokens"] == cfg["max_tokens"] and body["model"] == "test-model"
            assert msg == {"role": "assistant", "content": canned_answer(text), "reasoning_content": None}
            assert turn["prompt_token_ids"] == ids and turn["prompt_tokens"] == len(ids)
            assert turn["completion_tokens"] == len(turn["output_token_ids"]) and turn["finish_reason"] == "stop"
    # turn 2 was rendered from the regenerated turn 1
    turn2 = tok.decode(recs[0]["turns"][1]["prompt_token_ids"], skip_special_tokens=False)
    assert recs[0]["messages"][2]["content"] in turn2 and turn2.endswith("<think>\n\n</think>\n\n")


def test_raw_on_target_server_matches_transformers(tmp_path, demo_target):
    write_prompts(tmp_path / "p.parquet", MULTI)
    local = gen_cfg(max_tokens=5, batch_size=1)
    generate_shard(tmp_path / "p.parquet", tmp_path / "local.parquet", target_dir=demo_target, gen_cfg=local)
    with start_test_server(target_dir=demo_target) as srv:
        cfg = raw_cfg(srv.base_url, max_tokens=5, extra_body={"return_token_ids": True})
        generate_shard(tmp_path / "p.parquet", tmp_path / "remote.parquet", target_dir=demo_target, gen_cfg=cfg)
        assert srv.stats.completions_requests == 4
    for a, b in zip(read_records(tmp_path / "local.parquet"), read_records(tmp_path / "remote.parquet")):
        assert a["messages"] == b["messages"] and a["status"] == b["status"]
        for ta, tb in zip(a["turns"], b["turns"]):
            for k in ("finish_reason", "prompt_token_ids", "output_token_ids", "completion_tokens", "prompt_tokens"):
                assert ta[k] == tb[k], k
        assert b["turns"][0]["endpoint"] == srv.base_url


def test_raw_thinking_save_splits_think_tags_and_resends_reasoning(tmp_path, demo_target):
    write_prompts(tmp_path / "p.parquet", MULTI[:1])
    tok = chat.load_tokenizer(demo_target)
    with start_test_server(tokenizer_dir=demo_target, reasoning=True) as srv:
        generate_shard(
            tmp_path / "p.parquet",
            tmp_path / "c.parquet",
            target_dir=demo_target,
            gen_cfg=raw_cfg(srv.base_url, thinking="save"),
        )
        sent = [b["prompt"] for b in srv.stats.requests]
    (rec,) = read_records(tmp_path / "c.parquet")
    assert rec["status"] == "ok" and rec["thinking"] == "save"
    hists = histories(rec)
    texts = [chat.render(tok, h, thinking="save", add_generation_prompt=True) for h in hists]
    assert sent == [chat.render(tok, h, thinking="save", add_generation_prompt=True, tokenize=True) for h in hists]
    assert not any(t.rstrip().endswith("</think>") for t in texts)  # enable_thinking=True: no empty block
    assistants = [m for m in rec["messages"] if m["role"] == "assistant"]
    for text, m in zip(texts, assistants):
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:8]
        assert m["reasoning_content"] == f"Let me think about prompt {digest}."
        assert m["content"] == canned_answer(text)
    assert hists[1][2]["reasoning_content"] == assistants[0]["reasoning_content"]  # sent back in turn 2


def test_raw_thinking_save_cut_inside_think_block_is_truncated(tmp_path, demo_target):
    write_prompts(tmp_path / "p.parquet", single_turn(1))
    with start_test_server(tokenizer_dir=demo_target, reasoning=True) as srv:
        generate_shard(
            tmp_path / "p.parquet",
            tmp_path / "c.parquet",
            target_dir=demo_target,
            gen_cfg=raw_cfg(srv.base_url, thinking="save", max_tokens=3),
        )
    (rec,) = read_records(tmp_path / "c.parquet")
    assert rec["status"] == "truncated" and rec["turns"][0]["finish_reason"] == "length"
    # the cut text as generated ("<think>\nLet me "): reasoning without a closing tag, no answer yet
    assert rec["messages"][1]["reasoning_content"] == "Let me " and rec["messages"][1]["content"] == ""


def test_raw_thinking_save_with_template_that_opens_think(tmp_path, demo_target):
    """A generation prompt ending in ``<think>`` (DeepSeek-R1 / Qwen3 thinking-2507 style): the completion
    starts inside the reasoning and has only the closing tag."""
    from dflash_pipeline.demo import CHAT_TEMPLATE

    opened = CHAT_TEMPLATE.replace(
        "{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking",
        "{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking is defined and enable_thinking is true %}"
        "{{- '<think>\\n' }}{%- endif %}\n    {%- if enable_thinking",
    )
    assert opened != CHAT_TEMPLATE
    template = tmp_path / "opened.jinja"
    template.write_text(opened)
    write_prompts(tmp_path / "p.parquet", single_turn(2))
    with start_test_server(tokenizer_dir=demo_target, reasoning=True) as srv:
        generate_shard(
            tmp_path / "p.parquet",
            tmp_path / "c.parquet",
            target_dir=demo_target,
            chat_template=template,
            gen_cfg=raw_cfg(srv.base_url, thinking="save"),
        )
        sent = [srv._tok.decode(b["prompt"]) for b in srv.stats.requests]
    assert all(s.endswith("<|im_start|>assistant\n<think>\n") for s in sent)
    for rec in read_records(tmp_path / "c.parquet"):
        assert rec["status"] == "ok" and rec["messages"][1]["reasoning_content"].startswith("Let me think about prompt")
        assert rec["messages"][1]["content"].startswith("Completion ")


def test_raw_thinking_save_without_think_block_is_an_error_row(tmp_path, demo_target):
    write_prompts(tmp_path / "p.parquet", single_turn(2))
    with start_test_server(tokenizer_dir=demo_target, reasoning=False) as srv:
        cfg = raw_cfg(srv.base_url, thinking="save", max_error_fraction=1.0)
        generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=demo_target, gen_cfg=cfg)
        assert srv.stats.completions_requests == 2  # not retried
    recs = read_records(tmp_path / "c.parquet")
    assert all(r["status"] == "error" and "no <think>" in r["error"] for r in recs)


def test_raw_thinking_disable_rejects_reasoning_and_none_keeps_it(tmp_path, demo_target):
    write_prompts(
        tmp_path / "p.parquet", [[{"role": "user", "content": "a [[WRONG]]"}], [{"role": "user", "content": "b"}]]
    )
    with start_test_server(tokenizer_dir=demo_target, reasoning=True) as srv:
        cfg = raw_cfg(srv.base_url, thinking="disable", max_error_fraction=1.0)
        generate_shard(tmp_path / "p.parquet", tmp_path / "d.parquet", target_dir=demo_target, gen_cfg=cfg)
        bad, good = read_records(tmp_path / "d.parquet")
        assert bad["status"] == "error" and "thinking=disable" in bad["error"]
        # the disabled template closes an empty think block in the prompt, so the server does not think
        assert good["status"] == "ok" and good["messages"][1]["reasoning_content"] is None
        assert good["messages"][1]["content"].startswith("Completion ")
        generate_shard(
            tmp_path / "p.parquet",
            tmp_path / "n.parquet",
            target_dir=demo_target,
            gen_cfg=raw_cfg(srv.base_url, thinking="none"),
        )
    recs = read_records(tmp_path / "n.parquet")
    assert all(r["status"] == "ok" and r["messages"][1]["reasoning_content"] for r in recs)


@pytest.mark.parametrize(
    "faults", [Faults(fail_first=3, fail_status=503), Faults(drop_first=2)], ids=["5xx", "dropped-connection"]
)
def test_raw_transient_faults_are_retried(tmp_path, demo_target, faults):
    n = 5
    write_prompts(tmp_path / "p.parquet", single_turn(n))
    with start_test_server(tokenizer_dir=demo_target, faults=faults) as srv:
        cfg = raw_cfg(srv.base_url, endpoint_max_failures=10)
        stats = generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=demo_target, gen_cfg=cfg)
        injected = faults.fail_first + faults.drop_first
        assert srv.stats.completions_requests == n + injected and srv.stats.answered == n
        assert len(srv.stats.by_prompt) == n and sum(srv.stats.by_prompt.values()) == n + injected
    assert stats["ok"] == n and stats["run"]["retries"] == injected
    assert all(r["status"] == "ok" for r in read_records(tmp_path / "c.parquet"))


def test_raw_bad_request_not_retried(tmp_path, demo_target):
    write_prompts(tmp_path / "p.parquet", single_turn(2) + [[{"role": "user", "content": "x [[400]]"}]])
    with start_test_server(tokenizer_dir=demo_target) as srv:
        cfg = raw_cfg(srv.base_url, max_error_fraction=0.5)
        stats = generate_shard(tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=demo_target, gen_cfg=cfg)
        assert srv.stats.completions_requests == 3
    assert stats["ok"] == 2 and stats["error"] == 1
    assert "HTTP 400" in read_records(tmp_path / "c.parquet")[2]["error"]


def test_api_is_part_of_the_resume_fingerprint(tmp_path, demo_target):
    write_prompts(tmp_path / "p.parquet", single_turn(3))
    out = tmp_path / "c.parquet"
    with start_test_server(tokenizer_dir=demo_target) as srv:
        cfg = raw_cfg(srv.base_url)
        chat_cfg = {**cfg, "api": "chat"}
        assert "api" not in _fingerprint("openai", chat_cfg, None, None)["sampling"]  # chat fingerprints unchanged
        generate_shard(tmp_path / "p.parquet", out, target_dir=demo_target, gen_cfg=cfg)
        recs = read_records(out)
        progress = Path(str(out) + PROGRESS_SUFFIX)
        # progress written under chat mode is discarded by a completions run ...
        log = ProgressLog(progress, _fingerprint("openai", chat_cfg, demo_target, None))
        log.open(recs)
        log.close()
        stats = generate_shard(tmp_path / "p.parquet", out, target_dir=demo_target, gen_cfg=cfg)
        assert stats["run"]["resumed"] == 0 and srv.stats.completions_requests == 6
        # ... and one written under the same settings is resumed
        log = ProgressLog(progress, _fingerprint("openai", cfg, demo_target, None))
        log.open(recs)
        log.close()
        stats = generate_shard(tmp_path / "p.parquet", out, target_dir=demo_target, gen_cfg=cfg)
        assert stats["run"]["resumed"] == 3 and srv.stats.completions_requests == 6


def test_raw_config_errors(tmp_path, demo_target):
    write_prompts(tmp_path / "p.parquet", single_turn(1))
    with pytest.raises(ConfigError, match="needs the target's tokenizer"):
        generate_shard(
            tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=None, gen_cfg=raw_cfg("http://127.0.0.1:9/v1")
        )
    with pytest.raises(ConfigError, match="chat_template_kwargs"):
        generate_shard(
            tmp_path / "p.parquet",
            tmp_path / "c.parquet",
            target_dir=demo_target,
            gen_cfg=raw_cfg("http://127.0.0.1:9/v1", extra_body={"chat_template_kwargs": {"x": 1}}),
        )
    with pytest.raises(ConfigError, match="openai backend only"):
        generate_shard(
            tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=demo_target, gen_cfg=gen_cfg(api="completions")
        )
    with pytest.raises(ConfigError, match="generation.api"):
        gen_cfg(api="raw")
    assert gen_cfg()["api"] == "chat"


def test_plan_time_check_names_generation_api(tmp_path):
    cfg = {
        "generation": {
            "backend": "transformers",
            "api": "completions",
            "extra_body": {"chat_template_kwargs": {"enable_thinking": True}},
        }
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "-s",
            str(REPO / "Snakefile"),
            "-d",
            str(tmp_path),
            "-n",
            "--configfile",
            str(tmp_path / "config.yaml"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "generation.api: completions applies to the openai backend only" in out
    assert "generation.extra_body.chat_template_kwargs" in out


def test_raw_turn_outgrowing_the_context_is_skipped_not_sent(tmp_path, demo_target):
    """Issue #18, raw mode: each turn is rendered here, so a later turn whose prompt + max_tokens exceeds
    the target's context is skipped (counted with an example), never sent; the other conversations complete."""
    from dflash_pipeline.completions import OpenAIBackend

    convs = [
        [{"role": "user", "content": "Hi"}, {"role": "user", "content": "And what is six times four?"}],
        [{"role": "user", "content": "Hi there"}],
    ]
    write_prompts(tmp_path / "p.parquet", convs)
    tok = chat.load_tokenizer(demo_target)
    firsts = [
        len(chat.render(tok, c[:1], thinking="disable", add_generation_prompt=True, tokenize=True)) for c in convs
    ]
    with start_test_server(tokenizer_dir=demo_target) as srv:
        cfg = raw_cfg(srv.base_url, max_tokens=4)
        backend = OpenAIBackend(cfg, target_dir=demo_target)
        assert backend.context_limit == json.loads((demo_target / "config.json").read_text())["max_position_embeddings"]
        backend.context_limit = max(firsts) + 4  # every first turn fits; the second turn of convs[0] cannot
        stats = generate_shard(
            tmp_path / "p.parquet", tmp_path / "c.parquet", target_dir=demo_target, gen_cfg=cfg, backend=backend
        )
        assert srv.stats.completions_requests == 2  # two first turns; the over-long second turn never sent
    (rec,) = read_records(tmp_path / "c.parquet")
    assert rec["status"] in ("ok", "truncated") and stats["skipped"] == {"too_long": 1}
    assert stats["skipped_examples"]["too_long"][0]["turn"] == 1
