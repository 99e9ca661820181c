"""End to end: real Snakemake on the reduced config (tests/e2e/e2e_config.yaml) in a temp working directory.

One full build, then the rebuild semantics users rely on (DESIGN.md §3), each asserted on the job
counts of `snakemake -n`.
"""

from __future__ import annotations

import json
import os
import re

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import REPO, planned_jobs, snakemake  # noqa: F401  (shared helpers)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The reduced workflow, built once for this module."""
    work = tmp_path_factory.mktemp("e2e")
    cfg = yaml.safe_load((REPO / "tests" / "e2e" / "e2e_config.yaml").read_text())
    # τ by context length on a set of long conversations; not in e2e_config.yaml, which
    # test_upgrade also gives to earlier mains that do not know these keys
    cfg["eval"]["context_length_buckets"] = [128]
    cfg["eval"]["sets"]["long"] = {
        "path": "data/sharegpt/sharegpt.json",
        "format": "sharegpt",
        "build_to_tokens": 200,
        "num_samples": 1,
    }
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    proc = snakemake(work)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    (work / "snakemake-console.txt").write_text(proc.stdout + proc.stderr)  # what the user saw
    return work, cfg


def test_full_build_outputs(built):
    work, cfg = built
    probe = json.loads((work / "results/probe/e2e.json").read_text())
    assert probe["drafter"]["block_size"] == 4 and len(probe["drafter"]["target_layer_ids"]) == 2
    manifest = json.loads((work / "results/prompts/manifest.json").read_text())
    assert manifest["datasets"]["gsm8k"]["kept"] == 12 and manifest["datasets"]["mt_bench"]["kept"] == 4
    final = work / "results/checkpoints/e2e/final"
    ckpt = json.loads((final / "config.json").read_text())
    assert ckpt["architectures"] == ["DFlashDraftModel"] and ckpt["block_size"] == 4
    assert ckpt["dflash_config"]["mask_token_id"] == probe["drafter"]["mask_token_id"]
    assert (final / "model.safetensors").stat().st_size > 0
    console = (work / "snakemake-console.txt").read_text()  # the end-of-run summary names the page to read first
    assert "τ per drafter and eval set" in console
    assert re.search(r"^  run summary \(read first\)\s+results/report/summary\.html$", console, re.MULTILINE), console[
        -2000:
    ]
    ev = json.loads((work / "results/eval/e2e/acceptance.json").read_text())
    assert set(ev["drafters"]) == {"trained", "zero_features", "untrained"}
    # every result names what made it, the shipped demo target's digest included
    from dflash_pipeline.core.provenance import target_digest

    shipped = target_digest(REPO / "data" / "demo-target")["sha256"]
    summary = json.loads((work / "results/checkpoints/e2e/train_summary.json").read_text())
    for prov in (ev["provenance"], summary["provenance"]):
        assert prov["target"]["digest"]["sha256"] == shipped and prov["packages"]["transformers"]
        assert prov["device"] == "cpu" and prov["dtype"] and prov["torch_threads"] >= 1
    for label in ev["drafters"]:
        sets = ev["drafters"][label]["sets"]
        assert set(sets) == {"gsm8k", "humaneval", "mt_bench", "long"}
        assert all(1.0 <= s["tau"] <= 4.0 for s in sets.values())
        assert set(sets["long"]["by_context_length"]) == {"≥128"}  # answered after a ≥200-token history
        assert set(sets["gsm8k"]["by_context_length"]) <= {"<128", "≥128"}
        assert "≥128" in ev["by_context_length"][label]  # over all sets
        assert sets["gsm8k"]["num_responses"] == 2 and sets["humaneval"]["num_responses"] == 1
        assert sets["mt_bench"]["num_responses"] == 2 and sets["mt_bench"]["num_conversations"] == 1  # 2 turns
    assert ev["drafters"]["zero_features"]["zero_target_features"] is True
    assert ev["drafters"]["zero_features"]["checkpoint"].endswith("checkpoints/e2e.zero_features/final")
    assert ev["sets"]["mt_bench"]["excluded_training_prompts"] == 4  # the 4 MT-Bench prompts trained on
    assert ev["settings"]["thinking"] == "disable" and ev["settings"]["block_size"] == 4
    assert ev["sets"]["long"]["context_tokens"] >= 200 and ev["sets"]["long"]["excluded_training_prompts"] == 0
    for name in ("acceptance.png", "tau_vs_step.png", "train_curves.png", "val_tau.png"):
        assert (work / "results/eval/e2e" / name).stat().st_size > 1000, name
    series = json.loads((work / "results/eval/e2e/tau_vs_step.json").read_text())
    steps = json.loads((work / "results/checkpoints/e2e/train_summary.json").read_text())["steps"]
    assert steps > 2 and [p["step"] for p in series["points"]] == [2, steps]  # step_000002/ export + final
    assert (work / "results/checkpoints/e2e/step_000002/model.safetensors").is_file()
    assert (work / "results/checkpoints/e2e/state/step.json").is_file()  # resumable state kept
    gen = (work / "results/report/generation.tsv").read_text().splitlines()
    assert gen[0].startswith("dataset\tshards\tconversations\tok\ttruncated\terror") and gen[-1].startswith(
        "all\t3\t16\t"
    )
    assert "gsm8k\t12\t12\t" in (work / "results/report/prompts.tsv").read_text()
    header, *rows = (work / "results/report/tokens.tsv").read_text().splitlines()
    tok_all = dict(zip(header.split("\t"), rows[-1].split("\t")))
    token_shards = sorted((work / "results/tokens").glob("*/*.parquet"))
    assert tok_all["dataset"] == "all" and tok_all["shards"] == "3" and tok_all["records_in"] == "16"
    assert int(tok_all["num_loss_tokens"]) == sum(
        sum(sum(m) for m in pq.read_table(f, columns=["loss_mask"]).column("loss_mask").to_pylist())
        for f in token_shards
    )


