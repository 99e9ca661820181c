"""What a run shows on the console: job summaries and [train]/[eval] progress lines reach the
job's stderr besides its log file (workflow.log_to, `workflow tee`)."""

from __future__ import annotations

import io
import logging
import subprocess
import sys

from dflash_pipeline.workflow import policy as workflow


def test_log_to_echoes_console_lines_and_progress_prefixes(tmp_path, monkeypatch):
    term = io.StringIO()
    monkeypatch.setattr(sys, "stderr", term)
    log = tmp_path / "logs" / "tokenize_completions" / "gsm8k" / "00000.log"
    with workflow.log_to(log):
        workflow.console("%d records -> %d sequences", 5, 4)
        logging.getLogger("dflash_pipeline.tokens.shard").info("detail for the log only")
        print("[eval]        trained      gsm8k: tau=2.500")
        print("a line for the log only")
        sys.stderr.write("bar 10%\rbar 100%\n")  # tqdm-style redraws never reach the console
    shown = term.getvalue().splitlines()
    assert shown == [
        "[tokenize_completions gsm8k/00000] 5 records -> 4 sequences",
        "[tokenize_completions gsm8k/00000] [eval]        trained      gsm8k: tau=2.500",
    ]
    text = log.read_text()
    assert (
        "5 records -> 4 sequences" in text and "detail for the log only" in text and "a line for the log only" in text
    )
    workflow.console("outside log_to: no console handler")  # nothing raised, nothing echoed
    assert len(term.getvalue().splitlines()) == 2


def test_tee_copies_a_shell_rules_output_and_echoes_train_lines(tmp_path):
    log = tmp_path / "logs" / "train_drafter" / "demo.log"
    cmd = (
        f"printf 'loading\\n[train] step 1/3 loss 5.0\\nwarn\\n[train] step 3/3 loss 4.0\\n' | "
        f"{sys.executable} -m dflash_pipeline.workflow tee {log}"
    )
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        "[train_drafter demo] [train] step 1/3 loss 5.0",
        "[train_drafter demo] [train] step 3/3 loss 4.0",
    ]
    assert log.read_text() == "loading\n[train] step 1/3 loss 5.0\nwarn\n[train] step 3/3 loss 4.0\n"
    failing = f"set -o pipefail; (echo '[train] x'; exit 3) | {sys.executable} -m dflash_pipeline.workflow tee {log}"
    assert subprocess.run(["bash", "-c", failing], capture_output=True, timeout=60).returncode == 3
