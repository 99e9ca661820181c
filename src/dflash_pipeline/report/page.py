"""The report's landing page (`results/report/summary.html`): the page a person reads first after a run.

A self-contained HTML document (plots embedded as `data:` URIs): a header (target, drafter, steps, wall
time, data counts), the findings (`.findings`), the τ tables, the plots, the data tables, and the eval
record folded away. Tables are `.tables`'s; the plots of τ per set, τ by context length and the length
histogram are drawn here.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Mapping, Optional, Sequence

from dflash_pipeline.core.provenance import provenance_line
from dflash_pipeline.report.plots import (  # noqa: F401 (re-exported: the page's plots)
    data_length_histograms,
    plot_data_lengths,
    plot_per_position,
    plot_tau_by_length,
    plot_tau_per_set,
)

#: Scoped to the page's own elements: embedded in `snakemake --report` it must not restyle the report.
PAGE_STYLE = """
#dflash-run-summary{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:1.5em auto;
max-width:1200px;color:#1d232a;padding:0 1em}
header.dflash-header{border-bottom:2px solid #3b6ea5;margin-bottom:1em}
header.dflash-header h1{font-size:1.5em;margin:.2em 0}
p.dflash-facts{font-size:.95em;margin:.3em 0 .8em}
.dflash-figures{display:flex;flex-wrap:wrap;gap:1em}
.dflash-figures figure{margin:0;flex:1 1 520px;max-width:100%}
.dflash-figures figure.dflash-wide{flex-basis:100%}
section.dflash-findings{border-left:4px solid #c0392b;background:#fdf3f2;padding:.3em 1em;margin:1em 0}
section.dflash-findings h2{font-size:1.15em;margin:.4em 0}section.dflash-findings li{margin:.35em 0}
.dflash-finding-refs{color:#444;font-size:.92em}
.dflash-figures img{max-width:100%;height:auto;border:1px solid #dde}
.dflash-figures figcaption{font-size:.85em;color:#444}
details.dflash-details{margin:1em 0}details.dflash-details>summary{cursor:pointer;font-weight:600}
"""


def png_data_uri(path: str | Path | bytes) -> str:
    """`data:image/png;base64,…` of a PNG file (or its bytes).

    Raises:
        ValueError: the bytes are not a PNG (a plot that failed half-way must not become a broken image).
    """
    data = path if isinstance(path, bytes) else Path(path).read_bytes()
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        raise ValueError(f"{path if not isinstance(path, bytes) else 'image bytes'}: not a PNG file")
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


#: Figures drawn across the whole width of the page (several panels or many lines).
WIDE_FIGURES = ("fig-acceptance", "fig-data-lengths")


def figures_html(figures: Sequence[tuple[str, str | bytes, str]]) -> str:
    """`<section id="plots">` of `(figure id, PNG path or PNG bytes, caption)` figures, each image as a
    data URI; figures whose file is missing are left out."""
    items = []
    for fig_id, path, caption in figures:
        if not path or (not isinstance(path, bytes) and not Path(path).is_file()):
            continue
        wide = ' class="dflash-wide"' if fig_id in WIDE_FIGURES else ""
        items.append(
            f'<figure id="{html.escape(fig_id)}"{wide}><img src="{png_data_uri(path)}" alt="{html.escape(caption)}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>"
        )
    if not items:
        return ""
    return (
        '<section id="plots" class="dflash-summary"><h3>Plots</h3><div class="dflash-figures">'
        + "".join(items)
        + "</div></section>"
    )


def _human_seconds(s: Optional[float]) -> str:
    if s is None:
        return "?"
    m, sec = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    return f"{h} h {m} min" if h else (f"{m} min {sec} s" if m else f"{sec} s")


def _v(x) -> str:
    """A fact for the header, escaped; `?` when unknown."""
    return "?" if x is None or x == "" else html.escape(str(x))


def header_html(run: str, facts: Mapping) -> str:
    """The page header: run name and target, then one line per kind of fact (`run_facts`; unknown ones
    show as `?`)."""
    target = facts.get("target") or {}
    drafter = facts.get("drafter") or {}
    lines = [
        f"<b>target</b> {_v(target.get('path'))} ({_v(target.get('model_type'))}, "
        f"{_v(target.get('num_layers'))} layers)",
        f"<b>drafter</b> {_v(drafter.get('family'))}: {_v(drafter.get('num_draft_layers'))} layers, block size "
        f"{_v(drafter.get('block_size'))}, {_params(drafter.get('trainable_params'))} trainable parameters, "
        f"loss {_v(drafter.get('loss'))}",
        f"<b>steps</b> {_v(facts.get('train_steps'))} · <b>wall time</b> {_human_seconds(facts.get('wall_s'))} "
        f"(jobs summed; training {_human_seconds(facts.get('train_s'))}, eval {_human_seconds(facts.get('eval_s'))})",
        "<b>data</b> " + html.escape(data_line(facts.get("data") or {})),
    ]
    heldout = facts.get("heldout") or {}
    if heldout.get("points") == 1:  # one validation: a line, not a plot of one point
        lines.append(
            f"<b>held-out τ</b> {heldout['tau']:.2f} at step {_v(heldout.get('step'))} (one validation, at the end of "
            "training; set <code>train.validation_every_steps</code> below the run's steps for a curve)"
        )
    if facts.get("stream"):
        lines.append("<b>features streamed</b> " + html.escape(stream_line(facts["stream"])))
    for what, prov in (("training", facts.get("train_provenance")), ("eval", facts.get("eval_provenance"))):
        if prov:
            lines.append(f"<b>{what} made with</b> " + html.escape(provenance_line(prov)))
    return (
        f'<header id="run-header" class="dflash-header"><h1>Run {html.escape(run)}: a DFlash drafter for '
        f"{_v(target.get('path'))}</h1>" + "".join(f'<p class="dflash-facts">{ln}</p>' for ln in lines) + "</header>"
    )


def stream_line(stream: Mapping) -> str:
    """Supply and demand of a `target_features: stream` run in one line, from `train_summary.json`'s `stream`:
    servers, the tokens/s they served, the tokens/s the trainer consumed and would consume if it never waited, the share
    of the run spent waiting for features, the suggested servers per trainer rank, and the peak scratch bytes."""

    def rate(key):
        x = stream.get(key)
        return f"{x:,.0f}" if isinstance(x, (int, float)) else "?"

    wait = stream.get("wait_fraction")
    peak = stream.get("peak_scratch_bytes")
    return (
        f"{stream.get('servers', '?')} server{'' if stream.get('servers') == 1 else 's'} at "
        f"{rate('server_tokens_per_s')} tokens/s; trainer "
        f"{rate('trainer_tokens_per_s')} tokens/s (demand {rate('trainer_demand_tokens_per_s')}), waiting "
        + (f"{100 * wait:.1f} %" if isinstance(wait, (int, float)) else "?")
        + f" of the time; suggested servers per trainer rank: {stream.get('suggested_servers_per_rank', '?')}; "
        + f"peak scratch {f'{peak:,} B' if isinstance(peak, int) else '?'}"
    )


def _params(n) -> str:
    if not isinstance(n, (int, float)):
        return "?"
    return f"{n / 1e9:.2f} B" if n >= 1e9 else (f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n / 1e3:.1f} K")


def data_line(data: Mapping) -> str:
    """The data counts in one line: prompts kept → conversations generated → sequences and supervised tokens
    → eval prompts per set (unknown counts as `?`)."""

    def v(key):
        return "?" if data.get(key) in (None, "") else str(data[key])

    evals = ", ".join(f"{k} {n}" for k, n in (data.get("eval_prompts") or {}).items())
    return (
        f"{v('prompts_kept')} prompts kept → {v('conversations')} conversations ({v('ok')} ok) → "
        f"{v('sequences')} sequences, {v('tokens')} tokens, {v('supervised_tokens')} supervised → "
        f"eval prompts: {evals or '?'}"
    )


# --- Facts of the run (header)


def _read_json_or_none(path) -> Optional[dict]:
    from dflash_pipeline.core.shards import read_json

    return read_json(path) if path and Path(path).is_file() else None


def _benchmark_total(benchmark_dir: Optional[str | Path], rule: Optional[str] = None) -> Optional[float]:
    """Summed wall seconds (column `s`) of the Snakemake benchmark TSVs under `benchmark_dir` (of one rule:
    `benchmark_dir/<rule>/`); None when there are none."""
    from dflash_pipeline.report.tables import _benchmark_seconds

    if not benchmark_dir:
        return None
    root = Path(benchmark_dir) / rule if rule else Path(benchmark_dir)
    secs = [s for s in (_benchmark_seconds(p) for p in sorted(root.rglob("*.tsv"))) if s is not None]
    return sum(secs) if secs else None


def _val_records(path: Path) -> list[dict]:
    """The records of a `val_log.jsonl` (held-out τ during training); [] when there is none."""
    import json

    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def run_facts(
    *,
    eval_json=None,
    probe_json=None,
    checkpoint=None,
    prompts_rows=(),
    generation_rows=(),
    tokens_rows=(),
    benchmark_dir=None,
    extra_benchmarks: Sequence[str | Path] = (),
) -> dict:
    """What the header shows, from the run's records (any may be missing; its facts are then None).

    `checkpoint`: the drafter's `final/` (its `config.json`; `train_summary.json` beside it).
    `benchmark_dir`: `results/benchmarks` (wall time: the jobs' summed seconds). Rows: the report tables.
    """
    from dflash_pipeline.report.tables import _benchmark_seconds

    record = _read_json_or_none(eval_json) or {}
    probe = _read_json_or_none(probe_json) or {}
    ckpt = Path(checkpoint) if checkpoint else None
    cfg = _read_json_or_none(ckpt / "config.json") if ckpt else None
    summary = _read_json_or_none(ckpt.parent / "train_summary.json") if ckpt else None
    cfg, summary = cfg or {}, summary or {}
    trained = (record.get("drafters") or {}).get("trained") or {}
    total = _benchmark_total(benchmark_dir)
    extra = [s for s in (_benchmark_seconds(Path(p)) for p in extra_benchmarks) if s is not None]

    def all_row(rows):
        rows = list(rows)
        return next((r for r in rows if r.get("dataset") == "all"), rows[-1] if rows else {})

    gen, tok = all_row(generation_rows), all_row(tokens_rows)
    val = _val_records(ckpt.parent / "val_log.jsonl") if ckpt else []
    return {
        "target": {
            "path": (record.get("target") or {}).get("path") or probe.get("path"),
            "model_type": probe.get("model_type") or (record.get("target") or {}).get("model_type"),
            "num_layers": probe.get("num_hidden_layers"),
        },
        "drafter": {
            "family": ", ".join(cfg.get("architectures") or []) or None,
            "num_draft_layers": cfg.get("num_hidden_layers"),
            "block_size": cfg.get("block_size"),
            "trainable_params": summary.get("trainable_params"),
            "loss": summary.get("loss"),
        },
        "train_steps": trained.get("train_steps") or summary.get("steps"),
        "heldout": {"points": len(val), "tau": val[-1]["tau"], "step": val[-1]["step"]} if val else None,
        "stream": summary.get("stream"),  # supply and demand of streamed features (None unless streamed)
        "train_provenance": summary.get("provenance"),  # software, kernels, device, dtype, target digest
        "eval_provenance": record.get("provenance"),
        "wall_s": (total or 0.0) + sum(extra) if total is not None or extra else None,
        "train_s": _benchmark_total(benchmark_dir, "train_drafter"),
        "eval_s": _benchmark_total(benchmark_dir, "evaluate_acceptance"),
        "data": {
            "prompts_kept": sum(int(r.get("kept") or 0) for r in prompts_rows) if prompts_rows else None,
            "conversations": gen.get("conversations"),
            "ok": gen.get("ok"),
            "sequences": tok.get("records_out"),
            "tokens": tok.get("num_tokens"),
            "supervised_tokens": tok.get("num_loss_tokens"),
            "eval_prompts": {k: v.get("num_prompts") for k, v in (record.get("sets") or {}).items()},
        },
    }


# --- The page


def length_table_rows(record: Mapping) -> tuple[list[str], list[dict]]:
    """τ by context length as table rows: one per drafter and set (and `all sets`), one column per bucket (`τ (verify
    steps)`), plus the engine's per set where it reported them; empty when the record has no buckets."""
    labels = (record.get("settings") or {}).get("context_length_buckets_labels") or []
    if not labels:
        return [], []
    rows = []

    def cell(b):
        return (
            f"{b['tau']:.3f} ({b['num_steps']})"
            if b.get("basis") is None
            else f"{b['tau']:.3f} ({b['num_responses']} req.)"
        )

    def cells(buckets):
        return {lb: cell(buckets[lb]) if lb in buckets else "" for lb in labels}

    for label, entry in (record.get("drafters") or {}).items():
        for set_name, s in (entry.get("sets") or {}).items():
            rows.append({"drafter": label, "set": set_name, **cells(s.get("by_context_length") or {})})
            engine = (s.get("engine") or {}).get("by_context_length")
            if engine:
                rows.append({"drafter": f"{label} (engine)", "set": set_name, **cells(engine)})
        pooled = (record.get("by_context_length") or {}).get(label)
        if pooled:
            rows.append({"drafter": label, "set": "all sets", **cells(pooled)})
    return ["drafter", "set", *labels], rows


def _eval_details_html(tau_tsv: str | Path | None, record: Mapping) -> str:
    """The folded part of `summary_page` (`id="eval-details"`): every column of `acceptance.tsv` and
    the eval record's summary; "" when neither exists."""
    from dflash_pipeline.report import tables as R

    folded = []
    if tau_tsv and Path(tau_tsv).is_file():
        cols, rows = R.read_tsv(tau_tsv)
        folded.append(
            R.html_table(cols, rows, title="Evaluation table (every column of acceptance.tsv)", table_id="eval-table")
        )
    if record:
        folded.append(
            R.html_table(
                ["key", "value"], R.eval_summary_rows(record), title="Evaluation record", table_id="eval-record"
            )
        )
    if not folded:
        return ""
    return (
        '<details id="eval-details" class="dflash-details"><summary>Evaluation record and full table'
        "</summary>" + "".join(folded) + "</details>"
    )


def summary_page(
    out_html: str | Path,
    *,
    run: str,
    facts: Mapping,
    tau_tsv: str | Path | None = None,
    eval_json: str | Path | None = None,
    tables: Sequence[tuple[str | Path | None, str, str]] = (),
    figures: Sequence[tuple[str, str, str]] = (),
    outputs: Sequence[tuple[str, str]] = (),
    findings: Sequence = (),
) -> str:
    """Write the landing page (module docstring) atomically and return it.

    Args:
        out_html: the page.
        run: run name. facts: `run_facts`.
        tau_tsv: `acceptance.tsv`.
        eval_json: `acceptance.json`.
        tables: `(TSV path, title, table id)` of the data tables (missing files left out).
        figures: `(figure id, PNG path, caption)`, embedded as data URIs in this order (missing ones left out).
        outputs: `(what, path)` rows of "where the outputs are".
        findings: `report.findings.Finding` s, listed under the header.
    """
    from dflash_pipeline.core.shards import atomic_write_bytes, read_json
    from dflash_pipeline.report import tables as R
    from dflash_pipeline.report.findings import findings_html

    record = read_json(eval_json) if eval_json and Path(eval_json).is_file() else {}
    body = [header_html(run, facts), findings_html(findings)]
    if tau_tsv and Path(tau_tsv).is_file():
        pcols, prows = R.tau_pivot(R.read_tsv(tau_tsv)[1])
        body.append(
            R.html_table(
                pcols,
                prows,
                title="τ per drafter and eval set",
                table_id="tau",
                relabel=False,
                note="τ: mean over responses of (accepted drafts + 1) per verify step (max = block size).",
            )
        )
    lcols, lrows = length_table_rows(record)
    if lrows:
        body.append(
            R.html_table(
                lcols,
                lrows,
                title="τ by context length at verify time",
                table_id="tau-by-length",
                relabel=False,
                note="τ of the verify steps whose context (prompt + tokens so far) falls "
                "in the bucket; in brackets the verify steps counted.",
            )
        )
    body.append(figures_html(figures))
    for path, title, tid in tables:
        if path and Path(path).is_file():
            cols, rows = R.read_tsv(path)
            body.append(R.html_table(cols, rows, title=title, table_id=tid))
    if outputs:
        body.append(
            R.html_table(
                ["what", "path"],
                [{"what": w, "path": p} for w, p in outputs],
                title="Where the outputs are",
                table_id="outputs",
            )
        )
    body.append(_eval_details_html(tau_tsv, record))
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>dflash-pipeline run {html.escape(run)}</title><style>{PAGE_STYLE}</style>{R.SUMMARY_STYLE}</head>"
        f'<body><div id="dflash-run-summary">' + "\n".join(b for b in body if b) + "</div></body></html>\n"
    )
    atomic_write_bytes(out_html, page.encode("utf-8"), skip_if_identical=False)
    return page


#: The page's figures, in order: (figure id, summarize_run input/output name, caption).
RUN_FIGURES = (
    ("fig-tau-per-set", "tau_per_set", "τ per eval set and drafter"),
    ("fig-acceptance", "acceptance_plot", "Per-position acceptance: share of verify steps accepting ≥ k drafts"),
    ("fig-tau-by-length", "tau_by_length", "τ by context length at verify time"),
    ("fig-tau-vs-step", "tau_vs_step", "τ across the training checkpoints (first prompts of each set)"),
    ("fig-train-curves", "train_curves", "Training loss and EAL proxy"),
    ("fig-val-tau", "val_tau", "Held-out τ during training (per context-length bucket when there are several)"),
    ("fig-data-lengths", "data_lengths", "Training data: tokens and supervised tokens per sequence"),
)


def run_figures(inputs, outputs, record: Optional[Mapping] = None) -> list[tuple[str, str | bytes, str]]:
    """`RUN_FIGURES` as `(figure id, path or PNG bytes, caption)`, the path taken from the job's named `inputs` or
    `outputs`.

    With the eval `record` the per-position acceptance is drawn here instead of the eval stage's per-set panels.
    Held-out τ is left out when the run validated fewer than twice."""
    out = []
    drafter = getattr(inputs, "drafter", None)
    val_points = len(_val_records(Path(str(drafter)).parent / "val_log.jsonl")) if drafter else 0
    for fig_id, name, caption in RUN_FIGURES:
        path = getattr(outputs, name, None) or getattr(inputs, name, None)
        if fig_id == "fig-val-tau" and drafter and val_points < 2:
            continue
        if fig_id == "fig-acceptance" and record and record.get("drafters"):
            out.append((fig_id, plot_per_position(record), caption))
            continue
        out.append((fig_id, str(path) if path else "", caption))
    return out