def test_rerun_does_nothing(built):
    work, _ = built
    assert planned_jobs(snakemake(work, "-n")) == {}


def plan_with(work, name: str, cfg: dict) -> dict[str, int]:
    """The dry-run plan of ``work`` under ``cfg`` (written to ``work/<name>.yaml``): job counts per rule."""
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return planned_jobs(snakemake(work, "-n", configfile=path))


def test_tokenization_change_never_regenerates_completions(built):
    work, cfg = built
    jobs = plan_with(work, "tokens_changed", dict(cfg, tokens={**cfg["tokens"], "max_length": 150}))
    assert jobs.get("tokenize_completions") == 3  # gsm8k 12 prompts -> 2 shards of 8, mt_bench 4 -> 1
    assert "generate_completions" not in jobs and "shard_prompts" not in jobs
    assert jobs.get("train_drafter") == 2 and jobs.get("evaluate_acceptance") == 1  # drafter + zero_features baseline


def test_generation_change_regenerates_all_completions(built):
    work, cfg = built
    jobs = plan_with(work, "gen_changed", dict(cfg, generation={**cfg["generation"], "max_tokens": 13}))
    assert jobs.get("generate_completions") == 3 and jobs.get("tokenize_completions") == 3


def test_operational_generation_change_regenerates_nothing(built):
    """Adding a server, raising timeouts, retries or the batch size changes how shards are generated, not
    what: finished completions stay (params trigger on the output-affecting keys only)."""
    work, cfg = built
    changed = dict(
        cfg,
        generation={
            **cfg["generation"],
            "request_timeout_s": 1234,
            "max_retries": 2,
            "batch_size": 3,
            "endpoints": [{"base_url": "http://127.0.0.1:9/v1", "max_concurrency": 8}],
        },
    )
    assert plan_with(work, "gen_operational", changed) == {}


def test_newer_scripts_rerun_nothing(built):
    """A `git pull` that touches the rule scripts (newer mtime, as checkout gives) reruns nothing: the
    profiles leave Snakemake's `code` trigger off, which would regenerate every completion shard."""
    work, _ = built
    scripts = sorted((REPO / "scripts").glob("*.py"))
    saved = {p: (p.stat().st_atime_ns, p.stat().st_mtime_ns) for p in scripts}
    try:
        for p in scripts:
            os.utime(p)  # now: newer than every output of the built workdir
        assert planned_jobs(snakemake(work, "-n")) == {}
    finally:
        for p, times in saved.items():
            os.utime(p, ns=times)


def test_config_key_order_reruns_nothing(built):
    """The same config with every mapping's keys in reverse order (as a script or another YAML writer may
    emit it) plans nothing; only the order of `datasets` (first source wins a duplicate) and `eval.sets`
    (table order) is meaningful and kept."""
    work, _ = built
    cfg = yaml.safe_load((work / "config.yaml").read_text())  # the order the run was planned with (as written)

    def reverse(obj, keep=False):
        if isinstance(obj, dict):
            items = list(obj.items()) if keep else list(reversed(list(obj.items())))
            return {k: reverse(v) for k, v in items}
        return [reverse(v) for v in obj] if isinstance(obj, list) else obj

    flipped = reverse({k: v for k, v in cfg.items() if k not in ("datasets", "eval")})
    flipped["datasets"] = reverse(cfg["datasets"], keep=True)
    flipped["eval"] = {
        **reverse({k: v for k, v in cfg["eval"].items() if k != "sets"}),
        "sets": reverse(cfg["eval"]["sets"], keep=True),
    }
    path = work / "reordered.yaml"
    path.write_text(yaml.safe_dump(flipped, sort_keys=False))
    assert path.read_text() != (work / "config.yaml").read_text()
    assert planned_jobs(snakemake(work, "-n", configfile=path)) == {}


