"""Writing and reading the eval stage's outputs: the eval record JSON, the τ table (TSV), the plots, and
comparisons of eval records (`merge_eval_records` refuses records of different thinking modes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Optional

from dflash_pipeline.core.contracts import EVAL_SCHEMA_VERSION
from dflash_pipeline.core.errors import PipelineError
from dflash_pipeline.core.shards import write_json, write_tsv


class EvalComparisonError(PipelineError):
    """Eval records that must not be compared (e.g. produced under different thinking modes)."""


# --- Comparing records


def check_comparable(records: Mapping[str, dict]) -> str:
    """Return the common thinking mode of eval records (name → record).

    Raises:
        EvalComparisonError: the records were produced under different thinking modes, or one does not say.
    """
    modes = {name: (r.get("settings") or {}).get("thinking") for name, r in records.items()}
    missing = [n for n, m in modes.items() if m is None]
    if missing:
        raise EvalComparisonError(f"eval record(s) {missing} do not record `settings.thinking`; re-run the eval stage")
    if len(set(modes.values())) > 1:
        detail = ", ".join(f"{n}: thinking={m}" for n, m in modes.items())
        raise EvalComparisonError(
            f"refusing to compare eval records produced under different thinking modes ({detail}); "
            "evaluate every drafter with the same `generation.thinking`"
        )
    return next(iter(modes.values())) if modes else "none"


def merge_eval_records(records: Mapping[str, dict]) -> dict:
    """Side-by-side record of several eval records (name → record): drafters become `<name>/<label>`,
    each keeping the settings it was measured under. Refuses mixed thinking modes (`check_comparable`).
    """
    thinking = check_comparable(records)
    merged: dict = {"schema_version": EVAL_SCHEMA_VERSION, "thinking": thinking, "drafters": {}, "settings": {}}
    for name, rec in records.items():
        merged["settings"][name] = rec["settings"]
        for label, entry in rec["drafters"].items():
            merged["drafters"][f"{name}/{label}"] = {**entry, "settings": rec["settings"]}
    return merged


# --- The τ table and the record's files


TABLE_COLUMNS = (
    "drafter",
    "set",
    "tau",
    "tau_over_untrained",
    "tokens_per_target_forward",
    "accept_pos1",
    "num_responses",
    "num_steps",
    "thinking",
    "temperature",
    "block_size",
    "max_new_tokens",
    "train_steps",
    "zero_target_features",
    "checkpoint",
    "tau_pooled",
    "engine_tau",
    "engine_agrees",  # engine τ (evaluate_engine): pooled over steps, both sides
)


def eval_table_rows(record: dict) -> list[dict]:
    """One row per (drafter, set) with τ and the settings that produced it (`TABLE_COLUMNS`)."""
    rows = []
    ratios = record.get("tau_over_untrained") or {}
    for label, entry in record["drafters"].items():
        st = entry.get("settings") or record["settings"]
        for set_name, s in entry["sets"].items():
            pos = s.get("per_position_acceptance") or []
            rows.append(
                {
                    "drafter": label,
                    "set": set_name,
                    "tau": round(s["tau"], 3),
                    "tau_over_untrained": round(ratios[label][set_name], 2) if label in ratios else "",
                    "tokens_per_target_forward": round(s.get("tokens_per_target_forward", 0.0), 3),
                    "accept_pos1": round(pos[0], 3) if pos else "",
                    "num_responses": s["num_responses"],
                    "num_steps": s["num_steps"],
                    "thinking": st["thinking"],
                    "temperature": st["temperature"],
                    "block_size": st["block_size"],
                    "max_new_tokens": st["max_new_tokens"],
                    "train_steps": entry.get("train_steps", ""),
                    "zero_target_features": entry.get("zero_target_features", ""),
                    "checkpoint": entry.get("checkpoint") or "(random init)",
                    **_engine_columns(s),
                }
            )
    return rows


def _engine_columns(s: dict) -> dict:
    """`tau_pooled` (mean a+1 over verify steps), `engine_tau` and `engine_agrees` of one set's stats."""
    eng = s.get("engine") or {}
    return {
        "tau_pooled": round(s.get("tokens_per_step", 0.0), 3),
        "engine_tau": round(eng["tau"], 3) if eng else "",
        "engine_agrees": {True: "yes", False: "NO", None: "?"}[eng.get("agrees")] if eng else "",
    }


def write_eval_table(record: dict, path: str | Path) -> None:
    """TSV of `eval_table_rows` (the report shows it as a table)."""
    write_tsv(path, TABLE_COLUMNS, eval_table_rows(record))


def write_eval_outputs(record: dict, out_json: str | Path, *, plot_png=None, table_tsv=None) -> None:
    """Write the eval record JSON (atomic), and the PNG plot / TSV table when asked."""
    write_json(out_json, record, skip_if_identical=False)
    if plot_png is not None:
        plot_acceptance(record, plot_png)
    if table_tsv is not None:
        write_eval_table(record, table_tsv)


# --- Plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    _pyplot().close(fig)


