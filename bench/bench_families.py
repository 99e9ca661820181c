"""Compare the drafter families (``drafter.family``: DFlash, DFlash2 with either selector objective, DSpark)
trained and evaluated the way the pipeline does it, on the same data, in one run (issue #25, "Measured").

One Snakemake working directory holds one run per variant (``run: fam-<variant>``; at ``--smoke`` it is the
suite's family test, tests/bench/test_bench_families.py): the target, probe, completions and token shards are
built once and
shared (the family keys do not enter their params), and every variant trains the same ``train`` config (the
same epochs, batch size, seed and so the same optimizer steps over the same shards). Each run's eval stage
then measures τ with our speculative loop (``evaluate/speculative.py``, the family's own verify rule) on the
same held-out prompts, for the trained drafter and an untrained drafter of its own family (the floor).

Variants: ``dflash``; ``dflash2`` with ``train.selector_gold: insert`` (speculators #1006, SpecForge #772)
and with ``drop`` (NeMo Automodel); ``dspark`` with its own objective ``train.loss: dspark_tv``. The other
variants train ``train.loss`` of the base config (``ce_decay``).

Printed (and in ``<work>/families.json``), one Markdown table: trainable drafter parameters
(``train_summary.json``), optimizer steps, training tokens/s (sequence tokens the trainer consumed over the
logged windows' wall time, ``train_log.jsonl``; the machine's load moves it), τ per eval set with the
untrained floor, per-position acceptance (share of verify steps accepting ≥ k drafts, all sets pooled,
k = 1..4) and engine τ (``--engine``: ``eval.engine: vllm`` on the CPU build for DFlash; the CPU build
cannot serve DFlash2 or DSpark, README "Drafter families"). Then the insert-vs-drop difference with a
per-step standard error (verify steps treated as independent: a lower bound on the noise; one seed).

    python bench/bench_families.py --smoke --work /tmp/families   # the e2e config, shipped target: ~2.5 min
    nice -n 10 python bench/bench_families.py --size small --work bench-families   # the README table
    nice -n 10 python bench/bench_families.py --size demo --epochs 2 --work bench-families-demo   # an idle box

A finished run is reused when the bench is run again (Snakemake has nothing to do).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

#: variant → (``drafter`` keys, ``train`` keys) over the base config.
VARIANTS = {
    "dflash": ({"family": "dflash"}, {}),
    "dflash2-insert": ({"family": "dflash2"}, {"selector_gold": "insert"}),
    "dflash2-drop": ({"family": "dflash2"}, {"selector_gold": "drop"}),
    "dspark": ({"family": "dspark"}, {"loss": "dspark_tv"}),
}

#: ``--size``: the base config file and what is changed in it for every variant alike.
SIZES = {
    "smoke": {  # the suite's family test (tests/bench/test_bench_families.py): the e2e config on the shipped target
        "base": "tests/e2e/e2e_config.yaml",
        "over": {
            "drafter": {"dflash2": {"selector_rank": 16, "selector_top_k": 8}, "dspark": {"markov_rank": 16}},
            "train": {"epochs": 4, "learning_rate": 5.0e-3, "save_every_steps": 1000},
            "eval": {"baselines": [], "checkpoint_samples": 0},
        },
    },
    "small": {  # the README table on a loaded 2-core box: the e2e target, trained longer on more data
        "base": "tests/e2e/e2e_config.yaml",
        "over": {
            "target": {"demo": {"train_steps": 80, "vocab_size": 600, "hidden_size": 64, "num_hidden_layers": 6}},
            "drafter": {
                "block_size": 4,
                "num_draft_layers": 1,
                "num_target_features": 2,
                "dflash2": {"selector_rank": 16, "selector_top_k": 8},
                "dspark": {"markov_rank": 16},
            },
            "datasets": {"gsm8k": {"path": "data/gsm8k/train.jsonl", "max_prompts": 160}},
            "prompts": {"shard_size": 64},
            "generation": {"max_tokens": 32, "batch_size": 16},
            "tokens": {"max_length": 192},
            "train": {
                "epochs": 3,
                "batch_size": 8,
                "num_anchors": 16,
                "learning_rate": 5.0e-3,
                "log_every_steps": 5,
                "save_every_steps": 1000,
            },
            "eval": {
                "max_new_tokens": 32,
                "baselines": [],
                "checkpoint_samples": 0,
                "sets": {
                    "gsm8k": {"path": "data/gsm8k/test.jsonl", "num_samples": 12},
                    "humaneval": {"path": "data/humaneval/HumanEval.jsonl.gz", "num_samples": 6},
                    "mt_bench": {"path": "data/mt_bench/question.jsonl", "num_samples": 4},
                },
            },
        },
        "replace": ("datasets", "eval.sets"),
    },
    "demo": {  # the embedded demo config (target, data, drafter); lighter training and eval for a loaded 2-core box
        "base": "config/config.yaml",
        "over": {
            "train": {"num_anchors": 32},
            "eval": {
                "checkpoint_samples": 0,
                "baselines": [],
                "max_new_tokens": 64,
                "sets": {"gsm8k": {"num_samples": 16}, "humaneval": {"num_samples": 8}, "mt_bench": {"num_samples": 6}},
            },
        },
        "drop_sets": ("sharegpt_long",),
    },
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="--size smoke (the suite's smoke test)")
    p.add_argument("--size", choices=sorted(SIZES), default="demo")
    p.add_argument("--work", help="Snakemake working directory of the runs (default: a temp dir with --smoke)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--epochs", type=int, help="train.epochs for every variant (default: the size's)")
    p.add_argument("--seed", type=int, default=0, help="train.seed for every variant")
    p.add_argument("--engine", action="store_true", help="also engine τ (eval.engine: vllm) for dflash")
    p.add_argument("--cores", type=int, default=2, help="snakemake --cores")
    p.add_argument(
        "--nolock",
        action="store_true",
        help="snakemake --nolock: several bench processes build different --variants in one --work at once "
        "(after the shared stages are built)",
    )
    a = p.parse_args(argv)
    if a.smoke:
        a.size = "smoke"
    if not a.work:
        if not a.smoke:
            p.error("--work is required (except with --smoke)")
        import tempfile

        a.work = tempfile.mkdtemp(prefix="bench-families-")
    return a


def merge(base: dict, over: dict) -> dict:
    """``over`` merged into a copy of ``base`` (mappings recursively, everything else replaced)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def variant_config(size: str, variant: str, *, epochs: int | None, seed: int, engine: bool) -> dict:
    """The config of one variant's run: the size's base config with its changes, the variant's drafter and
    train keys, repo-absolute data paths (the runs live in another working directory)."""
    spec = SIZES[size]
    cfg = yaml.safe_load((REPO / spec["base"]).read_text(encoding="utf-8"))
    for key in spec.get("replace", ()):  # sections the size replaces whole
        section, _, sub = key.partition(".")
        (cfg[section] if sub else cfg).pop(sub or section, None)
    cfg = merge(cfg, spec["over"])
    for name in spec.get("drop_sets", ()):
        cfg["eval"]["sets"].pop(name, None)
    drafter, train = VARIANTS[variant]
    cfg["run"] = f"fam-{variant}"
    cfg["drafter"] = merge(cfg["drafter"], drafter)
    cfg["train"] = merge(cfg["train"], {**train, "seed": seed, **({"epochs": epochs} if epochs else {})})
    if engine and drafter["family"] == "dflash":
        cfg["eval"]["engine"] = "vllm"
    for group in (cfg["datasets"], cfg["eval"]["sets"]):
        for src in group.values():
            src["path"] = str(REPO / src["path"])
    return cfg


