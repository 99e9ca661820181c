"""Every bench/ script runs at its tiny size (``--smoke``) and prints its figures and its ratio, so none can rot
unseen: a bench that stops running (an import moved, a refused config, a dtype mismatch) fails here.

The figures are not judged (they depend on the machine and its load); each test checks that the script
exited cleanly and printed the lines its docstring promises, with numbers in them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def run_bench(name: str, *args: str, timeout: int = 900) -> str:
    """Output of ``python bench/<name>.py --smoke ARGS`` with this checkout's src first on PYTHONPATH;
    fails with its output tail when it exits non-zero."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / f"{name}.py"), "--smoke", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"bench/{name}.py --smoke exited {proc.returncode}:\n{out[-4000:]}"
    return proc.stdout


NUM = r"[\d,]+(?:\.\d+)?"


def assert_lines(out: str, *patterns: str) -> None:
    for pat in patterns:
        assert re.search(pat, out, re.M), f"no line matching {pat!r} in:\n{out[-3000:]}"


def test_bench_dag():
    out = run_bench("bench_dag")
    assert_lines(
        out,
        rf"^dry run over 20 shards .*: ours {NUM} s, trivial Snakefile {NUM} s, ratio {NUM}x$",
        rf"^same directives per job, nothing of ours: {NUM} s; ours / it {NUM}x .*, it / trivial {NUM}x ",
        rf"^CPU seconds \(user \+ system\): ours {NUM}, trivial {NUM}, same directives {NUM}; ratio {NUM}x",
    )


