"""What is wrong with a run, in words: the findings the landing page opens with.

Each check reads figures the run already holds and, past a threshold of the config's `report.findings` section, returns
a `Finding` that names the table or figure behind it (its element id on the page) and the config key that changes it.
`run_findings` runs every check; `findings_html` renders them.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence


@dataclass(frozen=True)
class Finding:
    """One finding: `kind` (a stable name, e.g. `truncated_completions`), `message` (what the figures say, with the
    numbers), `figure` (element id of the table or figure behind it on the landing page; "" when it lives elsewhere),
    `figure_label`, `config_key` (the key that changes it)."""

    kind: str
    message: str
    figure: str
    figure_label: str
    config_key: str


def thresholds(overrides: Optional[Mapping] = None) -> dict:
    """The `report.findings` thresholds: the schema's defaults updated with `overrides`."""
    from dflash_pipeline.core.config import schema_defaults

    return {**schema_defaults("report", "findings"), **(overrides or {})}


def _num(x) -> Optional[float]:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _all_row(rows: Sequence[Mapping]) -> Mapping:
    rows = list(rows)
    return next((r for r in rows if r.get("dataset") == "all"), rows[-1] if rows else {})


# --- The checks (each returns a list: none, one or several findings)


def truncated_completions(generation_rows: Sequence[Mapping], th: Mapping) -> list[Finding]:
    """Most conversations stop at `generation.max_tokens` (the generation table's `truncated`)."""
    row = _all_row(generation_rows)
    n, cut = _num(row.get("conversations")), _num(row.get("truncated"))
    if not n or cut is None or cut / n < th["truncated_fraction"]:
        return []
    return [
        Finding(
            "truncated_completions",
            f"{int(cut):,} of {int(n):,} completions ({100 * cut / n:.0f} %) stop at generation.max_tokens: the drafter "
            f"trains on answers cut mid-way and never sees how they end. Raise generation.max_tokens (this "
            f"regenerates the completions).",
            "generation",
            "Generation per dataset (truncated) and the training-data length histogram",
            "generation.max_tokens",
        )
    ]


def thinking_mismatch(generation_rows: Sequence[Mapping], record: Mapping) -> list[Finding]:
    """The completions were generated in another thinking mode than the eval's (`thinking` of the generation
    table against `settings.thinking` of the eval record)."""
    gen = {m for m in str(_all_row(generation_rows).get("thinking") or "").split(",") if m}
    ev = (record.get("settings") or {}).get("thinking")
    if not gen or ev is None or gen == {ev}:
        return []
    return [
        Finding(
            "thinking_mismatch",
            f"the training data was generated with thinking {', '.join(sorted(gen))} and the eval ran with thinking "
            f"{ev}: the drafter is measured on text of another kind than it learned. Generate and evaluate in the "
            f"mode you will serve.",
            "generation",
            "Generation per dataset (thinking) and the τ table's settings",
            "generation.thinking",
        )
    ]


def template_warnings(warnings: Sequence[str]) -> list[Finding]:
    """The chat-template check every completions job runs first warned (the job logs' warning lines)."""
    return [
        Finding(
            "template_warning",
            f"the chat-template check warned: {w}",
            "",
            "the completions job logs (results/logs/generate_completions/)",
            "target.chat_template",
        )
        for w in dict.fromkeys(warnings)
    ]


def few_supervised_tokens(tokens_rows: Sequence[Mapping], block_size: Optional[int], th: Mapping) -> list[Finding]:
    """The training sequences carry few supervised tokens (fewer than `min_supervised_blocks` draft blocks
    on average): few anchors per sequence, little to learn from each."""
    row = _all_row(tokens_rows)
    seqs, sup = _num(row.get("records_out")), _num(row.get("num_loss_tokens"))
    if not seqs or sup is None or not block_size:
        return []
    mean = sup / seqs
    if mean >= th["min_supervised_blocks"] * block_size:
        return []
    return [
        Finding(
            "few_supervised_tokens",
            f"the training sequences carry {mean:.1f} supervised tokens on average, fewer than "
            f"{th['min_supervised_blocks']:g} blocks of {block_size}: each sequence gives few anchors. Longer answers "
            f"(generation.max_tokens), fewer cut sequences (tokens.max_length) or a smaller drafter.block_size help.",
            "fig-data-lengths",
            "Training data: tokens and supervised tokens per sequence",
            "generation.max_tokens",
        )
    ]