def run_variant(work: Path, variant: str, cfg: dict, cores: int, *, nolock: bool = False) -> float:
    """Build ``results/eval/<run>/acceptance.json`` of one variant with Snakemake; returns its wall seconds.
    Raises RuntimeError with the log's tail when Snakemake fails."""
    path = work / f"config-{variant}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        f"results/eval/{cfg['run']}/acceptance.json",
        "-s",
        str(REPO / "Snakefile"),
    ]
    cmd += ["-d", str(work), "--profile", str(REPO / "profiles" / "local"), "--cores", str(cores)]
    cmd += ["--configfile", str(path), "--replace-workflow-config", *(["--nolock"] if nolock else [])]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, check=False)
    (work / f"snakemake-{variant}.log").write_text(proc.stdout + proc.stderr, encoding="utf-8")
    if proc.returncode:
        raise RuntimeError(f"snakemake for {variant} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return time.time() - t0


def collect(work: Path, run: str) -> dict:
    """One run's figures from its outputs: ``params``, ``steps``, ``tokens_per_s``, ``tau`` / ``floor`` (set →
    τ), ``per_position`` (pooled over sets), ``engine`` (set → engine τ), ``steps_hist`` (set → a+1 counts)."""
    ckpt = work / "results" / "checkpoints" / run
    summary = json.loads((ckpt / "train_summary.json").read_text(encoding="utf-8"))
    log = [json.loads(x) for x in (ckpt / "train_log.jsonl").read_text(encoding="utf-8").splitlines() if x.strip()]
    wall = sum(r["elapsed_s"] for r in log)
    rec = json.loads((work / "results" / "eval" / run / "acceptance.json").read_text(encoding="utf-8"))
    trained = rec["drafters"]["trained"]["sets"]
    steps = {s: st["num_steps"] for s, st in trained.items()}
    pooled = [
        sum(st["per_position_acceptance"][k] * st["num_steps"] for st in trained.values()) / max(1, sum(steps.values()))
        for k in range(len(next(iter(trained.values()))["per_position_acceptance"]))
    ]
    return {
        "params": summary["trainable_params"],
        "steps": summary["steps"],
        "tokens_per_s": sum(r["tokens_per_s"] * r["elapsed_s"] for r in log) / max(1e-9, wall),
        "tau": rec["tau"]["trained"],
        "floor": rec["tau"].get("untrained", {}),
        "per_position": pooled,
        "engine": {s: st["engine"]["tau"] for s, st in trained.items() if st.get("engine")},
        "steps_hist": {s: st["histogram"] for s, st in trained.items()},
    }


def pooled_mean_se(hists: list[dict]) -> tuple[float, float, int]:
    """Mean a+1 over the verify steps of the histograms (``{"a+1": count}``), its standard error with the
    steps taken as independent, and the number of steps."""
    xs = [(int(k), c) for h in hists for k, c in h.items()]
    n = sum(c for _, c in xs)
    mean = sum(k * c for k, c in xs) / max(1, n)
    var = sum(c * (k - mean) ** 2 for k, c in xs) / max(1, n - 1)
    return mean, math.sqrt(var / max(1, n)), n


def markdown_table(figs: dict, *, engine: bool) -> str:
    """The comparison (module docstring) as Markdown: one row per variant."""
    first = next(iter(figs.values()))
    sets = list(first["tau"])
    npos = min(4, min(len(f["per_position"]) for f in figs.values()))
    head = ["variant", "trainable params", "steps", "train tokens/s"]
    head += [f"τ {s} (floor)" for s in sets]
    head += ["acceptance ≥k, k=" + ",".join(map(str, range(1, npos + 1))), "engine τ"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for variant, f in figs.items():
        family = VARIANTS[variant][0]["family"]
        if f["engine"]:
            eng = " / ".join(f"{f['engine'][s]:.2f}" for s in sets if s in f["engine"])
        elif family != "dflash":
            eng = "not on the CPU build (V2-runner Triton speculator)"
        else:
            eng = "not run (--engine)" if not engine else "—"
        cells = [variant, f"{f['params']:,}", str(f["steps"]), f"{f['tokens_per_s']:,.0f}"]
        cells += [f"{f['tau'][s]:.2f} ({f['floor'].get(s, float('nan')):.2f})" for s in sets]
        cells += [" / ".join(f"{x:.2f}" for x in f["per_position"][:npos]), eng]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def insert_vs_drop(figs: dict) -> str | None:
    """The DFlash2 selector objectives compared on the tokens per verify step pooled over every set."""
    if not {"dflash2-insert", "dflash2-drop"} <= set(figs):
        return None
    (mi, si, ni), (md, sd, nd) = (
        pooled_mean_se(list(figs[v]["steps_hist"].values())) for v in ("dflash2-insert", "dflash2-drop")
    )
    diff, se = mi - md, math.hypot(si, sd)
    word = "within noise" if abs(diff) <= 2 * se else ("insert better" if diff > 0 else "drop better")
    return (
        f"insert vs drop (a+1 per verify step, all sets pooled): insert {mi:.3f} ({ni} steps), drop {md:.3f} "
        f"({nd} steps), difference {diff:+.3f} ± {se:.3f} (per-step SE, steps as independent, one seed): {word}"
    )


def main(argv=None) -> int:
    a = parse_args(argv)
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    walls, figs = {}, {}
    for variant in a.variants:
        cfg = variant_config(a.size, variant, epochs=a.epochs, seed=a.seed, engine=a.engine)
        walls[variant] = run_variant(work, variant, cfg, a.cores, nolock=a.nolock)
        figs[variant] = collect(work, cfg["run"])
        print(f"[bench] {variant}: {walls[variant]:.0f} s (snakemake, shared stages in the first)", flush=True)
    steps = {f["steps"] for f in figs.values()}
    if len(steps) != 1:
        raise SystemExit(f"the variants trained different step counts {steps}: not comparable")
    table = markdown_table(figs, engine=a.engine)
    verdict = insert_vs_drop(figs)
    print(table + ("\n\n" + verdict if verdict else ""), flush=True)
    record = {"size": a.size, "epochs": a.epochs, "seed": a.seed, "figures": figs, "wall_s": walls}
    record.update({"table": table, "verdict": verdict, "seconds": round(time.time() - t0, 1)})
    (work / "families.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
    print(f"[bench] {len(figs)} variants in {time.time() - t0:.0f} s; record {work / 'families.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
