"""Report tables (report.py): the run summary's HTML tables and the end-of-run console summary (issue #18).
The rendered report itself is checked with headless Chromium in tests/test_e2e.py."""

from __future__ import annotations

import json
import re

from dflash_pipeline import report
from dflash_pipeline.shards import write_tsv


def _inputs(tmp_path):
    tau = tmp_path / "acceptance.tsv"
    write_tsv(tau, ("drafter", "set", "tau", "num_responses"), [
        {"drafter": "trained", "set": "gsm8k", "tau": 2.5, "num_responses": 2},
        {"drafter": "trained", "set": "mt_bench", "tau": 1.75, "num_responses": 2},
        {"drafter": "untrained", "set": "gsm8k", "tau": 1.0, "num_responses": 2},
        {"drafter": "untrained", "set": "mt_bench", "tau": 1.01, "num_responses": 2},
    ])
    ev = tmp_path / "acceptance.json"
    ev.write_text(json.dumps({"settings": {"block_size": 4}, "sets": {"gsm8k": {"num_prompts": 2}},
                              "drafters": {"trained": {"checkpoint": "ckpt/final", "train_steps": 3}}}))
    prompts = tmp_path / "prompts.tsv"
    write_tsv(prompts, ("dataset", "read", "kept", "dropped_special_token_text"),
              [{"dataset": "gsm8k", "read": 13, "kept": 12, "dropped_special_token_text": 1}])
    return tau, ev, prompts


def test_summary_html_tables_with_readable_labels(tmp_path):
    tau, ev, prompts = _inputs(tmp_path)
    out = tmp_path / "summary.html"
    text = report.summary_html(out, run="r1", tau_tsv=tau, eval_json=ev, prompts_tsv=prompts,
                               tokens_tsv=tmp_path / "missing.tsv", outputs=[("τ table", str(tau))])
    assert out.read_text(encoding="utf-8") == text

    def rows(table_id):
        body = re.search(rf'<table id="{table_id}"[^>]*>(.*?)</table>', text, re.S).group(1)
        return [re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", r) for r in re.findall(r"<tr>(.*?)</tr>", body)]

    assert rows("tau") == [["drafter", "gsm8k", "mt_bench"], ["trained", "2.5", "1.75"], ["untrained", "1.0", "1.01"]]
    assert rows("eval-table")[0] == ["drafter", "set", "τ", "responses"]
    assert ["settings.block_size", "4"] in rows("eval-record")
    assert ["drafter trained: checkpoint", "ckpt/final"] in rows("eval-record")
    assert rows("prompts") == [["dataset", "records read", "prompts kept", "dropped: special token text"],
                               ["gsm8k", "13", "12", "1"]]
    assert 'id="tokens"' not in text  # a missing input is left out
    assert rows("outputs")[1] == ["τ table", str(tau)]
    # values are escaped (a dataset name or path never becomes markup)
    write_tsv(prompts, ("dataset", "read"), [{"dataset": "<b>x</b>", "read": 1}])
    assert "&lt;b&gt;x&lt;/b&gt;" in report.summary_html(out, run="r1", prompts_tsv=prompts)


def test_console_summary_prints_the_tau_table_and_outputs(tmp_path):
    tau, _, _ = _inputs(tmp_path)
    text = report.console_summary(tau, [("drafter checkpoint", "results/checkpoints/r1/final")])
    lines = text.splitlines()
    assert lines[0].startswith("τ per drafter and eval set")
    assert lines[1].split() == ["drafter", "gsm8k", "mt_bench"] and lines[2].split() == ["trained", "2.5", "1.75"]
    assert lines[-1].split() == ["drafter", "checkpoint", "results/checkpoints/r1/final"]
    assert report.console_summary(tmp_path / "none.tsv") == ""
