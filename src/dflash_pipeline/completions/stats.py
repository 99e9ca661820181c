"""Stats of a completions job: the live progress bar, the backends' request counts (merged over client
processes) and the stats JSON of a shard (`generate_completions`' `stats` output, read by
`report.py` through `core.contracts.run_stats`)."""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

from dflash_pipeline.core.contracts import (
    COMPLETION_SCHEMA_VERSION,
    COMPLETION_STATS_VERSION,
    TOOL_CALL_DIVERGED,
    CompletionStats,
    RunStats,
    has_tools,
)

#: Examples kept per `ended_early` reason in a shard's stats.
MAX_ENDED_EXAMPLES = 3


def ended_early(records: Sequence[dict]) -> dict:
    """`{"tool_conversations": n, "ended_early": {reason: n}, "ended_early_examples": {reason: [...]}}` of a shard's
    records when any has tools: conversations with tools, and those that ended before the source's last turn because a
    regenerated turn's tool calls differ from the source's, the first `MAX_ENDED_EXAMPLES` of them as `{prompt_id,
    turn}`."""
    tooled = [r for r in records if "end_reason" in r or has_tools(r)]
    if not tooled:
        return {}
    diverged = [r for r in tooled if r.get("end_reason") == TOOL_CALL_DIVERGED]
    examples = [{"prompt_id": r["prompt_id"], "turn": len(r["turns"]) - 1} for r in diverged[:MAX_ENDED_EXAMPLES]]
    return {
        "tool_conversations": len(tooled),
        "ended_early": {TOOL_CALL_DIVERGED: len(diverged)},
        "ended_early_examples": {TOOL_CALL_DIVERGED: examples},
    }


#: The per-endpoint counters of a fleet (summed over client processes).
ENDPOINT_COUNTERS = ("attempts", "failures", "taken_out")
#: The request counters of the openai backend (summed over client processes).
REQUEST_COUNTERS = ("requests", "attempts", "retries", "rate_limited")