def test_bench_dag_directive_costs():
    """``--directives``: one line per variant, and each variant Snakefile differs from the same-directives one
    (a variant whose change no longer applies would time the same Snakefile twice)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import bench_dag
    finally:
        sys.path.remove(str(REPO / "bench"))
    for name, (_, text) in bench_dag.DIRECTIVE_VARIANTS.items():
        assert text != bench_dag.SAME_DIRECTIVES and len(text) < len(bench_dag.SAME_DIRECTIVES) + 100, name
    out = run_bench("bench_dag", "--directives")
    assert_lines(out, rf"^directive costs over 20 shards, CPU seconds \(same directives {NUM}, trivial {NUM}\):$")
    for name in bench_dag.DIRECTIVE_VARIANTS:
        assert_lines(out, rf"^  {re.escape(name)} +{NUM} +[+-]{NUM} vs same +{NUM}x trivial  \(")


def test_bench_completions():
    out = run_bench("bench_completions")
    assert_lines(
        out,
        rf"^  pipeline +{NUM} req/s, client CPU {NUM} s per 1k req",
        rf"^  naive +{NUM} req/s",
        rf"^  ratio pipeline/naive: {NUM}x requests/s$",
        rf"^ +1x4 .*\| +{NUM}x +{NUM}x \|",
    )  # the grid point, pipeline against naive


def test_bench_features():
    out = run_bench("bench_features")
    assert_lines(
        out,
        r"^peak RSS \(MiB\) +x1 / x10 +ratio x10/x1$",
        *(
            rf"^  {k} +{NUM} +{NUM} +{NUM}$"
            for k in ("train_shards_MiB", "scan_all_MiB", "baseline_load_token_shards_MiB")
        ),
        rf"^  hf +{NUM} tokens/s",
    )


def test_bench_prompts():
    out = run_bench("bench_prompts")
    assert_lines(
        out,
        rf"^ +streaming: {NUM} prompts/s \({NUM} s, {NUM} kept in {NUM} shards\), peak RSS {NUM} MiB$",
        rf"^ +naive: {NUM} prompts/s",
        rf"^ratio streaming/naive: speed x{NUM}, peak RSS x{NUM}$",
    )


def test_bench_tokens():
    out = run_bench("bench_tokens")
    assert len(re.findall(rf"^  speedup: {NUM}x tokens/s; {NUM}x conversations/s", out, re.M)) == 3, out[-3000:]
    assert_lines(out, rf"^  tokens.tokenize_records: {NUM} tokens .* = {NUM} tokens/s/core$")


def test_bench_train():
    out = run_bench("bench_train")
    assert_lines(
        out,
        rf"^train step: {NUM} ms  ->  {NUM} sequence tokens/s, {NUM} query slots/s",
        rf"^baseline \(target forward only\): {NUM} ms  ->  {NUM} tokens/s;  step/baseline = {NUM}x$",
    )


def test_gpu_check_runs_end_to_end_on_cpu(tmp_path, real_models_dir):
    """``bench/gpu_check.sh --device cpu``: the GPU check's parts at tiny sizes, one table with each part's time
    limit, and each part's log. The demo workflow part is skipped with its reason (a Snakemake run of its own;
    tests/e2e runs the workflow)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))}
    env["PYTHON"] = sys.executable
    table, logs = tmp_path / "gpu_check.json", tmp_path / "logs"
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh"), "--device", "cpu", "--skip", "workflow", "--json", str(table)]
        + ["--models", str(real_models_dir), "--logs", str(logs)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert_lines(
        out,
        r"^\[gpu-check\] cpu: limits steps \d+ s, zoo \d+ s, stream \d+ s, fsdp \d+ s; the whole check within \d+ s$",
        r"^\| check \| status \| s \| limit s \| figures \|$",
        r"^\| workflow \| skipped \| 0 \| - \| --skip workflow \(the suite",
        r"^\| stream \| ok \| \d+ \| \d+ \| \d+ steps in .* from an hf server \(CPU\)",
        rf"^\| fsdp \| ok \| \d+ \| \d+ \| 1 rank, fully_shard .* adamw loss {NUM} -> {NUM} .* muon loss {NUM} -> {NUM}",
        rf"^\| steps \| ok \| \d+ \| \d+ \| tiny \(Qwen3-8B shape\): {NUM} tok/s .* plan {NUM} GB; tiny \(Kimi shape\)",
        r"^\[gpu-check\] steps: tiny \(Qwen3-8B shape\): counting FLOPs$",  # progress, echoed as it comes
    )
    rows = json.loads(table.read_text())["rows"]
    assert list(rows) == ["steps", "workflow", "zoo", "stream", "fsdp"]  # the parts missing GPU figures first
    assert rows["zoo"]["status"] == "ok" and "1/1 families" in rows["zoo"]["figures"], rows["zoo"]
    assert all(r["limit_s"] >= r["seconds"] for r in rows.values() if r["status"] != "skipped")
    for r in rows["steps"]["rows"]:
        # the masked FLOP count takes off the attention the training mask forbids, never more than all of it
        assert r["plan_gb"] > 0 and 0 < r["tflop_per_step"] < r["tflop_per_step_dense"], r
    assert sorted(p.name for p in logs.iterdir()) == ["fsdp.log", "steps.log", "stream.log", "zoo.log"]


def test_every_bench_has_a_smoke_test():
    """A new bench/bench_*.py gets a ``--smoke`` mode and a ``test_<its name>`` here or in its own
    tests/bench/test_<its name>.py. (bench/*_check.py, gpu_check_engines.sh and gpu_family_kernels.py need CUDA
    and SGLang/vLLM on a GPU box: they cannot run in this suite; gpu_check.sh runs here with --device cpu.)"""
    benches = {p.stem for p in (REPO / "bench").glob("bench_*.py")}
    tested = {name.removeprefix("test_") for name in globals() if name.startswith("test_bench_")}
    tested |= {p.stem.removeprefix("test_") for p in Path(__file__).parent.glob("test_bench_*.py")}  # own files
    gone = {t for t in tested - benches if not any(t.startswith(f"{b}_") for b in benches)}  # a bench's extra tests
    assert benches <= tested and not gone, f"untested: {sorted(benches - tested)}; gone: {sorted(gone)}"


def test_bench_repro(tmp_path):
    """Two clones of HEAD, native and AVX2 kernels, on a tiny config: the τ table, the largest difference and
    where each stage stands (the shipped target's digest is the same in both)."""
    out = run_bench("bench_repro", "--work", str(tmp_path))
    assert_lines(
        out,
        r"^kernels: native \w+, avx2 run AVX2$",
        r"^\| eval set \| τ native \| τ AVX2 \| difference \|$",
        rf"^\| gsm8k \| {NUM} \| {NUM} \| [+-]{NUM} % \|$",
        rf"^largest τ difference: {NUM} % \(limit 5 %\): (within|OVER)$",
        r"^stages: target digest equal; completions \d+/\d+ equal; token records \d+/\d+ equal; final train loss ",
    )
    rec = json.loads((tmp_path / "repro.json").read_text())
    assert rec["drift"]["target_digest_equal"] and rec["drift"]["completions"]["records"] == 8
