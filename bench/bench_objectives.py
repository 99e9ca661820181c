"""Compare training objectives (``train.loss``) with several seeds, so a difference in τ can be told from noise.

Every objective trains on the same token shards (the same completions), with the same ``train`` config and
so the same steps, once per seed (``train.seed``: init, batch order, anchors); every trained drafter is then
evaluated with the eval stage's speculative loop on the same held-out prompts (training prompts excluded).
τ of one (objective, seed, set) is the mean over responses (reference/dflash.md §7.1), as the eval stage
reports it.

Uncertainty comes from two crossed sources: the seeds (training noise) and the prompts (which prompts were
drawn). Both are resampled together in a two-way bootstrap (seeds and conversations, with replacement,
independently; Owen 2007, "The pigeonhole bootstrap"): the standard error (SE) printed is the bootstrap SD,
the 95 % interval its percentiles. Differences to the first objective (``Δ``) are paired: the same resample
of seeds and conversations for both objectives, so the prompts' shared difficulty cancels.

    # the token shards, target and probe of a default run (snakemake --profile local):
    nice -n 15 python bench/bench_objectives.py --tokens results/tokens/*/*.parquet \
        --target resources/demo-target --probe results/probe/demo.json --seeds 0 1 2 \
        --work bench-objectives --out bench-objectives/table.json

    python bench/bench_objectives.py --size tiny --seeds 0 1 --work /tmp/objectives   # smoke test: seconds
    nice -n 15 python bench/bench_objectives.py --size small --work bench-objectives  # built inputs, ~1 h on 2 cores

Outputs: ``<work>/<loss>-seed<S>/`` (each run's trainer outputs and its eval answers, ``bench_eval.json``;
finished runs and evals are reused when the bench is run again; Ctrl-C summarizes the seeds every objective
finished), ``--out`` (JSON: per-seed τ, means, SEs, intervals, paired differences) and the table on
stdout (Markdown).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
LOSSES = ("ce_decay", "dpace", "kl")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", nargs="+", help="token shards (results/tokens/*/*.parquet of a default run)")
    p.add_argument("--target", help="target directory of those shards")
    p.add_argument("--probe", help="probe record of the run (results/probe/<run>.json)")
    p.add_argument(
        "--config",
        default=str(REPO / "config" / "config.yaml"),
        help="config whose `train`, `eval` and `generation.thinking` are used (default: the embedded one)",
    )
    p.add_argument(
        "--losses", nargs="+", default=list(LOSSES), choices=LOSSES, help="objectives; the first is the reference of Δ"
    )
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument(
        "--samples",
        nargs="*",
        default=[],
        metavar="SET=N",
        help="eval prompts per set (default: the config's num_samples), e.g. gsm8k=100 humaneval=60",
    )
    p.add_argument("--max-new-tokens", type=int, help="eval.max_new_tokens (default: the config's)")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    p.add_argument("--work", required=True, help="directory of the runs (reused when run again)")
    p.add_argument("--out", help="JSON of the results (default: <work>/objectives.json)")
    p.add_argument(
        "--size",
        choices=sorted(SIZES),
        help="build the inputs under --work instead (tiny: the smoke test, "
        "seconds; small: a 64-wide target and 600 GSM8K conversations)",
    )
    a = p.parse_args(argv)
    if not a.size and not (a.tokens and a.target and a.probe):
        p.error("--tokens, --target and --probe are required (or --size)")
    return a


# ---------------------------------------------------------------------------------------------------
# Inputs: a default run's, or a tiny set built here
# ---------------------------------------------------------------------------------------------------


#: Inputs the bench builds itself (``--size``): a demo target, its probe, and token shards of bundled GSM8K train
#: conversations with their reference answers (loss on the answer; not the target's regenerated answers, so
#: τ is lower than a pipeline run's, the same for every objective), and the train/eval settings.
SIZES = {
    "tiny": {
        "demo": {"vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 6, "train_steps": 3},
        "corpus": 300,
        "drafter": {"block_size": 4, "num_draft_layers": 1, "num_target_features": 2},
        "records": 32,
        "max_len": 256,
        "train": {"epochs": 1, "batch_size": 8, "num_anchors": 8},
        "eval": {"max_new_tokens": 6, "sets": {"gsm8k": ("gsm8k/test.jsonl", 3)}},
    },
    "small": {
        "demo": {"vocab_size": 600, "hidden_size": 64, "num_hidden_layers": 6, "train_steps": 150},
        "corpus": None,
        "drafter": {"block_size": 4, "num_draft_layers": 1, "num_target_features": 2},
        "records": 600,
        "max_len": 160,
        "train": {"epochs": 3, "batch_size": 16, "num_anchors": 16},
        "eval": {
            "max_new_tokens": 32,
            "sets": {
                "gsm8k": ("gsm8k/test.jsonl", 80),
                "humaneval": ("humaneval/HumanEval.jsonl.gz", 40),
                "mt_bench": ("mt_bench/question.jsonl", 20),
            },
        },
    },
}


def built_inputs(work: Path, size: str) -> tuple[list[Path], Path, dict, dict]:
    """The inputs of ``--size`` (:data:`SIZES`), built under ``work`` (an existing target is reused): token
    shards, target dir, probe record and the config sections the bench reads."""
    from dflash_pipeline.core.contracts import TOKEN_SCHEMA, prompt_id
    from dflash_pipeline.core.shards import table_from_records, write_parquet
    from dflash_pipeline.demo import build_demo_target, encode_conversation, load_corpus
    from dflash_pipeline.probe import probe_target

    spec = SIZES[size]
    corpus = [REPO / "data" / "gsm8k" / "train.jsonl"]
    if spec["corpus"]:  # the first records only (the tokenizer trains on the whole corpus)
        lines = corpus[0].read_text(encoding="utf-8").splitlines()[: spec["corpus"]]
        corpus = [work / f"{size}-corpus.jsonl"]
        corpus[0].write_text("\n".join(lines) + "\n", encoding="utf-8")
    target = work / f"{size}-target"
    if not (target / "config.json").is_file():
        build_demo_target(target, corpus, seed=0, log=None, **spec["demo"])
    probe = probe_target(target, target_layer_ids=None, mask_token_id=None, **spec["drafter"])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    rows = []
    for conv in load_corpus(corpus):
        ids, mask = encode_conversation(tok, conv, max_len=spec["max_len"])
        if sum(mask) < 2:  # the answer cut off: nothing to train on
            continue
        if len(rows) == spec["records"]:
            break
        rows.append(
            {
                "prompt_id": prompt_id(conv[:1]),
                "input_ids": ids,
                "loss_mask": mask,
                "num_tokens": len(ids),
                "num_loss_tokens": int(sum(mask)),
                "truncated": False,
                "turn": 0,
            }
        )
    shard = work / f"{size}-tokens" / "00000.parquet"
    shard.parent.mkdir(parents=True, exist_ok=True)
    write_parquet(shard, table_from_records(rows, TOKEN_SCHEMA))
    cfg = {
        "train": {**spec["train"], "learning_rate": 2e-3, "save_every_steps": 10**6, "validation_fraction": 0.0},
        "eval": {
            "max_new_tokens": spec["eval"]["max_new_tokens"],
            "seed": 0,
            "temperature": 0.0,
            "block_size": None,
            "sets": {
                k: {"path": str(REPO / "data" / p), "num_samples": n} for k, (p, n) in spec["eval"]["sets"].items()
            },
        },
        "generation": {"thinking": "disable"},
    }
    return [shard], target, probe, cfg


def run_config(path: str | Path) -> dict:
    """``train``, ``eval`` and ``generation`` of a config file, validated with the schema's defaults filled
    (:func:`dflash_pipeline.config.load_config`); eval set paths resolved against the repo."""
    from dflash_pipeline.core.config import load_config

    cfg = load_config(path)
    for s in cfg["eval"]["sets"].values():
        if not Path(s["path"]).is_absolute():
            s["path"] = str(REPO / s["path"])
    return cfg


# ---------------------------------------------------------------------------------------------------
# Training and evaluation
# ---------------------------------------------------------------------------------------------------


def train_run(work: Path, loss: str, seed: int, *, tokens, target, probe: dict, train_cfg: dict) -> Path:
    """Train one drafter (``train.loss`` = ``loss``, ``train.seed`` = ``seed``) into ``work/<loss>-seed<S>``;
    returns its ``final/`` (an existing one is reused)."""
    from dflash_pipeline.train import train

    out = work / f"{loss}-seed{seed}"
    if not (out / "final" / "model.safetensors").is_file():
        t0 = time.time()
        summary = train(
            token_shards=[str(t) for t in tokens],
            probe=probe,
            target_dir=target,
            out_dir=out,
            cfg={**train_cfg, "loss": loss, "seed": seed},
            device="cpu",
        )
        print(f"[bench] trained {out.name}: {summary['steps']} steps in {time.time() - t0:.0f} s", flush=True)
    return out / "final"


def response_taus(session, drafter_dir: Path) -> dict[str, list[list[float]]]:
    """Per eval set, per conversation: τ of each of its responses (mean a+1 over the response's verify steps)."""
    from dflash_pipeline.evaluate import answer_eval_set, load_eval_drafter

    drafter, info = load_eval_drafter(session, drafter_dir.parent.name, drafter_dir)
    out = {}
    for name, prompts in session.sets.items():
        convs = answer_eval_set(
            session.target,
            session.tokenizer,
            drafter,
            prompts,
            zero_target_features=info["zero_target_features"],
            **session.loop,
        )
        out[name] = [
            [sum(r.accept_lengths) / len(r.accept_lengths) for r in conv if r.accept_lengths] for conv in convs
        ]
    return out


# ---------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------


def bootstrap(per: dict, losses, seeds, *, resamples: int, rng_seed: int = 0) -> dict:
    """Two-way bootstrap of τ per set (module docstring).

    ``per[loss][seed][set]`` = per conversation, the τ of its responses. Returns per set: ``tau`` (loss →
    mean over seeds of the per-seed τ), ``per_seed`` (loss → [τ per seed]), ``se`` and ``ci95`` (loss →
    bootstrap SD and 2.5/97.5 percentiles), ``delta`` / ``delta_se`` / ``delta_ci95`` (loss → paired
    difference to ``losses[0]``), ``num_conversations``, ``num_responses``.
    """
    rng = np.random.default_rng(rng_seed)
    sets = list(per[losses[0]][seeds[0]])
    out = {}
    for name in sets:
        n_conv = len(per[losses[0]][seeds[0]][name])
        # T[o, s, c]: summed τ of conversation c's responses in run (o, s); N[o, s, c]: how many there are
        T = np.array([[[sum(c) for c in per[lo][s][name]] for s in seeds] for lo in losses], dtype=float)
        N = np.array([[[len(c) for c in per[lo][s][name]] for s in seeds] for lo in losses], dtype=float)
        point = T.sum(2) / np.maximum(1.0, N.sum(2))  # [O, S]: τ per loss and seed (mean over responses)
        ws = rng.multinomial(len(seeds), [1 / len(seeds)] * len(seeds), size=resamples).astype(float)  # [B, S]
        wc = rng.multinomial(n_conv, [1 / n_conv] * n_conv, size=resamples).astype(float)  # [B, C]
        # each resampled seed's τ over the resampled conversations, averaged over the resampled seeds
        per_seed = np.einsum("osc,bc->bos", T, wc) / np.maximum(1.0, np.einsum("osc,bc->bos", N, wc))  # [B, O, S]
        boot = np.einsum("bos,bs->bo", per_seed, ws) / len(seeds)  # [B, O]
        diff = boot - boot[:, :1]
        out[name] = {
            "num_conversations": n_conv,
            "num_responses": int(N[0, 0].sum()),
            "per_seed": {lo: point[i].round(4).tolist() for i, lo in enumerate(losses)},
            "tau": {lo: round(float(point[i].mean()), 4) for i, lo in enumerate(losses)},
            "se": {lo: round(float(boot[:, i].std(ddof=1)), 4) for i, lo in enumerate(losses)},
            "ci95": {lo: np.percentile(boot[:, i], [2.5, 97.5]).round(3).tolist() for i, lo in enumerate(losses)},
            "delta": {lo: round(float(point[i].mean() - point[0].mean()), 4) for i, lo in enumerate(losses)},
            "delta_se": {lo: round(float(diff[:, i].std(ddof=1)), 4) for i, lo in enumerate(losses)},
            "delta_ci95": {lo: np.percentile(diff[:, i], [2.5, 97.5]).round(3).tolist() for i, lo in enumerate(losses)},
        }
    return out


def markdown_table(stats: dict, losses, seeds, steps: int) -> str:
    """The comparison as a Markdown table: per objective and set, τ ± SE [95 % CI] and Δ to the first objective."""
    sets = list(stats)
    head = (
        "| objective | "
        + " | ".join(f"{s} ({stats[s]['num_conversations']} conv., {stats[s]['num_responses']} resp.)" for s in sets)
        + " |"
    )
    lines = [
        f"τ over {len(seeds)} seeds ({', '.join(map(str, seeds))}), {steps} steps each; ± bootstrap SE, [95 % CI]; "
        f"Δ = paired difference to {losses[0]}",
        "",
        head,
        "|---" * (len(sets) + 1) + "|",
    ]
    for lo in losses:
        cells = []
        for s in sets:
            st = stats[s]
            lo_ci, hi_ci = st["ci95"][lo]
            cell = f"{st['tau'][lo]:.2f} ± {st['se'][lo]:.2f} [{lo_ci:.2f}, {hi_ci:.2f}]"
            if lo != losses[0]:
                d_lo, d_hi = st["delta_ci95"][lo]
                cell += f"; Δ {st['delta'][lo]:+.2f} [{d_lo:+.2f}, {d_hi:+.2f}]"
            cells.append(cell)
        lines.append(f"| {lo} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(stats: dict, losses) -> list[str]:
    """Per objective other than the first: whether its paired Δ interval excludes 0 on every set (the
    difference survives), on some, or on none."""
    out = []
    for lo in losses[1:]:
        sig = {s: (st["delta_ci95"][lo][0] > 0) - (st["delta_ci95"][lo][1] < 0) for s, st in stats.items()}
        if all(v > 0 for v in sig.values()):
            out.append(f"{lo} beats {losses[0]} on every set (95 % interval of Δ above 0)")
        elif all(v < 0 for v in sig.values()):
            out.append(f"{lo} is worse than {losses[0]} on every set (95 % interval of Δ below 0)")
        else:
            out.append(f"{lo} vs {losses[0]}: no difference that holds on every set ({sig})")
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    if a.size:
        tokens, target, probe, cfg = built_inputs(work, a.size)
    else:
        tokens, target, cfg = a.tokens, a.target, run_config(a.config)
        probe = json.loads(Path(a.probe).read_text(encoding="utf-8"))
    eval_cfg = dict(cfg["eval"], sets={k: dict(v) for k, v in cfg["eval"]["sets"].items()})
    for item in a.samples:
        name, _, n = item.partition("=")
        if name not in eval_cfg["sets"]:
            raise SystemExit(f"--samples {item}: no eval set {name!r} in {a.config}")
        eval_cfg["sets"][name]["num_samples"] = int(n)
    if a.max_new_tokens:
        eval_cfg["max_new_tokens"] = a.max_new_tokens
    t0 = time.time()
    from dflash_pipeline.evaluate import open_session
    import pyarrow.parquet as pq

    trained_on = {
        pid for t in tokens for pid in pq.read_table(t, columns=["prompt_id"]).column("prompt_id").to_pylist()
    }
    session = open_session(
        target_dir=target,
        probe=probe,
        eval_cfg=eval_cfg,
        thinking=cfg["generation"]["thinking"],
        exclude_prompt_ids=trained_on,
    )
    per: dict = {lo: {} for lo in a.losses}
    steps = None
    try:
        for s in a.seeds:  # seed by seed, so a bench stopped early still has whole seeds to compare
            for lo in a.losses:
                final = train_run(work, lo, s, tokens=tokens, target=target, probe=probe, train_cfg=cfg["train"])
                steps = json.loads((final / "config.json").read_text())["dflash_pipeline"]["train_steps"]
                per[lo][s] = cached_response_taus(session, final)
    except KeyboardInterrupt:  # summarize the whole seeds done so far
        print("[bench] interrupted: the table covers the seeds every objective finished", flush=True)
    seeds = [s for s in a.seeds if all(s in per[lo] for lo in a.losses)]
    if not seeds:
        print("[bench] no seed finished for every objective", flush=True)
        return 1
    stats = bootstrap(per, a.losses, seeds, resamples=a.bootstrap)
    table = markdown_table(stats, a.losses, seeds, steps)
    lines = verdict(stats, a.losses)
    print(table + "\n\n" + "\n".join(lines), flush=True)
    record = {
        "losses": a.losses,
        "seeds": seeds,
        "train_steps": steps,
        "settings": session.settings,
        "sets": session.set_info,
        "stats": stats,
        "verdict": lines,
        "table": table,
        "seconds": round(time.time() - t0, 1),
    }
    from dflash_pipeline.core.shards import write_json

    write_json(Path(a.out) if a.out else work / "objectives.json", record, skip_if_identical=False)
    return 0


def cached_response_taus(session, final: Path) -> dict[str, list[list[float]]]:
    """:func:`response_taus` of a run, kept in ``<run>/bench_eval.json`` under a key of the eval settings and
    prompts (a bench run again, or with more seeds, evaluates only what it has not yet)."""
    from dflash_pipeline.core.shards import write_json
    from dflash_pipeline.workflow.keyed_paths import params_digest

    key = params_digest(
        {
            "settings": session.settings,
            "sets": session.set_info,
            "prompts": {k: [r["prompt_id"] for r in v] for k, v in session.sets.items()},
        }
    )
    path = final.parent / "bench_eval.json"
    cache = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if key not in cache:
        t1 = time.time()
        cache[key] = response_taus(session, final)
        write_json(path, cache, skip_if_identical=False)
        print(
            f"[bench] evaluated {final.parent.name} ({time.time() - t1:.0f} s): "
            + " ".join(f"{k}={np.mean([x for c in v for x in c]):.2f}" for k, v in cache[key].items()),
            flush=True,
        )
    return cache[key]


if __name__ == "__main__":
    sys.exit(main())