def test_numbers_written_as_ints_or_floats_rerun_nothing(built):
    """`temperature: 0` is `0.0`, `top_p: 1` is `1.0`, `epochs: 1.0` is `1`: no job reruns."""
    work, cfg = built
    text = yaml.safe_dump(
        {
            **cfg,
            "generation": {**cfg["generation"], "temperature": 0, "top_p": 1},
            "train": {**cfg["train"], "epochs": float(cfg["train"]["epochs"])},
        }
    )
    assert "temperature: 0\n" in text and "top_p: 1\n" in text
    path = work / "numbers.yaml"
    path.write_text(text)
    assert planned_jobs(snakemake(work, "-n", configfile=path)) == {}


def test_failed_shard_reruns_only_that_shard(built):
    """A run where one generation job died (keep-going) has neither that completion nor its token shard,
    and no checkpoint or eval: the rerun does only that shard, its tokens, train and eval; the other
    shards' completions are kept."""
    work, _ = built
    lost = [
        work / "results/completions/gsm8k/00001.parquet",
        work / "results/tokens/gsm8k/00001.parquet",
        work / "results/eval/e2e/acceptance.json",
    ]
    final = work / "results/checkpoints/e2e/final"
    saved = [p.read_bytes() for p in lost]
    for p in lost:
        p.unlink()
    final.rename(final.with_name("final.aside"))
    try:
        jobs = planned_jobs(snakemake(work, "-n"))
        assert jobs.get("generate_completions") == 1 and jobs.get("tokenize_completions") == 1
        assert jobs.get("train_drafter") == 2 and jobs.get("evaluate_acceptance") == 1  # + zero_features baseline
        assert "shard_prompts" not in jobs and "probe_target" not in jobs
    finally:
        for p, data in zip(lost, saved):
            p.write_bytes(data)
        final.with_name("final.aside").rename(final)


