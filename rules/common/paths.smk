# Pattern builders: the path (with wildcards) of each stage's outputs, and the inputs that are fixed at
# parse time (no wildcards). Input functions are in inputs.smk.
from pathlib import Path


def repo_path(path):
    """A relative path that is missing from the working directory but ships with the workflow
    (bundled data under data/) resolves against the repo, so `snakemake -d elsewhere` works."""
    from dflash_pipeline.core.config import resolve_path

    return resolve_path(path, workflow.basedir)


def with_repo_paths(sources):
    """Copy of a `datasets` / `eval.sets` mapping with each `path` resolved by :func:`repo_path`."""
    return {name: {**src, "path": repo_path(src["path"])} for name, src in sources.items()}


def demo_corpus():
    return [repo_path(p) for p in ("data/gsm8k/train.jsonl", "data/sharegpt/sharegpt.json")]


def target_dir():
    """The target model directory (the demo target is built by the workflow)."""
    path = config["target"]["path"]
    return DEMO_TARGET if path == "demo" else path


def target_input():
    """What rules that read the target depend on: the demo dir, or the real target's config.json."""
    path = config["target"]["path"]
    return DEMO_TARGET if path == "demo" else str(Path(path) / "config.json")


def dataset_inputs():
    """Local prompt source files/dirs (Hugging Face `hf:` ids are not files: their config is a param)."""
    return [d["path"] for d in with_repo_paths(config["datasets"]).values() if not d["path"].startswith("hf:")]


def prompt_filter_target():
    """The prompts checkpoint reads the target tokenizer only for `prompts.max_prompt_tokens` and
    `prompts.special_token_text: drop`; only then is the target an input (a new target re-runs the
    checkpoint, which rewrites only shards whose bytes change, so only those completions regenerate)."""
    needs = config["prompts"]["max_prompt_tokens"] is not None or config["prompts"]["special_token_text"] == "drop"
    return target_input() if needs else []


def probe_json():
    """This run's probe record: results/probe/<run>.json (results/probe/target.json where an earlier release
    wrote it with these drafter decisions; dflash_pipeline.workflow.keyed_paths.probe_record_path)."""
    return keyed_paths.probe_record_path(RESULTS, RUN_NAME, config["drafter"])


def prompts_manifest():
    return f"{RESULTS}/prompts/manifest.json"


def prompt_shard():
    return f"{RESULTS}/prompts/{{dataset}}/{{shard}}.parquet"


def completion_shard(dataset="{dataset}", shard="{shard}"):
    return f"{RESULTS}/completions/{dataset}/{shard}.parquet"


def completion_stats(dataset="{dataset}", shard="{shard}"):
    """Per-shard generation stats JSON, next to the completion shard."""
    return f"{RESULTS}/completions/{dataset}/{shard}.stats.json"


def token_shard(dataset="{dataset}", shard="{shard}"):
    return f"{RESULTS}/tokens/{dataset}/{shard}.parquet"


def feature_shard():
    """Path of one feature shard (safetensors + offsets index; format in dflash_pipeline.features.format),
    `temp()` unless features.keep."""
    path = f"{RESULTS}/features/{{dataset}}/{{shard}}.safetensors"
    return path if FEATURES["keep"] else temp(path)


def checkpoint_dir(run=RUN_NAME):
    return f"{RESULTS}/checkpoints/{run}"


def final_checkpoint(run="{run}"):
    return f"{checkpoint_dir(run)}/final"


def eval_dir(run="{run}"):
    return f"{RESULTS}/eval/{run}"


def eval_json(run=RUN_NAME):
    return f"{eval_dir(run)}/acceptance.json"


def report_table(name):
    """A table of the HTML report (`probe`, `prompts`, `generation`, `tokens`)."""
    return f"{RESULTS}/report/{name}.tsv"


def log_file(rule, *wildcards):
    """The `log:` of a job of `rule`, mirroring its output path: `logs/<rule>/<wildcards...>.log`."""
    return f"{RESULTS}/logs/{'/'.join([rule, *wildcards])}.log"


def benchmark_file(rule, *wildcards):
    """The `benchmark:` TSV of a job of `rule` (laid out as :func:`log_file`)."""
    return f"{RESULTS}/benchmarks/{'/'.join([rule, *wildcards])}.tsv"


def report_targets(run=RUN_NAME):
    """Outputs that exist for the HTML report (`snakemake --report`): tables and plots."""
    return [*(report_table(t) for t in ("probe", "prompts", "generation", "tokens")),
            f"{eval_dir(run)}/tau_vs_step.png", f"{eval_dir(run)}/train_curves.png", f"{eval_dir(run)}/val_tau.png",
            f"{RESULTS}/report/summary.html"]


def final_targets():
    return [final_checkpoint(RUN_NAME), eval_json(), *report_targets()]


def run_outputs(run=RUN_NAME):
    """(what, path) of the outputs a user looks for after a run (report summary and end-of-run message)."""
    return [
        ("drafter checkpoint (servable)", final_checkpoint(run)),
        ("τ table", f"{eval_dir(run)}/acceptance.tsv"),
        ("eval record", eval_json(run)),
        ("data tables", f"{RESULTS}/report/"),
        ("logs per job", f"{RESULTS}/logs/"),
        ("HTML report", "snakemake --report report.html  (after the run)"),
    ]
