"""Stats of a completions job (completions/stats.py): the shard's stats JSON and merged request counters."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from dflash_pipeline.completions.stats import fleet_stats, merge_fleet_stats, shard_stats
from dflash_pipeline.core.contracts import STATS_V1_RUN_KEYS


@dataclass
class Ep:
    url: str
    attempts: int
    failures: int
    taken_out: int


def rec(pid: str, status: str, *completion_tokens: int) -> dict:
    return {
        "prompt_id": pid,
        "status": status,
        "turns": [{"prompt_tokens": 10, "completion_tokens": n} for n in completion_tokens],
    }


def test_shard_stats_whole_shard_and_this_run():
    records = [rec("a", "ok", 5), rec("b", "truncated", 7, 3), rec("c", "error")]
    s = shard_stats(
        Path("c.parquet"),
        backend="openai",
        model="m",
        records=records,
        generated_ids={"b", "c"},
        resumed=1,
        wall_s=2.0,
        backend_stats={"requests": 2, "attempts": 3, "retries": 1},
    )
    assert (s["prompts"], s["ok"], s["truncated"], s["error"], s["turns"]) == (3, 1, 1, 1, 3)
    assert (s["prompt_tokens"], s["completion_tokens"]) == (30, 15)
    assert s["run"] == {
        "resumed": 1,
        "generated": 2,
        "turns": 2,
        "prompt_tokens": 20,
        "completion_tokens": 10,
        "wall_s": 2.0,
        "conversations_per_s": 1.0,
        "requests_per_s": 1.0,
        "output_tokens_per_s": 5.0,
        "requests": 2,
        "attempts": 3,
        "retries": 1,
    }
    # this run's figures once, in `run` (stats version 2): the top level is the whole shard's
    assert s["stats_version"] == 2 and not set(s) & set(STATS_V1_RUN_KEYS)


def test_fleet_stats_merge_over_client_processes():
    a = fleet_stats(Counter(attempts=5, retries=1, rate_limited=1), [Ep("u1", 3, 1, 0), Ep("u2", 2, 0, 0)])
    b = fleet_stats(Counter(attempts=4), [Ep("u1", 4, 0, 1)])
    assert a["requests"] == 4
    total = merge_fleet_stats([a, b], ["u1", "u2", "u3"])
    assert (total["requests"], total["attempts"], total["retries"], total["rate_limited"]) == (8, 9, 1, 1)
    assert total["endpoints"] == {
        "u1": {"attempts": 7, "failures": 1, "taken_out": 1},
        "u2": {"attempts": 2, "failures": 0, "taken_out": 0},
        "u3": {"attempts": 0, "failures": 0, "taken_out": 0},
    }
