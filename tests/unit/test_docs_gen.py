"""Docs that cannot drift: the generated reference pages and the README's generated tables equal what
`python -m dflash_pipeline.docs_gen` writes now; the configuration page lists exactly the schema's keys; every
page is in the site's navigation; the README stays one page; no page cites the work's history."""

from __future__ import annotations

import json
import re

import yaml
from test_docs import REPO

from dflash_pipeline import docs_gen


def test_generated_pages_and_readme_tables_are_up_to_date():
    stale = docs_gen.stale_files(REPO)
    assert not stale, f"run `python -m dflash_pipeline.docs_gen` and commit: {[str(p) for p in stale]}"


def _schema_key_set(node: dict, prefix: str = "") -> set[str]:
    """Every key path of a JSON Schema object, walked here independently of the generator."""
    keys = set()
    for name, sub in (node.get("properties") or {}).items():
        path = f"{prefix}{name}"
        keys.add(path)
        keys |= _schema_key_set(sub, f"{path}.")
        extra = sub.get("additionalProperties")
        if isinstance(extra, dict) and extra.get("properties"):
            keys.add(f"{path}.<name>")
            keys |= _schema_key_set(extra, f"{path}.<name>.")
        elif isinstance(extra, dict) and extra.get("additionalProperties"):
            keys.add(f"{path}.<name>")
        items = sub.get("items")
        if isinstance(items, dict) and items.get("properties"):
            keys |= _schema_key_set(items, f"{path}[].")
    return keys


def test_config_reference_lists_every_schema_key():
    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text(encoding="utf-8"))
    page = (REPO / "docs" / "reference" / "config.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([^`]+)` \|", page, re.M)) | set(re.findall(r"^## `([^`]+)`$", page, re.M))
    expected = _schema_key_set(schema)
    assert listed == expected, {"missing": sorted(expected - listed), "not in schema": sorted(listed - expected)}
    assert "`report.findings.truncated_fraction` | number (≥ 0, ≤ 1) | `0.5` |" in page


def test_a_changed_block_is_detected_and_rewritten(tmp_path):
    text = "intro\n<!-- BEGIN GENERATED demo-tau (x) -->\nold table\n<!-- END GENERATED demo-tau -->\nend\n"
    out = docs_gen.fill_blocks(text, {"demo-tau": "| new |"})
    assert out == "intro\n<!-- BEGIN GENERATED demo-tau (x) -->\n| new |\n<!-- END GENERATED demo-tau -->\nend\n"
    assert docs_gen.fill_blocks(out, {"demo-tau": "| new |"}) == out


def test_demo_tau_table_from_an_eval_record():
    record = {
        "settings": {"block_size": 8, "temperature": 0.0, "thinking": "disable", "max_new_tokens": 96},
        "sets": {"gsm8k": {"num_prompts": 24}, "humaneval": {"num_prompts": 12}},
        "drafters": {
            "trained": {"train_steps": 204, "sets": {"gsm8k": {"tau": 2.0249}, "humaneval": {"tau": 1.666}}},
            "untrained": {"train_steps": 0, "sets": {"gsm8k": {"tau": 1.0}, "humaneval": {"tau": 1.0}}},
        },
    }
    table = docs_gen.demo_tau_table(record)
    assert "| drafter | gsm8k (24) | humaneval (12) |" in table
    assert "| trained (204 steps) | 2.02 | 1.67 |" in table
    assert "| untrained | 1.00 | 1.00 |" in table
    assert "block size 8" in table and "thinking `disable`" in table
    assert "No demo result" in docs_gen.demo_tau_table(None)


def test_families_pages_come_from_the_zoo_json(tmp_path):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    zoo = {
        "source": {
            "command": "python -m dflash_pipeline.testing.zoo --table --json z.json",
            "date": "2030-01-02",
            "device": "cpu",
        },
        "stages": ["build", "probe", "completions"],
        "families": [
            {"family": "Good-1B", "kind": "corpus", "cells": {"build": "ok", "probe": "ok", "completions": "ok"}},
            {
                "family": "Bad-2B",
                "kind": "corpus",
                "cells": {"build": "ok", "probe": "refused: odd | rope", "completions": "skipped"},
            },
        ],
    }
    (tmp_path / "docs" / "results" / "zoo.json").write_text(json.dumps(zoo))
    page = docs_gen.families_reference(tmp_path)
    assert "| Good-1B | ok | ok | ok |" in page
    assert "| Bad-2B | ok | refused: odd \\| rope | skipped |" in page  # a pipe in a cell is escaped
    assert "2030-01-02" in page
    summary = docs_gen.families_summary(tmp_path)
    assert "Good-1B" in summary and "Bad-2B (probe: refused)" in summary


