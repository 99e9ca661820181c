"""The shell entry points of per-shard rules (dflash_pipeline.workflow.jobs): the tokenize command line carries
the values the rule's params hold, and the job writes the token shard and its log like the script did
(byte-identity of the shards with the script rule's was checked on a results dir built by the last main)."""

from __future__ import annotations

import shlex

import pyarrow.parquet as pq
import pytest

from dflash_pipeline.core import shards
from dflash_pipeline.core.contracts import COMPLETION_SCHEMA
from dflash_pipeline.tokens import tokenize_shard
from dflash_pipeline.workflow import jobs


def parsed(args: str) -> dict:
    words = shlex.split(args)
    return {
        w: words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else True
        for i, w in enumerate(words)
        if w.startswith("--")
    }


def test_tokenize_args_round_trip_the_params_values():
    tokens = {"last_turn_only": False, "max_length": 160, "strict": True, "use_server_token_ids": False}
    args = parsed(jobs.tokenize_args(tokens, None, False))
    assert args == {
        "--tokens": '{"last_turn_only": false, "max_length": 160, "strict": true, "use_server_token_ids": false}'
    }
    args = parsed(jobs.tokenize_args({"max_length": 8}, "my templates/t's.jinja", True))
    assert args == {
        "--tokens": '{"max_length": 8}',
        "--chat-template": "my templates/t's.jinja",
        "--trust-remote-code": True,
    }


def test_unknown_command_prints_the_usage(capsys):
    assert jobs.main(["detokenize"]) == 2
    assert "tokenize" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The demo target's tokenizer and chat template alone (a small BPE; no model)."""
    from dflash_pipeline import demo

    out = tmp_path_factory.mktemp("tokenizer")
    demo.train_tokenizer(["What is 2 + 3?", "2 + 3 = 5. The answer is 5."] * 20, vocab_size=300).save_pretrained(out)
    return out


def test_tokenize_writes_what_tokenize_shard_writes(tmp_path, tokenizer_dir):
    rec = {
        "prompt_id": "p0",
        "dataset": "gsm8k",
        "model": "demo",
        "sampling": "{}",
        "thinking": "disable",
        "status": "ok",
        "error": None,
        "messages": [
            {"role": "user", "content": "What is 2 + 3?", "reasoning_content": None},
            {"role": "assistant", "content": "2 + 3 = 5. The answer is 5.", "reasoning_content": None},
        ],
        "turns": [
            {
                "finish_reason": "stop",
                "prompt_tokens": 5,
                "completion_tokens": 9,
                "prompt_token_ids": None,
                "output_token_ids": None,
                "latency_s": 0.1,
                "endpoint": "transformers",
            }
        ],
    }
    comp = tmp_path / "completions.parquet"
    shards.write_parquet(comp, shards.table_from_records([rec], COMPLETION_SCHEMA))
    cfg = {"last_turn_only": False, "max_length": 64, "strict": True, "use_server_token_ids": False}
    log = tmp_path / "logs" / "tokenize_completions" / "gsm8k" / "00000.log"
    argv = [
        "tokenize",
        str(comp),
        str(tmp_path / "job.parquet"),
        "--target",
        str(tokenizer_dir),
        *shlex.split(jobs.tokenize_args(cfg, None, False)),
        "--log",
        str(log),
    ]
    assert jobs.main(argv) == 0
    tokenize_shard(comp, tmp_path / "direct.parquet", target_dir=tokenizer_dir, tokens_cfg=cfg)
    assert (tmp_path / "job.parquet").read_bytes() == (tmp_path / "direct.parquet").read_bytes()
    assert pq.read_table(tmp_path / "job.parquet").num_rows == 1
    assert "1 completion records -> 1 sequences" in log.read_text()


def test_tokenize_without_its_paths_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        jobs.main(["tokenize", "--target", "t", "--tokens", "{}"])
    assert exc.value.code == 2