def engine_below_loop(record: Mapping, th: Mapping) -> list[Finding]:
    """An eval set's engine τ well below our loop's pooled τ (the same prompts)."""
    out = []
    for label, entry in (record.get("drafters") or {}).items():
        for set_name, s in (entry.get("sets") or {}).items():
            eng = s.get("engine") or {}
            ours = _num(s.get("tokens_per_step"))
            theirs = _num(eng.get("tau"))
            if ours and theirs is not None and theirs < th["engine_tau_ratio"] * ours:
                out.append(
                    Finding(
                        "engine_below_loop",
                        f"{label} on {set_name}: the engine's τ {theirs:.2f} is {100 * theirs / ours:.0f} % of our "
                        f"loop's {ours:.2f}: what the engine serves is not what was trained (dtype, block size, "
                        f"chat template or drafter config). Check the engine's arguments and log.",
                        "tau",
                        "τ per drafter and eval set (engine τ in the full evaluation table)",
                        "eval.engine_args",
                    )
                )
    return out


def long_context_collapse(record: Mapping, th: Mapping) -> list[Finding]:
    """τ of the trained drafter in the longest context-length bucket (all sets pooled, enough verify steps)
    well below its τ in the shortest."""
    labels = (record.get("settings") or {}).get("context_length_buckets_labels") or []
    pooled = (record.get("by_context_length") or {}).get("trained") or {}
    counted = [
        (lb, pooled[lb]) for lb in labels if lb in pooled and pooled[lb].get("num_steps", 0) >= th["min_bucket_steps"]
    ]
    if len(counted) < 2:
        return []
    (short_lb, short), (long_lb, long) = counted[0], counted[-1]
    if long["tau"] >= th["long_context_tau_ratio"] * short["tau"]:
        return []
    return [
        Finding(
            "long_context_collapse",
            f"τ falls from {short['tau']:.2f} at context {short_lb} to {long['tau']:.2f} at {long_lb} "
            f"({long['num_steps']} verify steps): the drafter has not learned long contexts. Train on longer "
            f"sequences (tokens.max_length, with long conversations in the data).",
            "tau-by-length",
            "τ by context length at verify time (table and plot)",
            "tokens.max_length",
        )
    ]


def _read_jsonl(path) -> list[dict]:
    p = Path(path) if path else None
    if not p or not p.is_file():
        return []
    return [json.loads(x) for x in p.read_text(encoding="utf-8").splitlines() if x.strip()]


def heldout_tau_falling(val_log: Sequence[Mapping], train_log: Sequence[Mapping], th: Mapping) -> list[Finding]:
    """Held-out τ fell from its best while the training loss went on falling (overfitting): needs three or
    more validations."""
    if len(val_log) < 3 or not train_log:
        return []
    best = max(val_log, key=lambda r: r["tau"])
    last = val_log[-1]
    if last is best or last["tau"] >= best["tau"] * (1 - th["heldout_tau_drop"]):
        return []

    def loss_at(step):
        before = [r for r in train_log if r["step"] <= step]
        return (before[-1] if before else train_log[0])["loss"]

    if loss_at(last["step"]) >= loss_at(best["step"]):
        return []
    return [
        Finding(
            "heldout_tau_falling",
            f"held-out τ peaked at {best['tau']:.2f} (step {best['step']}) and fell to {last['tau']:.2f} by step "
            f"{last['step']} while the training loss went on falling: the drafter is overfitting its training data. "
            f"Train fewer epochs (train.epochs), or on more data.",
            "fig-val-tau",
            "Held-out τ during training",
            "train.epochs",
        )
    ]


