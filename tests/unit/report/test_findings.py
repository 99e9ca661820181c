"""The landing page's findings (dflash_pipeline.report.findings): each kind is built from synthetic result files
of a run that has the problem, and the page must name it, link the table or figure behind it and name the config
key that changes it; a healthy run has none."""

from __future__ import annotations

import json

import pytest

from dflash_pipeline.core.shards import write_tsv
from dflash_pipeline.report import findings as F
from dflash_pipeline.report import page as report_page
from dflash_pipeline.report import tables as R

TH = F.thresholds()


def _stats(tau, *, engine=None, buckets=None):
    s = {
        "tau": tau,
        "tokens_per_step": tau,
        "per_position_acceptance": [0.7, 0.5, 0.3],
        "num_responses": 8,
        "num_steps": 40,
        "by_context_length": buckets or {},
    }
    if engine is not None:
        s["engine"] = {"tau": engine, "agrees": engine > 0.9 * tau}
    return s


def _record(*, thinking="disable", engine=None, pooled=None) -> dict:
    return {
        "settings": {
            "block_size": 8,
            "temperature": 0.0,
            "thinking": thinking,
            "max_new_tokens": 96,
            "context_length_buckets_labels": ["<256", "256–512", "≥512"],
        },
        "sets": {"gsm8k": {"num_prompts": 8}},
        "drafters": {
            "trained": {"train_steps": 200, "sets": {"gsm8k": _stats(3.0, engine=engine)}},
            "untrained": {"train_steps": 0, "sets": {"gsm8k": _stats(1.0)}},
        },
        "by_context_length": {"trained": pooled or {}},
    }


def _generation(tmp_path, *, conversations=1000, truncated=10, thinking="disable"):
    path = tmp_path / "generation.tsv"
    rows = [
        {
            "dataset": "all",
            "conversations": conversations,
            "ok": conversations - truncated,
            "truncated": truncated,
            "thinking": thinking,
        }
    ]
    write_tsv(path, ("dataset", "conversations", "ok", "truncated", "thinking"), rows)
    return path


def _tokens(tmp_path, *, sequences=1000, supervised=90_000):
    path = tmp_path / "tokens.tsv"
    rows = [{"dataset": "all", "records_out": sequences, "num_tokens": 3 * supervised, "num_loss_tokens": supervised}]
    write_tsv(path, ("dataset", "records_out", "num_tokens", "num_loss_tokens"), rows)
    return path


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _page(tmp_path, **kw) -> tuple[list, str]:
    """Findings of a run from its files (defaults: a healthy run), and the landing page that lists them."""
    gen = kw.pop("generation", None) or _generation(tmp_path)
    tok = kw.pop("tokens", None) or _tokens(tmp_path)
    record = kw.pop("record", None) or _record()
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    found = F.run_findings(
        thresholds_=kw.pop("thresholds", TH),
        generation_rows=R.read_tsv(gen)[1],
        tokens_rows=R.read_tsv(tok)[1],
        record=record,
        train_log=kw.pop("train_log", None),
        val_log=kw.pop("val_log", None),
        template_warnings_=F.template_warnings_from_logs(kw.pop("log_dir", tmp_path / "no-logs")),
        endpoints=F.endpoint_counts(kw.pop("completions_dir", tmp_path / "no-completions")),
    )
    assert not kw, kw
    ev = tmp_path / "acceptance.json"
    ev.write_text(json.dumps(record))
    page = report_page.summary_page(
        tmp_path / "summary.html",
        run="r",
        facts={},
        eval_json=ev,
        tables=[(gen, "Generation per dataset", "generation"), (tok, "Token shards", "tokens")],
        findings=found,
    )
    return found, page


def _assert_named(found, page, kind, key, figure):
    assert [f.kind for f in found] == [kind], [f.message for f in found]
    assert f'data-kind="{kind}"' in page
    assert f"<code>{key}</code>" in page
    if figure:
        assert f'href="#{figure}"' in page
    # the findings come right after the header, before any table or plot
    assert page.index('id="findings"') < page.index('id="generation"')


def test_a_healthy_run_has_no_findings(tmp_path):
    found, page = _page(tmp_path)
    assert found == []
    assert "No findings" in page


def test_truncated_completions_of_the_default_demo(tmp_path):
    """The default demo's figures: 933 of 1,000 completions stop at max_tokens (96)."""
    found, page = _page(tmp_path, generation=_generation(tmp_path, conversations=1000, truncated=933))
    _assert_named(found, page, "truncated_completions", "generation.max_tokens", "generation")
    assert "933 of 1,000 completions (93 %)" in page


def test_thinking_mode_of_training_data_differs_from_the_eval(tmp_path):
    found, page = _page(tmp_path, generation=_generation(tmp_path, thinking="save"), record=_record(thinking="disable"))
    _assert_named(found, page, "thinking_mismatch", "generation.thinking", "generation")


def test_template_preflight_warning(tmp_path):
    logs = tmp_path / "logs" / "generate_completions" / "gsm8k"
    logs.mkdir(parents=True)
    warning = (
        "chat template of /m: a rendered assistant turn ends with 'x', not with a special token of this tokenizer, "
        "so no end-of-turn token is supervised (is `target.chat_template` meant for this tokenizer?)"
    )
    (logs / "00000.log").write_text(f"loading\n{warning}\n[gen] 10 conversations\n")
    (logs / "00001.log").write_text(f"{warning}\n")  # the same warning from every shard: named once
    found, page = _page(tmp_path, log_dir=tmp_path / "logs" / "generate_completions")
    _assert_named(found, page, "template_warning", "target.chat_template", None)
    assert "not with a special token" in page