def _plan_with_edited_package(work, tmp_path, edit) -> dict[str, int]:
    """`snakemake -n` job counts with a copy of the package first on PYTHONPATH, ``edit(pkg_dir)`` applied."""
    import shutil

    pkg = tmp_path / "src" / "dflash_pipeline"
    shutil.copytree(REPO / "src" / "dflash_pipeline", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    edit(pkg)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(tmp_path / "src") + (os.pathsep + old if old else "")
    try:
        return planned_jobs(snakemake(work, "-n"))
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


@pytest.mark.parametrize("module", ["tokens/shard.py", "target/chat.py"])
def test_tokenization_code_edit_keeping_the_revision_reruns_nothing(built, tmp_path, module):
    """An edit of a tokenization module that keeps ``workflow.TOKENIZATION_REVISION`` (a refactor: the
    golden test, tests/unit/tokens/test_tokenization_golden.py, proves the shard bytes stay) plans nothing."""
    work, _ = built

    def edit(pkg):
        assert (pkg / module).is_file()  # an edit of the module itself, not a new file beside its package
        with open(pkg / module, "a", encoding="utf-8") as fh:
            fh.write("\n# an edit of the tokenization code\n")

    assert _plan_with_edited_package(work, tmp_path, edit) == {}


def test_tokenization_revision_bump_retokenizes_only(built, tmp_path):
    """A new ``TOKENIZATION_REVISION`` (the token-shard bytes changed): every token shard is planned again (and
    what reads them), no completion, prompt shard or probe is."""
    work, _ = built

    def edit(pkg):
        from dflash_pipeline.workflow.policy import TOKENIZATION_REVISION

        text = (pkg / "workflow" / "policy.py").read_text(encoding="utf-8")
        line = f'TOKENIZATION_REVISION = "{TOKENIZATION_REVISION}"'
        assert line in text
        (pkg / "workflow" / "policy.py").write_text(
            text.replace(line, 'TOKENIZATION_REVISION = "bumped"'), encoding="utf-8"
        )

    jobs = _plan_with_edited_package(work, tmp_path, edit)
    assert jobs.get("tokenize_completions") == 3, jobs
    assert "generate_completions" not in jobs and "shard_prompts" not in jobs and "probe_target" not in jobs


def test_completion_stats_written_next_to_shards(built):
    work, _ = built
    for shard in ("gsm8k/00000", "gsm8k/00001", "mt_bench/00000"):
        stats = json.loads((work / f"results/completions/{shard}.stats.json").read_text())
        assert stats["backend"] == "transformers" and stats["prompts"] == stats["ok"] + stats["truncated"]
        assert stats["completion_tokens"] > 0 and stats["run"]["requests_per_s"] > 0


def report_files(html: str) -> dict[str, bytes]:
    """Files embedded in a Snakemake HTML report (data URIs), by file name."""
    import base64

    found = re.findall(r"data:[\w/+.-]+;charset=utf8;filename=([^;]+);base64,([A-Za-z0-9+/=]+)", html)
    return {name: base64.b64decode(data) for name, data in found}


def test_report_builds_with_eval_numbers(built):
    """`snakemake --report` on the built workdir: the HTML embeds the eval table with the τ of the eval
    record, the plots, the probe, the prompts manifest and the generation stats."""
    work, _ = built
    proc = snakemake(work, "--report", str(work / "report.html"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    html = (work / "report.html").read_text(encoding="utf-8")
    files = report_files(html)
    expected = {
        "acceptance.tsv",
        "acceptance.json",
        "acceptance.png",
        "tau_vs_step.png",
        "train_curves.png",
        "val_tau.png",
        "probe.tsv",
        "prompts.tsv",
        "generation.tsv",
        "tokens.tsv",
    }
    assert expected <= set(files), sorted(files)
    ev = json.loads((work / "results/eval/e2e/acceptance.json").read_text())
    table = files["acceptance.tsv"].decode()
    assert table == (work / "results/eval/e2e/acceptance.tsv").read_text()
    for label, entry in ev["drafters"].items():
        for set_name, s in entry["sets"].items():
            assert f"{label}\t{set_name}\t{round(s['tau'], 3)}\t" in table
    assert "4. Evaluation" in html and "Per-position acceptance per eval set" in html  # categories, captions
    assert b"drafter.target_layer_ids" in files["probe.tsv"]


def test_report_shows_tables_inline(built, chromium, tmp_path):
    """Issue #18: the report's landing page (headless Chromium, the DOM after its scripts ran) shows the τ
    table and every data count as HTML tables with readable labels; the screenshot is not blank."""
    import html as html_lib

    work, _ = built
    report = work / "report.html"
    if not report.is_file():
        proc = snakemake(work, "--report", str(report))
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    proc = chromium(report.as_uri(), "--virtual-time-budget=10000", "--dump-dom")
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout

    def table(table_id: str) -> list[list[str]]:
        m = re.search(rf'<table id="{table_id}"[^>]*>(.*?)</table>', dom, re.S)
        assert m, f"no inline table {table_id!r} in the rendered report"
        return [
            [
                html_lib.unescape(re.sub(r"<[^>]+>", "", c)).strip()
                for c in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row, re.S)
            ]
            for row in re.findall(r"<tr>(.*?)</tr>", m.group(1), re.S)
        ]

    ev = json.loads((work / "results/eval/e2e/acceptance.json").read_text())
    tau = table("tau")
    assert tau[0] == ["drafter", *ev["drafters"]["trained"]["sets"]]
    by_drafter = {r[0]: r[1:] for r in tau[1:]}
    assert set(by_drafter) == set(ev["drafters"])
    for lbl, entry in ev["drafters"].items():
        assert by_drafter[lbl] == [str(round(s["tau"], 3)) for s in entry["sets"].values()]
    prompts = table("prompts")
    assert prompts[0][:3] == ["dataset", "records read", "prompts kept"]
    assert ["gsm8k", "12", "12"] == next(r for r in prompts if r[0] == "gsm8k")[:3]
    tokens = table("tokens")
    assert "supervised tokens" in tokens[0] and tokens[-1][0] == "all"
    tok_tsv = (work / "results/report/tokens.tsv").read_text().splitlines()
    assert tokens[-1] == tok_tsv[-1].split("\t")  # the same numbers as the table file
    assert table("generation")[-1][:3] == ["all", "3", "16"]
    assert any(r[0] == "drafter.block_size" and r[1] == "4" for r in table("probe"))
    assert any(r[0] == "settings.block_size" for r in table("eval-record"))
    shot = tmp_path / "report.png"
    proc = chromium(report.as_uri(), "--virtual-time-budget=10000", "--window-size=1400,2400", f"--screenshot={shot}")
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    from PIL import Image

    img = Image.open(shot).convert("L")
    lo, hi = img.getextrema()
    assert hi - lo > 100 and len(set(img.getdata())) > 8, "blank screenshot"


def _mtimes(root) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in sorted(root.rglob("*")) if p.is_file()}


def test_second_config_never_rebuilds_the_first(built):
    """Issue #26: a second config with other demo settings (its own results dir) and a third with another
    block size in the same results dir build their own demo target and probe record; afterwards the first
    config plans nothing and none of its files was touched."""
    work, cfg = built
    resources = work / "resources"
    first_targets = {p.name for p in resources.iterdir()} if resources.exists() else set()  # the shipped one: none
    before = {**_mtimes(work / "results"), **(_mtimes(resources) if resources.exists() else {})}
    other_demo = dict(cfg, results_dir="results-b", target={**cfg["target"], "demo": {"train_steps": 5}})
    path = work / "other_demo.yaml"
    path.write_text(yaml.safe_dump(other_demo))
    proc = snakemake(work, "results-b/probe/e2e.json", configfile=path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    new_targets = sorted({p.name for p in (work / "resources").iterdir()} - first_targets)
    assert len(new_targets) == 1 and new_targets[0].startswith("demo-target-"), new_targets  # beside the first one
    facts = json.loads((work / "resources" / new_targets[0] / "demo_target.json").read_text())
    assert facts["train_steps"] == 5 and facts["params"]["train_steps"] == 5
    other_drafter = dict(cfg, run="e2e-block3", drafter={**cfg["drafter"], "block_size": 3})
    path = work / "other_drafter.yaml"
    path.write_text(yaml.safe_dump(other_drafter))
    proc = snakemake(work, "results/probe/e2e-block3.json", configfile=path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert json.loads((work / "results/probe/e2e-block3.json").read_text())["drafter"]["block_size"] == 3
    assert planned_jobs(snakemake(work, "-n")) == {}
    after = {**_mtimes(work / "results"), **_mtimes(resources)}
    assert {p: t for p, t in after.items() if p in before} == before  # the first run's files untouched


def test_landing_page_in_chromium(built, chromium, tmp_path):
    """Issue #26: results/report/summary.html, opened on its own in headless Chromium, loads every plot (natural
    width > 0) and its τ table equals acceptance.json; the screenshot is kept ($DFLASH_TEST_ARTEFACTS)."""
    import html as html_lib

    from conftest import PROBE_SCRIPT, artefact_dir

    work, _ = built
    page = work / "results/report/summary.html"
    probed = tmp_path / "summary.html"
    probed.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE_SCRIPT + "</body>"), encoding="utf-8")
    proc = chromium(probed.as_uri(), "--virtual-time-budget=10000", "--dump-dom")
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    images = json.loads(html_lib.unescape(re.search(r'<pre id="image-check">(.*?)</pre>', dom, re.S).group(1)))
    val_log = work / "results/checkpoints/e2e/val_log.jsonl"
    validations = val_log.read_text().splitlines() if val_log.is_file() else []
    assert [i[0] for i in images] == [
        "fig-tau-per-set",
        "fig-acceptance",
        "fig-tau-by-length",
        "fig-tau-vs-step",
        "fig-train-curves",
        *(["fig-val-tau"] if len(validations) > 1 else []),  # one validation: a header line, not a one-point plot
        "fig-data-lengths",
    ]
    # the findings open the page, right under the header
    assert re.search(r'</header>\s*<section id="findings"', dom), dom[:3000]
    assert all(w > 0 and done for _, w, done in images), images
    m = re.search(r'<table id="tau"[^>]*>(.*?)</table>', dom, re.S)
    rows = [
        [
            html_lib.unescape(re.sub(r"<[^>]+>", "", c)).strip()
            for c in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", r, re.S)
        ]
        for r in re.findall(r"<tr>(.*?)</tr>", m.group(1), re.S)
    ]
    ev = json.loads((work / "results/eval/e2e/acceptance.json").read_text())
    assert rows[0] == ["drafter", *ev["drafters"]["trained"]["sets"]]
    assert {r[0]: r[1:] for r in rows[1:]} == {
        lbl: [str(round(s["tau"], 3)) for s in e["sets"].values()] for lbl, e in ev["drafters"].items()
    }
    header = re.search(r'<header id="run-header".*?</header>', dom, re.S).group(0)
    assert "DFlashDraftModel" in header and "? " not in re.sub(r"<[^>]+>", "", header).split("wall time")[0]
    assert re.search(r'<details id="eval-details"[^>]*>.*id="eval-record"', dom, re.S)
    shot = artefact_dir() / "report-summary-e2e.png"
    proc = chromium(page.as_uri(), "--virtual-time-budget=10000", "--window-size=1300,2600", f"--screenshot={shot}")
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
