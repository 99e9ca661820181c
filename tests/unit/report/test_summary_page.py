"""The report's landing page (dflash_pipeline.report.page) in headless Chromium: the header, every
image loading (natural width > 0), the τ table equal to acceptance.json, the long record folded; the
screenshot is kept as a test artefact ($DFLASH_TEST_ARTEFACTS, default tests/artefacts/)."""

from __future__ import annotations

import html as html_lib
import json
import re

from conftest import PROBE_SCRIPT, artefact_dir

from dflash_pipeline.core.shards import write_tsv
from dflash_pipeline.evaluate.outputs import plot_acceptance, write_eval_table
from dflash_pipeline.report import page as report_page


def _record() -> dict:
    def stats(tau, buckets):
        return {
            "tau": tau,
            "per_position_acceptance": [0.8, 0.6, 0.4],
            "histogram": {"1": 1, "2": 1, "3": 1, "4": 1},
            "num_responses": 4,
            "num_steps": 9,
            "tokens_per_step": tau,
            "tokens_per_target_forward": tau,
            "by_context_length": buckets,
        }

    long = {
        "<256": {"tau": 3.1, "num_responses": 4, "num_steps": 7, "tokens_per_step": 3.0, "range": [0, 256]},
        "256–1K": {"tau": 1.9, "num_responses": 2, "num_steps": 2, "tokens_per_step": 1.9, "range": [256, 1024]},
    }
    short = {"<256": {"tau": 2.87654, "num_responses": 4, "num_steps": 9, "tokens_per_step": 2.8, "range": [0, 256]}}
    return {
        "schema_version": 1,
        "target": {"path": "resources/demo-target", "model_type": "qwen3"},
        "settings": {
            "block_size": 4,
            "temperature": 0.0,
            "thinking": "disable",
            "max_new_tokens": 8,
            "context_length_buckets": [256, 1024],
            "context_length_buckets_labels": ["<256", "256–1K", "≥1K"],
        },
        "sets": {"gsm8k": {"num_prompts": 4}, "long": {"num_prompts": 4}},
        "drafters": {
            "trained": {
                "checkpoint": "ckpt/final",
                "train_steps": 3,
                "zero_target_features": False,
                "sets": {"gsm8k": stats(2.87654, short), "long": stats(2.5, long)},
            },
            "untrained": {
                "checkpoint": None,
                "train_steps": 0,
                "zero_target_features": False,
                "sets": {"gsm8k": stats(1.0, {"<256": {**short["<256"], "tau": 1.0}}), "long": stats(1.0125, long)},
            },
        },
        "by_context_length": {"trained": long, "untrained": long},
    }


def test_landing_page_in_chromium(tmp_path, chromium):
    rec = _record()
    ev = tmp_path / "acceptance.json"
    ev.write_text(json.dumps(rec))
    tau = tmp_path / "acceptance.tsv"
    write_eval_table(rec, tau)
    plot_acceptance(rec, tmp_path / "acceptance.png")
    report_page.plot_tau_per_set(rec, tmp_path / "tau_per_set.png")
    report_page.plot_tau_by_length(rec, tmp_path / "tau_by_length.png")
    tokens = tmp_path / "tokens.tsv"
    write_tsv(
        tokens,
        ("dataset", "records_out", "num_tokens", "num_loss_tokens"),
        [{"dataset": "all", "records_out": 16, "num_tokens": 2000, "num_loss_tokens": 700}],
    )
    facts = report_page.run_facts(
        eval_json=ev,
        tokens_rows=[{"dataset": "all", "records_out": "16", "num_tokens": "2000", "num_loss_tokens": "700"}],
    )
    figures = [
        ("fig-tau-per-set", tmp_path / "tau_per_set.png", "τ per eval set"),
        ("fig-acceptance", tmp_path / "acceptance.png", "per-position acceptance"),
        ("fig-tau-by-length", tmp_path / "tau_by_length.png", "τ by context length"),
        ("fig-missing", tmp_path / "absent.png", "left out"),
    ]
    page = tmp_path / "summary.html"
    report_page.summary_page(
        page,
        run="r1",
        facts=facts,
        tau_tsv=tau,
        eval_json=ev,
        tables=[(tokens, "Token shards per dataset", "tokens")],
        figures=[(i, str(p), c) for i, p, c in figures],
    )
    probe = tmp_path / "probed.html"
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE_SCRIPT + "</body>"), encoding="utf-8")
    proc = chromium(probe.as_uri(), "--virtual-time-budget=10000", "--dump-dom")
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout

    images = json.loads(html_lib.unescape(re.search(r'<pre id="image-check">(.*?)</pre>', dom, re.S).group(1)))
    assert [i[0] for i in images] == [
        "fig-tau-per-set",
        "fig-acceptance",
        "fig-tau-by-length",
    ]  # the missing one left out
    assert all(w > 0 and done for _, w, done in images), images

    def table(table_id):
        m = re.search(rf'<table id="{table_id}"[^>]*>(.*?)</table>', dom, re.S)
        assert m, table_id
        return [
            [
                html_lib.unescape(re.sub(r"<[^>]+>", "", c)).strip()
                for c in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row, re.S)
            ]
            for row in re.findall(r"<tr>(.*?)</tr>", m.group(1), re.S)
        ]

    t = table("tau")
    assert t[0] == ["drafter", "gsm8k", "long"]
    assert {r[0]: r[1:] for r in t[1:]} == {
        lbl: [str(round(s["tau"], 3)) for s in e["sets"].values()] for lbl, e in rec["drafters"].items()
    }
    by_len = table("tau-by-length")
    assert by_len[0] == ["drafter", "set", "<256", "256–1K", "≥1K"]
    assert ["trained", "long", "3.100 (7)", "1.900 (2)", ""] in by_len
    header = re.search(r'<header id="run-header".*?</header>', dom, re.S).group(0)
    assert "resources/demo-target" in header and "16 sequences" in header and "700 supervised" in header
    folded = re.search(r'<details id="eval-details"[^>]*>(.*?)</details>', dom, re.S)
    assert folded and 'id="eval-record"' in folded.group(1) and "open" not in folded.group(0)[:40]  # folded away

    shot = artefact_dir() / "report-summary.png"
    proc = chromium(page.as_uri(), "--virtual-time-budget=10000", "--window-size=1300,1800", f"--screenshot={shot}")
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    from PIL import Image

    img = Image.open(shot).convert("L")
    lo, hi = img.getextrema()
    assert hi - lo > 100 and len(img.getcolors(1 << 16) or ()) > 8, "blank screenshot"


