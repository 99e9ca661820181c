"""Tables for the Snakemake HTML report (``snakemake --report report.html``; rules/report.smk).

Each function turns one stage's record into a TSV the report shows as a table: the config probe, the
prompts manifest (kept / dropped per reason), generation stats (ok / truncated / error, tokens, tokens/s),
token shards (sequences, supervised tokens, truncation and drops per reason).
The eval tables are written by :mod:`dflash_pipeline.evaluate`.
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path
from typing import Iterable, Optional, Sequence

from .shards import read_json, read_parquet, read_shard_metadata


def _write_tsv(path: str | Path, columns: Sequence[str], rows: Iterable[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(columns), delimiter="\t", extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in columns})
    tmp.replace(path)


def _flatten(obj, prefix: str = "") -> list[tuple[str, str]]:
    """Nested dict → ``(dotted.key, value)`` pairs; lists of scalars joined, other lists as JSON."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _flatten(v, f"{prefix}{k}.")
    elif isinstance(obj, list) and all(not isinstance(x, (dict, list)) for x in obj):
        out.append((prefix[:-1], ", ".join(str(x) for x in obj)))
    elif isinstance(obj, list):
        out.append((prefix[:-1], json.dumps(obj, sort_keys=True)))
    else:
        out.append((prefix[:-1], "" if obj is None else str(obj)))
    return out


def probe_table(probe_json: str | Path, out_tsv: str | Path) -> list[tuple[str, str]]:
    """The config probe record as ``key  value`` rows (nested keys dotted)."""
    rows = _flatten(read_json(probe_json))
    _write_tsv(out_tsv, ("key", "value"), ({"key": k, "value": v} for k, v in rows))
    return rows


def prompts_table(manifest_json: str | Path, out_tsv: str | Path) -> list[dict]:
    """Per dataset: records read, kept, shards and every drop reason with its count (``dropped_<reason>``)."""
    manifest = read_json(manifest_json)
    reasons = sorted({r for ds in manifest["datasets"].values() for r in (ds.get("dropped") or {})})
    rows = []
    for name, ds in manifest["datasets"].items():
        dropped = ds.get("dropped") or {}
        rows.append({
            "dataset": name, "read": ds.get("read"), "kept": ds.get("kept"), "shards": len(ds.get("shards") or []),
            "dropped_total": sum(dropped.values()), **{f"dropped_{r}": dropped.get(r, 0) for r in reasons},
            "stopped_at_max_prompts": ds.get("stopped_at_max_prompts"),
        })
    cols = ["dataset", "read", "kept", "shards", "dropped_total", *(f"dropped_{r}" for r in reasons), "stopped_at_max_prompts"]
    _write_tsv(out_tsv, cols, rows)
    return rows


def _benchmark_seconds(path: Path) -> Optional[float]:
    """Wall seconds of a Snakemake benchmark TSV (column ``s``), None when absent or unreadable."""
    try:
        with open(path, encoding="utf-8") as fh:
            row = next(csv.DictReader(fh, delimiter="\t"))
        return float(row["s"])
    except (OSError, StopIteration, KeyError, ValueError):
        return None


GENERATION_COLUMNS = (
    "dataset", "shards", "conversations", "ok", "truncated", "error", "assistant_turns", "prompt_tokens",
    "completion_tokens", "mean_completion_tokens", "request_seconds", "tokens_per_request_s", "job_seconds",
    "tokens_per_job_s", "retries", "thinking", "model",
)