def plot_acceptance(record: dict, path: str | Path) -> None:
    """PNG: per-position acceptance (k = 1..B−1), one panel per eval set (two panels per row, so each stays
    readable at any number of sets), one line per drafter, τ in the legend."""
    plt = _pyplot()
    set_names = list(next(iter(record["drafters"].values()))["sets"]) if record["drafters"] else []
    n = max(1, len(set_names))
    cols = min(2, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.0 * cols, 3.8 * rows), dpi=110, squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_axis_off()
    for ax, set_name in zip(axes.flat, set_names or [None]):
        for label, entry in record["drafters"].items():
            s = entry["sets"].get(set_name)
            if s is None:
                continue
            ks = list(range(1, len(s["per_position_acceptance"]) + 1))
            ax.plot(ks, s["per_position_acceptance"], marker="o", label=f"{label} (τ={s['tau']:.2f})")
        ax.set_title(set_name or "")
        ax.set_xlabel("draft position k")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylabel("P(accepted ≥ k)")
        ax.legend(fontsize=8)
    st = record["settings"]
    fig.suptitle(
        f"DFlash acceptance — block {st['block_size']}, T={st['temperature']}, thinking={st['thinking']}", fontsize=10
    )
    _save(fig, path)


def read_train_log(path: str | Path) -> list[dict]:
    """Records of a `train_log.jsonl` (empty when the file does not exist)."""
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


def plot_tau_vs_step(series: dict, path: str | Path, *, train_log: Optional[str | Path] = None) -> None:
    """PNG: τ per eval set across the intermediate checkpoints; the train-time EAL proxy (dashed) beside it."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    pts = series["points"]
    set_names = list(pts[0]["sets"]) if pts else []
    for set_name in set_names:
        ax.plot(
            [p["step"] for p in pts],
            [p["sets"][set_name]["tau"] for p in pts],
            marker="o",
            label=f"τ {set_name} (n={series['num_prompts'].get(set_name, '?')})",
        )
    log = read_train_log(train_log) if train_log else []
    if log:
        ax.plot([r["step"] for r in log], [r["eal"] for r in log], ls="--", color="gray", label="train EAL proxy")
    if not pts and not log:
        ax.text(0.5, 0.5, "no intermediate checkpoints", ha="center", va="center", transform=ax.transAxes)
    st = series["settings"]
    ax.set_xlabel("training step")
    ax.set_ylabel("acceptance length τ")
    ax.set_ylim(bottom=0.9)
    ax.set_title(
        f"τ across checkpoints — block {st['block_size']}, T={st['temperature']}, thinking={st['thinking']}",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    _save(fig, path)


def plot_validation(val_log: str | Path, path: str | Path, *, placeholder: bool = False) -> None:
    """PNG of held-out τ vs optimizer step from the trainer's `val_log.jsonl`: the per-block simulator, the product
    of marginal slot accuracies beside it and, when the records hold more than one context-length bucket, held-out τ per
    bucket (dotted).

    Without records nothing is written, unless `placeholder` (the report's figure): then a figure saying
    that the run had no held-out validation (`train.validation_fraction: 0`)."""
    val_log, path = Path(val_log), Path(path)
    recs = (
        [json.loads(x) for x in val_log.read_text(encoding="utf-8").splitlines() if x.strip()]
        if val_log.is_file()
        else []
    )
    if not recs and not placeholder:
        return
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if recs:
        ax.plot(
            [r["step"] for r in recs], [r["tau"] for r in recs], marker="o", label="held-out τ (per-block simulator)"
        )
        ax.plot(
            [r["step"] for r in recs],
            [r["tau_marginal"] for r in recs],
            ls="--",
            label="product of marginal accuracies",
        )
        buckets = list(dict.fromkeys(b for r in recs for b in (r.get("by_context_length") or {})))
        for b in buckets if len(buckets) > 1 else []:  # held-out τ by context length (train.validation_length_buckets)
            pts = [
                (r["step"], r["by_context_length"][b]["tau"]) for r in recs if b in (r.get("by_context_length") or {})
            ]
            ax.plot([x for x, _ in pts], [y for _, y in pts], ls=":", marker=".", label=f"context {b}")
        ax.legend(fontsize=8)
        if len(recs) == 1:  # one point is not a curve: say so on the figure
            ax.text(
                0.5,
                0.6,
                f"one validation (step {recs[0]['step']}): τ = {recs[0]['tau']:.2f}\n"
                "set train.validation_every_steps below the run's steps for a curve",
                ha="center",
                transform=ax.transAxes,
                fontsize=9,
            )
    else:
        ax.text(
            0.5,
            0.5,
            "no held-out validation in this run\n(train.validation_fraction: 0)",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("τ (accepted tokens / block)")
    fig.tight_layout()
    _save(fig, path)


def plot_training(train_logs: Mapping[str, str | Path], path: str | Path) -> None:
    """PNG: training loss and EAL proxy vs step, one line per run (label → `train_log.jsonl`)."""
    plt = _pyplot()
    fig, (ax_loss, ax_eal) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
    for label, log_path in train_logs.items():
        log = read_train_log(log_path)
        if not log:
            continue
        steps = [r["step"] for r in log]
        ax_loss.plot(steps, [r["loss"] for r in log], label=label)
        ax_eal.plot(steps, [r["eal"] for r in log], label=label)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("decayed CE loss")
    ax_loss.set_yscale("log")
    ax_eal.set_xlabel("step")
    ax_eal.set_ylabel("EAL proxy (from slot accuracy)")
    for ax in (ax_loss, ax_eal):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("Training curves (train_log.jsonl)", fontsize=10)
    _save(fig, path)