def test_header_facts_come_from_the_run_records(tmp_path):
    from types import SimpleNamespace

    ckpt = tmp_path / "checkpoints" / "r1" / "final"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(
        json.dumps({"architectures": ["DFlashDraftModel"], "num_hidden_layers": 2, "block_size": 8})
    )
    from dflash_pipeline.core.provenance import provenance

    prov = provenance(target_dir=tmp_path, device="cpu", dtype="float32")
    (ckpt.parent / "train_summary.json").write_text(
        json.dumps({"steps": 204, "trainable_params": 1_234_567, "loss": "ce_decay", "provenance": prov})
    )
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 8}))
    bench = tmp_path / "benchmarks"
    for rule, secs in (("train_drafter", 171.0), ("evaluate_acceptance", 90.5), ("generate_completions", 70.0)):
        write_tsv(bench / rule / "r1.tsv", ("s", "h:m:s"), [{"s": secs, "h:m:s": "0:00:00"}])
    demo = tmp_path / "build_demo_target.tsv"
    write_tsv(demo, ("s",), [{"s": 116.0}])
    ev = tmp_path / "acceptance.json"
    ev.write_text(json.dumps(_record()))
    facts = report_page.run_facts(
        eval_json=ev,
        probe_json=probe,
        checkpoint=ckpt,
        benchmark_dir=bench,
        extra_benchmarks=[demo],
        prompts_rows=[{"dataset": "gsm8k", "kept": "900"}, {"dataset": "mt_bench", "kept": "40"}],
        generation_rows=[{"dataset": "all", "conversations": "940", "ok": "938"}],
    )
    assert facts["drafter"] == {
        "family": "DFlashDraftModel",
        "num_draft_layers": 2,
        "block_size": 8,
        "trainable_params": 1_234_567,
        "loss": "ce_decay",
    }
    assert facts["train_steps"] == 3  # the eval record's trained drafter says how many steps it had
    assert facts["wall_s"] == 171.0 + 90.5 + 70.0 + 116.0 and facts["train_s"] == 171.0 and facts["eval_s"] == 90.5
    assert facts["data"]["prompts_kept"] == 940 and facts["data"]["eval_prompts"] == {"gsm8k": 4, "long": 4}
    text = report_page.header_html("r1", facts)
    assert "1.23 M trainable parameters" in text and "7 min 28 s" in text and "940 conversations (938 ok)" in text
    # the software, kernels, device and dtype that made the drafter (the eval record here has none)
    made = re.search(r"<b>training made with</b> ([^<]*)", text).group(1)
    assert f"transformers {prov['packages']['transformers']}" in made and "float32" in made
    assert "eval made with" not in text
    assert facts["stream"] is None and "features streamed" not in text  # not a streamed run
    stream = {
        "servers": 2,
        "server_tokens_per_s": 5120.4,
        "trainer_tokens_per_s": 3000.0,
        "trainer_demand_tokens_per_s": 4000.0,
        "wait_fraction": 0.25,
        "suggested_servers_per_rank": 2,
        "peak_scratch_bytes": 65536,
    }
    (ckpt.parent / "train_summary.json").write_text(json.dumps({"steps": 204, "stream": stream}))
    facts = report_page.run_facts(checkpoint=ckpt)
    assert facts["stream"] == stream
    text = report_page.header_html("r1", facts)
    assert (
        "<b>features streamed</b> 2 servers at 5,120 tokens/s; trainer 3,000 tokens/s (demand 4,000), waiting "
        "25.0 % of the time; suggested servers per trainer rank: 2; peak scratch 65,536 B"
    ) in text
    one = report_page.header_html("r1", {**facts, "stream": {**stream, "servers": 1}})
    assert "<b>features streamed</b> 1 server at 5,120 tokens/s" in one
    # the job's named inputs and outputs give the figure files, in the page's order
    figs = report_page.run_figures(
        SimpleNamespace(
            acceptance_plot="a.png", tau_vs_step="s.png", train_curves="c.png", val_tau="v.png", data_lengths="d.png"
        ),
        SimpleNamespace(tau_per_set="t.png", tau_by_length="l.png"),
    )
    assert [f[1] for f in figs] == ["t.png", "a.png", "l.png", "s.png", "c.png", "v.png", "d.png"]
