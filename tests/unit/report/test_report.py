"""Report tables (report.py): the run summary's HTML tables and the end-of-run console summary.
The rendered report itself is checked with headless Chromium in tests/e2e/test_e2e.py."""

from __future__ import annotations

import json
import re

from dflash_pipeline.core.shards import write_tsv
from dflash_pipeline.report import tables as report


def _inputs(tmp_path):
    tau = tmp_path / "acceptance.tsv"
    write_tsv(
        tau,
        ("drafter", "set", "tau", "num_responses"),
        [
            {"drafter": "trained", "set": "gsm8k", "tau": 2.5, "num_responses": 2},
            {"drafter": "trained", "set": "mt_bench", "tau": 1.75, "num_responses": 2},
            {"drafter": "untrained", "set": "gsm8k", "tau": 1.0, "num_responses": 2},
            {"drafter": "untrained", "set": "mt_bench", "tau": 1.01, "num_responses": 2},
        ],
    )
    ev = tmp_path / "acceptance.json"
    ev.write_text(
        json.dumps(
            {
                "settings": {"block_size": 4},
                "sets": {"gsm8k": {"num_prompts": 2}},
                "drafters": {"trained": {"checkpoint": "ckpt/final", "train_steps": 3}},
            }
        )
    )
    prompts = tmp_path / "prompts.tsv"
    write_tsv(
        prompts,
        ("dataset", "read", "kept", "dropped_special_token_text"),
        [{"dataset": "gsm8k", "read": 13, "kept": 12, "dropped_special_token_text": 1}],
    )
    return tau, ev, prompts