def failing_servers(endpoints: Mapping[str, Mapping], th: Mapping) -> list[Finding]:
    """An endpoint that failed most of the requests sent to it (the completion stats' per-endpoint counters)."""
    out = []
    for url, c in endpoints.items():
        attempts, failures = c.get("attempts") or 0, c.get("failures") or 0
        if attempts >= th["min_server_requests"] and failures >= th["server_failure_fraction"] * attempts:
            out.append(
                Finding(
                    "failing_server",
                    f"the server {url} failed {failures:,} of {attempts:,} requests "
                    f"({100 * failures / attempts:.0f} %); the others carried its work. Fix it or take it out of "
                    f"generation.endpoints.",
                    "generation",
                    "Generation per dataset (retries) and the shards' stats files (run.endpoints)",
                    "generation.endpoints",
                )
            )
    return out


# --- Gathering the inputs

#: A warning line of the completions job's chat-template check (dflash_pipeline.target.spans.check_template).
_TEMPLATE_WARNING = re.compile(r"^(chat template .*?: .*)$", re.M)


def template_warnings_from_logs(log_dir: str | Path) -> list[str]:
    """The chat-template warnings in the completions job logs under `log_dir` (each once, in file order)."""
    found: dict[str, None] = {}
    root = Path(log_dir)
    for log in sorted(root.rglob("*.log")) if root.is_dir() else []:
        for m in _TEMPLATE_WARNING.finditer(log.read_text(encoding="utf-8", errors="replace")):
            found.setdefault(m.group(1).strip())
    return list(found)


def endpoint_counts(completions_dir: str | Path) -> dict[str, dict]:
    """Per endpoint URL: `attempts`, `failures`, `taken_out` summed over the last run of every completion
    shard (`<shard>.stats.json` under `completions_dir`); {} for in-process generation."""
    from dflash_pipeline.core.contracts import run_stats

    total: dict[str, dict] = {}
    root = Path(completions_dir)
    for stats in sorted(root.glob("*/*.stats.json")) if root.is_dir() else []:
        for url, c in (run_stats(json.loads(stats.read_text(encoding="utf-8"))).get("endpoints") or {}).items():
            t = total.setdefault(url, {"attempts": 0, "failures": 0, "taken_out": 0})
            for k in t:
                t[k] += c.get(k) or 0
    return total


def run_findings(
    *,
    thresholds_: Mapping,
    generation_rows: Sequence[Mapping] = (),
    tokens_rows: Sequence[Mapping] = (),
    record: Optional[Mapping] = None,
    block_size: Optional[int] = None,
    train_log: str | Path | None = None,
    val_log: str | Path | None = None,
    template_warnings_: Sequence[str] = (),
    endpoints: Optional[Mapping[str, Mapping]] = None,
) -> list[Finding]:
    """Every check on a run's figures, in the order the page lists them. Missing inputs skip their checks."""
    record = record or {}
    block_size = block_size or (record.get("settings") or {}).get("block_size")
    th = thresholds_
    return [
        *truncated_completions(generation_rows, th),
        *few_supervised_tokens(tokens_rows, block_size, th),
        *thinking_mismatch(generation_rows, record),
        *template_warnings(template_warnings_),
        *failing_servers(endpoints or {}, th),
        *heldout_tau_falling(_read_jsonl(val_log), _read_jsonl(train_log), th),
        *long_context_collapse(record, th),
        *engine_below_loop(record, th),
    ]


def findings_html(findings: Sequence[Finding]) -> str:
    """`<section id="findings">`: one item per finding (its `data-kind`), each linking the table or
    figure behind it and naming the config key; a line saying there are none otherwise."""
    if not findings:
        items = '<p class="dflash-no-findings">No findings: none of the checks (report.findings) fired.</p>'
    else:
        lis = []
        for f in findings:
            where = (
                f'<a href="#{html.escape(f.figure)}">{html.escape(f.figure_label)}</a>'
                if f.figure
                else html.escape(f.figure_label)
            )
            lis.append(
                f'<li class="dflash-finding" data-kind="{html.escape(f.kind)}">{html.escape(f.message)} '
                f'<span class="dflash-finding-refs">See: {where}. Config key: <code>{html.escape(f.config_key)}</code>.'
                "</span></li>"
            )
        items = "<ul>" + "".join(lis) + "</ul>"
    return f'<section id="findings" class="dflash-findings"><h2>Findings</h2>{items}</section>'
