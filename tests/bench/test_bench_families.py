"""Every drafter family trains the reduced end-to-end config (tests/e2e/e2e_config.yaml, the shipped target)
through the real workflow and beats its untrained floor; and ``bench/bench_families.py --smoke``, which runs
those trainings, prints its comparison table.

One run of the bench serves both: it trains the four variants (DFlash, DFlash2 with the ``insert`` and the
``drop`` selector objective, DSpark) in one working directory, on the same completions and token shards
(``run: fam-<variant>``; the family keys do not enter the shared stages' params), a few more steps than the base
e2e run (``train.epochs``), the same for every variant, so that training has moved τ.
"""

from __future__ import annotations

import json

import pytest
from conftest import planned_jobs, snakemake
from test_benches import NUM, assert_lines, run_bench

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]

VARIANTS = ("dflash", "dflash2-insert", "dflash2-drop", "dspark")
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "Qwen3DSparkModel"}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """``(work, printed table, families.json)`` of one ``bench_families.py --smoke`` run."""
    work = tmp_path_factory.mktemp("families")
    out = run_bench("bench_families", "--work", str(work), timeout=2400)
    return work, out, json.loads((work / "families.json").read_text())


def test_bench_families(families):
    """Four variants trained in one working directory on the same shards: one table row each, the same steps.

    Slow: four trained and evaluated runs of the workflow (about 2.5 min on 2 cores); the family tests below
    read the same runs."""
    work, out, rec = families
    assert_lines(
        out,
        r"^\| variant \| trainable params \| steps \| train tokens/s \| τ gsm8k \(floor\) \| τ humaneval \(floor\) \| "
        r"τ mt_bench \(floor\) \| acceptance ≥k, k=1,2,3 \| engine τ \|$",
        *(rf"^\| {v} \| {NUM} \| (\d+) \| {NUM} \| {NUM} \({NUM}\) \| " for v in VARIANTS),
        r"^\| dflash \| .* \| not run \(--engine\) \|$",
        r"^\| dspark \| .* \| not on the CPU build \(V2-runner Triton speculator\) \|$",
        rf"^insert vs drop .*: insert {NUM} \(\d+ steps\), drop {NUM} \(\d+ steps\), difference [+-]{NUM} ± {NUM}",
    )
    figs = rec["figures"]
    assert list(figs) == list(VARIANTS)
    assert len({f["steps"] for f in figs.values()}) == 1 and figs["dflash"]["steps"] > 0
    assert figs["dflash2-insert"]["params"] == figs["dflash2-drop"]["params"] > figs["dflash"]["params"]
    assert len(figs["dspark"]["per_position"]) == 4 and len(figs["dflash"]["per_position"]) == 3  # B vs B − 1


@pytest.mark.parametrize("variant", VARIANTS)
def test_family_trains_above_its_untrained_floor(families, variant):
    work, _, rec = families
    family = variant.split("-")[0]
    ev = json.loads((work / f"results/eval/fam-{variant}/acceptance.json").read_text())
    ckpt = json.loads((work / f"results/checkpoints/fam-{variant}/final/config.json").read_text())
    assert ckpt["architectures"] == [ARCHITECTURES[family]]
    top = 5.0 if family == "dspark" else 4.0  # DSpark verifies the whole block of 4 drafts: a+1 ≤ 5
    trained, floor = ev["tau"]["trained"], ev["tau"]["untrained"]
    assert all(1.0 <= t <= top for t in list(trained.values()) + list(floor.values())), ev["tau"]

    def mean(d):
        return sum(d.values()) / len(d)

    print(f"{variant}: trained τ {trained} vs untrained {floor}")
    assert mean(trained) > mean(floor), ev["tau"]
    serve = (work / f"results/checkpoints/fam-{variant}/final/serve.md").read_text()
    if family != "dflash":
        assert "VLLM_USE_V2_MODEL_RUNNER=1" in serve
    if family == "dspark":
        assert len(ev["drafters"]["trained"]["sets"]["gsm8k"]["per_position_acceptance"]) == 4


def test_families_share_the_data_stages(families):
    """The variants' runs reuse one target, its completions and token shards (each run writes its own probe
    record); with all four built nothing is left to do for any of them."""
    work, _, _ = families
    for variant in VARIANTS:
        target = f"results/eval/fam-{variant}/acceptance.json"
        assert planned_jobs(snakemake(work, target, "-n", configfile=work / f"config-{variant}.yaml")) == {}
    # one probe record per run (results/probe/<run>.json, README "Outputs"), each of the same target
    records = [json.loads(p.read_text()) for p in sorted((work / "results/probe").glob("*.json"))]
    assert len(records) == len(VARIANTS)
    assert len({r["target_dir"] for r in records}) == 1, [r["target_dir"] for r in records]
    assert sorted(p.name for p in (work / "results/completions").iterdir()) == ["gsm8k", "mt_bench"]