def test_summary_page_tables_with_readable_labels(tmp_path):
    from dflash_pipeline.report import page as report_page

    tau, ev, prompts = _inputs(tmp_path)
    out = tmp_path / "summary.html"

    def page(prompts_tsv):
        return report_page.summary_page(
            out,
            run="r1",
            facts={},
            tau_tsv=tau,
            eval_json=ev,
            outputs=[("τ table", str(tau))],
            tables=[(prompts_tsv, "Prompts", "prompts"), (tmp_path / "missing.tsv", "Tokens", "tokens")],
        )

    text = page(prompts)
    assert out.read_text(encoding="utf-8") == text

    def rows(table_id):
        body = re.search(rf'<table id="{table_id}"[^>]*>(.*?)</table>', text, re.S).group(1)
        return [re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", r) for r in re.findall(r"<tr>(.*?)</tr>", body)]

    assert rows("tau") == [["drafter", "gsm8k", "mt_bench"], ["trained", "2.5", "1.75"], ["untrained", "1.0", "1.01"]]
    assert rows("eval-table")[0] == ["drafter", "set", "τ", "responses"]
    assert ["settings.block_size", "4"] in rows("eval-record")
    assert ["drafter trained: checkpoint", "ckpt/final"] in rows("eval-record")
    assert rows("prompts") == [
        ["dataset", "records read", "prompts kept", "dropped: special token text"],
        ["gsm8k", "13", "12", "1"],
    ]
    assert 'id="tokens"' not in text  # a missing input is left out
    assert rows("outputs")[1] == ["τ table", str(tau)]
    # values are escaped (a dataset name or path never becomes markup)
    write_tsv(prompts, ("dataset", "read"), [{"dataset": "<b>x</b>", "read": 1}])
    assert "&lt;b&gt;x&lt;/b&gt;" in page(prompts)


def test_console_summary_prints_the_tau_table_and_outputs(tmp_path):
    tau, _, _ = _inputs(tmp_path)
    text = report.console_summary(tau, [("drafter checkpoint", "results/checkpoints/r1/final")])
    lines = text.splitlines()
    assert lines[0].startswith("τ per drafter and eval set")
    assert lines[1].split() == ["drafter", "gsm8k", "mt_bench"] and lines[2].split() == ["trained", "2.5", "1.75"]
    assert lines[-1].split() == ["drafter", "checkpoint", "results/checkpoints/r1/final"]
    assert report.console_summary(tmp_path / "none.tsv") == ""


# ---------------------------------------------------------------------- generation table: stats files of every version

#: A stats file as the previous main wrote it (stats version 1, no ``stats_version``: this run's figures at
#: the top level and again in ``run``, ``resumed`` and the request counters at the top level only).
V1_STATS = {
    "attempts": 6,
    "backend": "openai",
    "completion_tokens": 66,
    "conversations_per_s": 1.5,
    "endpoints": {"http://127.0.0.1:31001/v1": {"attempts": 6, "failures": 0, "taken_out": 0}},
    "error": 1,
    "generated": 6,
    "model": "test-model",
    "ok": 8,
    "output_tokens_per_s": 7.5,
    "prompt_tokens": 65,
    "prompts": 10,
    "rate_limited": 1,
    "requests": 4,
    "requests_per_s": 1.25,
    "resumed": 4,
    "retries": 2,
    "run": {
        "completion_tokens": 30,
        "conversations_per_s": 1.5,
        "generated": 6,
        "output_tokens_per_s": 7.5,
        "prompt_tokens": 15,
        "requests_per_s": 1.25,
        "turns": 5,
        "wall_s": 4.0,
    },
    "schema_version": 1,
    "shard": "results/completions/old/00000.parquet",
    "skipped": {"too_long": 0},
    "skipped_examples": {"too_long": []},
    "truncated": 1,
    "turns": 10,
    "wall_s": 4.0,
}


def _completion_shard(path, completion_tokens):
    from dflash_pipeline.core import contracts, shards

    turn = {
        "finish_reason": "stop",
        "prompt_tokens": 3,
        "prompt_token_ids": None,
        "output_token_ids": None,
        "latency_s": 0.5,
        "endpoint": "local",
    }
    recs = [
        {
            "prompt_id": f"p{i}",
            "dataset": path.parent.name,
            "messages": [],
            "model": "m",
            "sampling": "{}",
            "thinking": "disable",
            "status": "ok",
            "error": None,
            "turns": [{**turn, "completion_tokens": n}],
        }
        for i, n in enumerate(completion_tokens)
    ]
    path.parent.mkdir(parents=True)
    shards.write_parquet(path, shards.table_from_records(recs, contracts.COMPLETION_SCHEMA))
    return recs


def test_generation_table_reads_old_and_new_stats_files_together(tmp_path):
    """A workdir keeps the stats files of shards it does not regenerate: a partial rebuild mixes version-1
    files (the previous main's) with version-2 ones; both count their last run's tokens, seconds and
    retries (contracts.run_stats), never the whole shard's or a figure twice."""
    from dflash_pipeline.completions.stats import shard_stats
    from dflash_pipeline.core.contracts import run_stats
    from dflash_pipeline.core.shards import write_json

    old, new = tmp_path / "old" / "00000.parquet", tmp_path / "new" / "00000.parquet"
    _completion_shard(old, [10, 20, 50])  # the last run generated 30 of its 80 tokens
    write_json(old.with_name("00000.stats.json"), V1_STATS)
    recs = _completion_shard(new, [8, 12, 40])
    stats = shard_stats(
        new,
        backend="openai",
        model="m",
        records=recs,
        generated_ids={"p1", "p2"},
        resumed=1,
        wall_s=2.0,
        backend_stats={"requests": 2, "attempts": 3, "retries": 1},
    )
    write_json(new.with_name("00000.stats.json"), stats)
    assert stats["stats_version"] == 2 and "wall_s" not in stats and stats["run"]["completion_tokens"] == 52

    # both versions give the same RunStats keys; version 1's come from its top level and its `run`
    v1 = run_stats(V1_STATS)
    assert set(v1) == set(stats["run"]) | {"rate_limited", "endpoints"}
    assert (v1["resumed"], v1["generated"], v1["retries"], v1["wall_s"], v1["completion_tokens"]) == (4, 6, 2, 4.0, 30)
    assert run_stats(stats) == stats["run"] and run_stats({}) == {}

    rows = {r["dataset"]: r for r in report.generation_table([old, new], tmp_path / "g.tsv")}
    assert (rows["old"]["job_seconds"], rows["old"]["tokens_per_job_s"], rows["old"]["retries"]) == (4.0, 7.5, 2)
    assert (rows["new"]["job_seconds"], rows["new"]["tokens_per_job_s"], rows["new"]["retries"]) == (2.0, 26.0, 1)
    assert rows["new"]["completion_tokens"] == 60 and rows["old"]["completion_tokens"] == 80  # the shards' records
    assert (rows["all"]["job_seconds"], rows["all"]["retries"]) == (6.0, 3)
    assert rows["all"]["tokens_per_job_s"] == round((30 + 52) / 6.0, 1)
