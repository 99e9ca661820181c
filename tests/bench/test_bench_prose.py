"""bench/bench_prose.py (``--smoke`` is the same measurement, about a second): it prints the per-package table,
the total, the worst modules and the transformers qwen3 anchor with their ratios. The figures are not judged."""

from __future__ import annotations

import re

from test_benches import NUM, assert_lines, run_bench


def test_bench_prose():
    out = run_bench("bench_prose", timeout=60)
    assert_lines(
        out,
        r"^  package +files +prose chars +code chars +prose/code$",
        rf"^  core +\d+ +{NUM} +{NUM} +{NUM}$",
        rf"^  total +\d+ +{NUM} +{NUM} +{NUM}$",
        r"^10 modules with the most prose per code character:$",
        rf"^anchor transformers models/qwen3/modeling_qwen3.py: prose {NUM}, code {NUM}, prose/code {NUM}$",
        rf"^ratio src / anchor: {NUM}x$",
    )
    worst = out.split("per code character:\n")[1].split("\n\n")[0].splitlines()
    assert len(worst) == 10 and all(re.search(rf"\.py +{NUM} +{NUM} +{NUM}$", w) for w in worst), worst