class _Progress:
    """Live bar (stderr) with ok/truncated/error counts, requests/s and output tokens/s."""

    def __init__(self, total: int, initial: int, desc: str, resumed_records: Iterable[dict] = ()):
        """`initial` conversations are already finished."""
        from tqdm import tqdm

        tty = sys.stderr.isatty()
        self.bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            file=sys.stderr,
            mininterval=0.5 if tty else 30.0,
            dynamic_ncols=True,
            unit="conv",
            leave=True,
        )
        self.counts: Counter = Counter(r["status"] for r in resumed_records)
        self.t0 = time.monotonic()
        self.turns = 0
        self.out_tokens = 0
        if self.counts:
            self._postfix()

    def _postfix(self) -> None:
        dt = max(time.monotonic() - self.t0, 1e-9)
        c = self.counts
        self.bar.set_postfix_str(
            f"ok={c['ok']} trunc={c['truncated']} err={c['error']} "
            f"{self.turns / dt:.1f} req/s {self.out_tokens / dt:.0f} tok/s",
            refresh=False,
        )

    #: A console line (dflash_pipeline.workflow.policy.console) at most this often, and at every tenth of the shard.
    CONSOLE_EVERY_S = 60.0

    def update(self, record: dict) -> None:
        self.counts[record["status"]] += 1
        self.turns += len(record["turns"])
        self.out_tokens += sum(t.get("completion_tokens") or 0 for t in record["turns"])
        self._postfix()
        self.bar.update(1)
        self._console()

    def _console(self) -> None:
        """One progress line for the console (the bar itself only goes to the job's log)."""
        from dflash_pipeline.core.console import console

        n, total = self.bar.n, self.bar.total or 0
        now = time.monotonic()
        tenth = total and n * 10 // total != getattr(self, "_last_tenth", 0)
        if not tenth and now - getattr(self, "_last_console", self.t0) < self.CONSOLE_EVERY_S:
            return
        self._last_tenth, self._last_console = (n * 10 // total if total else 0), now
        dt = max(now - self.t0, 1e-9)
        c = self.counts
        console(
            "%s: %d/%d conversations (ok %d, truncated %d, error %d%s), %.1f req/s, %.0f tok/s",
            self.bar.desc,
            n,
            total,
            c["ok"],
            c["truncated"],
            c["error"],
            f", skipped {c['skipped']}" if c["skipped"] else "",
            self.turns / dt,
            self.out_tokens / dt,
        )

    def close(self) -> None:
        self.bar.close()


def fleet_stats(counts: Counter, endpoints: Sequence) -> dict:
    """The openai backend's stats: `requests`, `attempts`, `retries`, `rate_limited` (429 answers) from `counts`, and
    per endpoint (base URL without credentials) its `attempts, failures, taken_out`."""
    return {
        "requests": counts["attempts"] - counts["retries"],
        "attempts": counts["attempts"],
        "retries": counts["retries"],
        "rate_limited": counts["rate_limited"],
        "endpoints": {ep.url: {key: getattr(ep, key) for key in ENDPOINT_COUNTERS} for ep in endpoints},
    }


def merge_fleet_stats(parts: Iterable[dict], urls: Sequence[str]) -> dict:
    """The sum of several client processes' `fleet_stats`."""
    total: dict = {key: 0 for key in REQUEST_COUNTERS}
    total["endpoints"] = {url: {key: 0 for key in ENDPOINT_COUNTERS} for url in urls}
    for part in parts:
        for key in REQUEST_COUNTERS:
            total[key] += part[key]
        for url, counters in part["endpoints"].items():
            for key in ENDPOINT_COUNTERS:
                total["endpoints"][url][key] += counters[key]
    return total


def _tokens(turns: list[dict], key: str) -> int:
    return sum(t.get(key) or 0 for t in turns)


def shard_stats(
    out_path: Path,
    *,
    backend: str,
    model: str | None,
    records: Sequence[dict],
    generated_ids: set[str],
    resumed: int,
    wall_s: float,
    backend_stats: dict,
    skip_info: dict | None = None,
) -> CompletionStats:
    """The stats JSON of one completion shard (`contracts.CompletionStats`): the whole shard's counts at the
    top level, this run's in `run`.

    Args:
        records: the shard's final records (resumed ones included), in shard order.
        generated_ids: prompt_ids sent in this run.
        resumed: conversations taken from the progress file.
        wall_s: seconds of this run (the rates' denominator).
        backend_stats: the backend's counters of this run, merged last into `run`.
        skip_info: `skipped` and `skipped_examples` of the shard."""
    counts = Counter(r["status"] for r in records)
    all_turns = [t for r in records for t in r["turns"]]
    gen_turns = [t for r in records if r["prompt_id"] in generated_ids for t in r["turns"]]

    def rate(n: int) -> float | None:
        return round(n / wall_s, 3) if wall_s > 0 else None

    run: RunStats = {  # this call only
        "resumed": resumed,
        "generated": len(generated_ids),
        "turns": len(gen_turns),
        "prompt_tokens": _tokens(gen_turns, "prompt_tokens"),
        "completion_tokens": _tokens(gen_turns, "completion_tokens"),
        "wall_s": round(wall_s, 3),
        "conversations_per_s": rate(len(generated_ids)),
        "requests_per_s": rate(len(gen_turns)),
        "output_tokens_per_s": rate(_tokens(gen_turns, "completion_tokens")),
        "requests": 0,
        "attempts": 0,
        "retries": 0,
        **backend_stats,
    }
    return {
        "stats_version": COMPLETION_STATS_VERSION,
        "schema_version": COMPLETION_SCHEMA_VERSION,
        "shard": str(out_path),
        "backend": backend,
        "model": model,
        # the whole shard (its final records, resumed ones included)
        "prompts": len(records),
        "ok": counts.get("ok", 0),
        "truncated": counts.get("truncated", 0),
        "error": counts.get("error", 0),
        "turns": len(all_turns),
        "prompt_tokens": _tokens(all_turns, "prompt_tokens"),
        "completion_tokens": _tokens(all_turns, "completion_tokens"),
        **(skip_info or {}),
        **ended_early(records),
        "run": run,
    }
