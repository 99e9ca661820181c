"""The plots drawn for the report's landing page (`.page`): τ per eval set, τ by context length, the
training data's length histograms and the per-position acceptance, as PNG files or bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> None:
    """Write `fig` as a PNG (atomically: a half-written plot never reaches the page) and close it."""
    import io

    from dflash_pipeline.core.shards import atomic_write_bytes

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    _pyplot().close(fig)
    atomic_write_bytes(path, buf.getvalue(), skip_if_identical=False)


def plot_tau_per_set(record: Mapping, path: str | Path) -> None:
    """PNG: τ per eval set (groups) and drafter (bars), the value on each bar."""
    plt = _pyplot()
    drafters = list(record.get("drafters") or {})
    sets = list(next(iter(record["drafters"].values()))["sets"]) if drafters else []
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(sets) + 2), 3.6), dpi=110)
    width = 0.8 / max(1, len(drafters))
    for i, label in enumerate(drafters):
        xs = [j + (i - (len(drafters) - 1) / 2) * width for j in range(len(sets))]
        ys = [record["drafters"][label]["sets"][s]["tau"] for s in sets]
        bars = ax.bar(xs, ys, width=width * 0.95, label=label)
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=7)
    ax.set_xticks(range(len(sets)), sets)
    ax.set_ylabel("acceptance length τ")
    bs = (record.get("settings") or {}).get("block_size")
    if bs:
        ax.axhline(bs, ls=":", color="gray", lw=0.8)
        ax.set_ylim(0, bs * 1.08)
    ax.set_title(f"τ per eval set (max = block size {bs})", fontsize=10)
    if drafters:
        ax.legend(fontsize=8)
    _save(fig, path)


def plot_tau_by_length(record: Mapping, path: str | Path) -> None:
    """PNG: τ per context-length bucket (`by_context_length` of the eval record), one line per drafter (all
    sets pooled, solid) and per drafter and set (thin); a record without buckets gets a figure saying so."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    labels = (record.get("settings") or {}).get("context_length_buckets_labels") or []
    pooled = record.get("by_context_length") or {}
    if not labels or not pooled:
        ax.text(
            0.5,
            0.5,
            "no τ by context length in this eval record\n(rerun the eval stage: -R evaluate_acceptance)",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        ax.set_axis_off()
        _save(fig, path)
        return
    x = {lb: i for i, lb in enumerate(labels)}
    for _n, (label, buckets) in enumerate(pooled.items()):
        pts = [(x[b], v["tau"], v["num_steps"]) for b, v in buckets.items() if b in x]
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", lw=2, label=f"{label} (all sets)")
        for px, py, steps in pts:
            ax.annotate(
                f"{steps} steps",
                (px, py),
                textcoords="offset points",
                xytext=(0, 6),
                fontsize=6,
                ha="center",
                color=line.get_color(),
            )
        for _set_name, s in (record["drafters"][label].get("sets") or {}).items():
            bl = s.get("by_context_length") or {}
            if len(bl) > 1:
                sp = [(x[b], v["tau"]) for b, v in bl.items() if b in x]
                ax.plot([p[0] for p in sp], [p[1] for p in sp], lw=0.7, ls="--", color=line.get_color(), alpha=0.6)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlim(-0.5, len(labels) - 0.5)
    ax.set_xlabel("context length at verify time (tokens)")
    ax.set_ylabel("acceptance length τ")
    ax.set_title("τ by context length (dashed: per eval set)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def data_length_histograms(token_shards: Sequence[str | Path]) -> dict:
    """Tokens and supervised tokens per training sequence of the token shards (their `num_tokens` and
    `num_loss_tokens` columns): `{num_sequences, tokens: [...], supervised: [...]}` (per sequence)."""
    import pyarrow.parquet as pq

    tokens, supervised = [], []
    for path in token_shards:
        t = pq.read_table(path, columns=["num_tokens", "num_loss_tokens"])
        tokens += t.column("num_tokens").to_pylist()
        supervised += t.column("num_loss_tokens").to_pylist()
    return {"num_sequences": len(tokens), "tokens": tokens, "supervised": supervised}


def plot_data_lengths(token_shards: Sequence[str | Path], path: str | Path) -> dict:
    """PNG: histograms of tokens per training sequence and supervised tokens per sequence. Returns the summary
    `{num_sequences, tokens: {mean, p50, p95, max}, supervised: {...}}`."""
    import numpy as np

    h = data_length_histograms(token_shards)
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), dpi=110)
    summary = {"num_sequences": h["num_sequences"]}
    for ax, key, title in (
        (axes[0], "tokens", "tokens per sequence"),
        (axes[1], "supervised", "supervised tokens per sequence"),
    ):
        xs = np.asarray(h[key], dtype=float)
        if len(xs):
            ax.hist(xs, bins=min(40, max(5, len(set(xs.tolist())))), color="#3b6ea5")
            summary[key] = {
                "mean": round(float(xs.mean()), 1),
                "p50": float(np.percentile(xs, 50)),
                "p95": float(np.percentile(xs, 95)),
                "max": int(xs.max()),
            }
            ax.set_title(
                f"{title}: mean {xs.mean():.0f}, p95 {np.percentile(xs, 95):.0f}, max {int(xs.max())}", fontsize=9
            )
        else:
            ax.set_title(f"{title}: no sequences", fontsize=9)
        ax.set_xlabel("tokens")
        ax.set_ylabel("sequences")
        ax.grid(alpha=0.3)
    fig.suptitle(f"Training data: {h['num_sequences']} sequences (token shards)", fontsize=10)
    _save(fig, path)
    return summary


def plot_per_position(record: Mapping) -> bytes:
    """PNG bytes: per-position acceptance P(accepted ≥ k) against draft position k, one line per eval set of
    the trained drafter (solid) and the untrained floor pooled over sets (grey, dashed); τ in the legend."""
    import io

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.2), dpi=110)
    drafters = record.get("drafters") or {}
    main = drafters.get("trained") or next(iter(drafters.values()))
    for set_name, s in (main.get("sets") or {}).items():
        pos = s.get("per_position_acceptance") or []
        ax.plot(range(1, len(pos) + 1), pos, marker="o", lw=2, label=f"{set_name} (τ={s['tau']:.2f})")
    for label, entry in drafters.items():
        if entry is main:
            continue
        sets = [s.get("per_position_acceptance") or [] for s in (entry.get("sets") or {}).values()]
        sets = [p for p in sets if p]
        if sets:
            k = min(len(p) for p in sets)
            mean = [sum(p[i] for p in sets) / len(sets) for i in range(k)]
            ax.plot(range(1, k + 1), mean, ls="--", color="gray", lw=1.2, label=f"{label} (mean over sets)")
    st = record.get("settings") or {}
    ax.set_xlabel("draft position k", fontsize=11)
    ax.set_ylabel("P(accepted ≥ k)", fontsize=11)
    ax.set_ylim(0, 1.02)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.tick_params(labelsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9, loc="upper right")
    ax.set_title(
        f"Per-position acceptance of the trained drafter: block {st.get('block_size')}, T={st.get('temperature')}, "
        f"thinking={st.get('thinking')}",
        fontsize=11,
    )
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()