def test_check_mode_fails_on_a_stale_page(tmp_path, capsys):
    """`--check` exits 1 and names the file when a committed page differs (here: a copy of the repo's docs
    with a hand edit in the families page)."""
    for rel in (
        "README.md",
        *docs_gen.BLOCK_FILES,
        "docs/results/zoo.json",
        *(f"rules/{p.name}" for p in (REPO / "rules").glob("*.smk")),
        "Snakefile",
    ):
        dst = tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text((REPO / rel).read_text(encoding="utf-8"), encoding="utf-8")
    for page, text in docs_gen.generated_files(tmp_path).items():
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text(text, encoding="utf-8")
    assert docs_gen.stale_files(tmp_path) == []
    fam = tmp_path / "docs" / "reference" / "families.md"
    fam.write_text(fam.read_text(encoding="utf-8") + "hand edit\n", encoding="utf-8")
    assert docs_gen.main(["--check", "--repo", str(tmp_path)]) == 1
    assert "docs/reference/families.md" in capsys.readouterr().err


def _nav_pages(nav) -> set[str]:
    pages = set()
    for item in nav:
        for value in item.values() if isinstance(item, dict) else [item]:
            pages |= _nav_pages(value) if isinstance(value, list) else {value}
    return pages


def test_every_page_is_in_the_navigation():
    cfg = yaml.load((REPO / "mkdocs.yml").read_text(encoding="utf-8"), Loader=yaml.BaseLoader)
    nav = _nav_pages(cfg["nav"])
    pages = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    assert pages == nav, {"not in nav": sorted(pages - nav), "nav without page": sorted(nav - pages)}


def test_readme_is_one_page():
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


def test_no_page_cites_the_work_history():
    """Docs say what is, not how the work went: no issue numbers, no session stops."""
    pattern = re.compile(r"issue #[0-9]|stop [0-9]+|turn [0-9]")
    files = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md"))]
    hits = [
        f"{p.relative_to(REPO)}:{n}"
        for p in files
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, hits


def test_rules_inside_an_if_block_are_listed():
    text = (
        "if not SHIPPED:\n\n"
        "    rule build_it:\n"
        '        """Builds it."""\n'
        "        output:\n"
        "            directory(OUT),\n"
        "        script:\n"
        '            "x.py"\n\n\n'
        "rule top:\n"
        "    output:\n"
        '        "a.txt",\n'
    )
    rules = docs_gen.rules_of(text)
    assert [(k, n) for k, n, _ in rules] == [("rule", "build_it"), ("rule", "top")]
    assert docs_gen._rule_section(rules[0][2], "output") == "directory(OUT),"
    assert docs_gen._docstring(rules[0][2]) == "Builds it."


def test_coverage_line_from_a_coverage_report():
    """The README's coverage line comes from coverage.py's JSON report; without one it says how to make it."""
    record = {
        "meta": {"version": "7.18.0", "timestamp": "2026-12-04T17:23:29"},
        "totals": {"percent_covered": 88.514, "covered_lines": 12084, "num_statements": 13652},
    }
    line = docs_gen.coverage_line(record)
    assert "88.5 %" in line and "12,084 of 13,652 statements" in line and "2026-12-04" in line
    assert docs_gen.COVERAGE_COMMAND in line and docs_gen.COVERAGE_COMMAND in docs_gen.coverage_line(None)
    assert "No coverage result" in docs_gen.coverage_line(None)


def test_gpu_check_table_from_a_run():
    """The GPU check's docs table is the committed `bench/gpu_check.sh --json` record, one row per part."""
    record = {
        "device": "NVIDIA H200",
        "torch": "2.11.0",
        "rows": {"fsdp": {"status": "ok", "seconds": 15.2, "figures": "a | b"}},
    }
    table = docs_gen.gpu_check_table(record)
    assert "| fsdp | ok | 15 | a / b |" in table and "NVIDIA H200, torch 2.11.0" in table
    assert "No GPU run" in docs_gen.gpu_check_table(None)
    record["rows"]["steps"] = {"status": "FAIL", "seconds": 140.2, "limit_s": 140, "figures": "over its 140 s limit"}
    table = docs_gen.gpu_check_table(record)  # the limits the check ran under, where it recorded them
    assert "| check | status | s | limit s | figures |" in table
    assert "| fsdp | ok | 15 | - | a / b |" in table and "| steps | FAIL | 140 | 140 | over its 140 s limit |" in table