def test_few_supervised_tokens_per_sequence(tmp_path):
    found, page = _page(tmp_path, tokens=_tokens(tmp_path, sequences=1000, supervised=12_000))  # 12 < 4 blocks of 8
    _assert_named(found, page, "few_supervised_tokens", "generation.max_tokens", "fig-data-lengths")


def test_engine_tau_well_below_the_loop(tmp_path):
    found, page = _page(tmp_path, record=_record(engine=1.9))
    _assert_named(found, page, "engine_below_loop", "eval.engine_args", "tau")
    assert "1.90" in page and "3.00" in page


def test_engine_tau_close_to_the_loop_is_no_finding(tmp_path):
    assert _page(tmp_path, record=_record(engine=2.9))[0] == []


def test_tau_collapsing_in_the_longest_context_bucket(tmp_path):
    pooled = {
        "<256": {"tau": 3.2, "num_steps": 100},
        "256–512": {"tau": 2.6, "num_steps": 60},
        "≥512": {"tau": 1.4, "num_steps": 30},
    }
    found, page = _page(tmp_path, record=_record(pooled=pooled))
    _assert_named(found, page, "long_context_collapse", "tokens.max_length", "tau-by-length")
    assert "≥512" in page


def test_a_long_bucket_with_few_steps_does_not_count(tmp_path):
    pooled = {"<256": {"tau": 3.2, "num_steps": 100}, "≥512": {"tau": 1.0, "num_steps": 3}}
    assert _page(tmp_path, record=_record(pooled=pooled))[0] == []


def test_heldout_tau_falling_while_the_loss_falls(tmp_path):
    val = _jsonl(tmp_path / "val_log.jsonl", [{"step": s, "tau": t} for s, t in ((100, 2.0), (200, 2.6), (300, 2.2))])
    train = _jsonl(tmp_path / "train_log.jsonl", [{"step": s, "loss": 5.0 - s / 100} for s in range(0, 301, 50)])
    found, page = _page(tmp_path, val_log=val, train_log=train)
    _assert_named(found, page, "heldout_tau_falling", "train.epochs", "fig-val-tau")
    assert "step 200" in page


def test_heldout_tau_falling_with_the_loss_rising_is_no_finding(tmp_path):
    val = _jsonl(tmp_path / "val_log.jsonl", [{"step": s, "tau": t} for s, t in ((100, 2.0), (200, 2.6), (300, 2.2))])
    train = _jsonl(tmp_path / "train_log.jsonl", [{"step": s, "loss": 2.0 + s / 100} for s in range(0, 301, 50)])
    assert _page(tmp_path, val_log=val, train_log=train)[0] == []


def test_a_server_that_failed_most_requests(tmp_path):
    comp = tmp_path / "completions" / "gsm8k"
    comp.mkdir(parents=True)
    for shard, (bad, good) in {"00000": (30, 0), "00001": (12, 1)}.items():
        stats = {
            "stats_version": 2,
            "run": {
                "endpoints": {
                    "http://a:1/v1": {"attempts": 50, "failures": 1, "taken_out": 0},
                    "http://b:2/v1": {"attempts": bad + good, "failures": bad, "taken_out": 2},
                }
            },
        }
        (comp / f"{shard}.stats.json").write_text(json.dumps(stats))
    found, page = _page(tmp_path, completions_dir=tmp_path / "completions")
    _assert_named(found, page, "failing_server", "generation.endpoints", "generation")
    assert "http://b:2/v1 failed 42 of 43 requests" in page


@pytest.mark.parametrize("value, fires", [(0.95, True), (0.99, False)])
def test_thresholds_come_from_the_config(tmp_path, value, fires):
    """report.findings.truncated_fraction moves the line (the schema's default is 0.5)."""
    gen = _generation(tmp_path, conversations=100, truncated=97)
    found, _ = _page(tmp_path, generation=gen, thresholds=F.thresholds({"truncated_fraction": value}))
    assert bool(found) is fires
    assert F.thresholds()["truncated_fraction"] == 0.5


def test_one_heldout_validation_is_a_header_line_not_a_plot(tmp_path):
    """A run that validated once (the demo: 204 steps, validation every 500) gets no one-point plot."""
    from types import SimpleNamespace

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    _jsonl(run / "val_log.jsonl", [{"step": 204, "tau": 2.31}])
    (tmp_path / "val_tau.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    inputs = SimpleNamespace(drafter=str(run / "final"), val_tau=str(tmp_path / "val_tau.png"))
    figs = report_page.run_figures(inputs, SimpleNamespace())
    assert "fig-val-tau" not in [f[0] for f in figs]
    facts = report_page.run_facts(checkpoint=run / "final")
    header = report_page.header_html("r", facts)
    assert "held-out τ</b> 2.31 at step 204" in header and "train.validation_every_steps" in header


def test_per_position_acceptance_is_one_wide_readable_panel(tmp_path):
    from types import SimpleNamespace

    rec = _record()
    figs = dict((f[0], f[1]) for f in report_page.run_figures(SimpleNamespace(), SimpleNamespace(), rec))
    png = figs["fig-acceptance"]
    assert isinstance(png, bytes) and png.startswith(b"\x89PNG")
    html = report_page.figures_html([("fig-acceptance", png, "per position")])
    assert 'class="dflash-wide"' in html