def generation_table(
    completion_shards: Sequence[str | Path],
    out_tsv: str | Path,
    *,
    benchmark_dir: Optional[str | Path] = None,
    out_json: Optional[str | Path] = None,
) -> list[dict]:
    """Generation stats per dataset from the completion shards, plus an ``all`` row.

    ``tokens_per_request_s`` = completion tokens / summed request latency (the speed one request sees; a
    transformers batch shares its latency among its conversations); ``tokens_per_job_s`` = completion tokens / the
    shards' generation wall seconds (``<shard>.stats.json`` next to each shard, else the Snakemake
    benchmark ``benchmark_dir/<dataset>/<shard>.tsv``); ``retries`` from the stats files.
    """
    per: dict[str, dict] = {}
    for path in completion_shards:
        path = Path(path)
        table = read_parquet(path)
        dataset = path.parent.name
        d = per.setdefault(dataset, {"dataset": dataset, "shards": 0, "status": Counter(), "turns": 0, "prompt_tokens": 0,
                                     "completion_tokens": 0, "latency": 0.0, "job_s": 0.0, "job_s_known": True,
                                     "thinking": set(), "model": set()})
        d["shards"] += 1
        for rec in table.select(["status", "turns", "thinking", "model"]).to_pylist():
            d["status"][rec["status"]] += 1
            d["thinking"].add(rec["thinking"])
            d["model"].add(rec["model"])
            for t in rec["turns"] or []:
                d["turns"] += 1
                d["prompt_tokens"] += t.get("prompt_tokens") or 0
                d["completion_tokens"] += t.get("completion_tokens") or 0
                d["latency"] += t.get("latency_s") or 0.0
        stats_file = path.with_name(f"{path.stem}.stats.json")  # written by generate_shard(stats_path=...)
        shard_stats = read_json(stats_file) if stats_file.is_file() else {}
        secs = shard_stats.get("wall_s")
        d["retries"] = d.get("retries", 0) + (shard_stats.get("retries") or 0)
        if secs is None and benchmark_dir:
            secs = _benchmark_seconds(Path(benchmark_dir) / dataset / f"{path.stem}.tsv")
        if secs is None:
            d["job_s_known"] = False
        else:
            d["job_s"] += secs

    def row(name: str, ds: list[dict]) -> dict:
        status = sum((d["status"] for d in ds), Counter())
        comp = sum(d["completion_tokens"] for d in ds)
        lat = sum(d["latency"] for d in ds)
        job_known = all(d["job_s_known"] for d in ds)
        job = sum(d["job_s"] for d in ds)
        turns = sum(d["turns"] for d in ds)
        return {
            "dataset": name, "shards": sum(d["shards"] for d in ds), "conversations": sum(status.values()),
            "ok": status.get("ok", 0), "truncated": status.get("truncated", 0), "error": status.get("error", 0),
            "assistant_turns": turns, "prompt_tokens": sum(d["prompt_tokens"] for d in ds), "completion_tokens": comp,
            "mean_completion_tokens": round(comp / turns, 1) if turns else None,
            "request_seconds": round(lat, 2), "tokens_per_request_s": round(comp / lat, 1) if lat > 0 else None,
            "job_seconds": round(job, 2) if job_known else None,
            "tokens_per_job_s": round(comp / job, 1) if job_known and job > 0 else None,
            "retries": sum(d.get("retries", 0) for d in ds),
            "thinking": ",".join(sorted({x for d in ds for x in d["thinking"] if x})),
            "model": ",".join(sorted({x for d in ds for x in d["model"] if x})),
        }

    rows = [row(name, [d]) for name, d in per.items()]
    if per:
        rows.append(row("all", list(per.values())))
    _write_tsv(out_tsv, GENERATION_COLUMNS, rows)
    if out_json is not None:
        from .shards import write_json

        write_json(out_json, {"datasets": rows}, skip_if_identical=False)
    return rows


#: Summed per dataset from each token shard's ``counts`` (tokens.tokenize_shard), in this order.
TOKEN_COUNTS = (
    "records_in", "records_out", "turns_supervised", "num_tokens", "num_loss_tokens", "truncated",
    "split_conversations", "server_ids_used", "scaffolding_excluded", "render_differs_from_output_ids",
    "straddling_tokens",
)


def tokens_table(token_shards: Sequence[str | Path], out_tsv: str | Path) -> list[dict]:
    """Per dataset (and ``all``) from the token shards' metadata: completion records in, sequences out,
    turns supervised, tokens, supervised tokens and their fraction, truncated sequences, and every drop
    reason with its count (``dropped_<reason>``, see ``tokens.DROP_REASONS``)."""
    per: dict[str, Counter] = {}
    for path in token_shards:
        path = Path(path)
        counts = read_shard_metadata(path).get("counts") or {}
        c = per.setdefault(path.parent.name, Counter())
        c["shards"] += 1
        for key in TOKEN_COUNTS:
            c[key] += counts.get(key) or 0
        for reason, n in (counts.get("dropped") or {}).items():
            c[f"dropped_{reason}"] += n
    reasons = sorted({k for c in per.values() for k in c if k.startswith("dropped_")})

    def row(name: str, c: Counter) -> dict:
        frac = c["num_loss_tokens"] / c["num_tokens"] if c["num_tokens"] else None
        return {"dataset": name, "shards": c["shards"], **{k: c[k] for k in TOKEN_COUNTS},
                "loss_fraction": None if frac is None else round(frac, 4), **{r: c[r] for r in reasons}}

    rows = [row(name, c) for name, c in per.items()]
    if per:
        rows.append(row("all", sum(per.values(), Counter())))
    _write_tsv(out_tsv, ("dataset", "shards", *TOKEN_COUNTS, "loss_fraction", *reasons), rows)
    return rows
