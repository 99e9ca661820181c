# Small named helpers: paths of stage outputs, lists of targets, wildcard constraints.
import json
import os
from pathlib import Path

from snakemake.exceptions import WorkflowError

R = config["results_dir"]
RUN = config["run"]
DEMO_TARGET = "resources/demo-target"


wildcard_constraints:
    dataset=r"[A-Za-z0-9_-]+",
    shard=r"\d{5}",
    run=r"[A-Za-z0-9_.-]+",


def repo_path(path):
    """A relative path that is missing from the working directory but ships with the workflow
    (bundled data under data/) resolves against the repo, so `snakemake -d elsewhere` works."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return str(path)
    shipped = Path(workflow.basedir) / p
    return str(shipped) if shipped.exists() else str(path)


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


def check_config():
    """Fail at planning time (`snakemake -n`) on settings that would otherwise fail hours later."""
    problems = []
    path = config["target"]["path"]
    if path != "demo" and not (Path(path) / "config.json").is_file():
        problems.append(f"target.path: {path}/config.json not found (a model directory, or `demo`)")
    elif path != "demo":
        from dflash_pipeline.probe import tokenizer_files_missing

        why = tokenizer_files_missing(Path(path))
        if why:
            problems.append(f"target.path: {why}; the tokens stage (and generation.api: completions) need the "
                            f"target's tokenizer (weights are needed only by the transformers backend)")
    if path != "demo" and config["generation"]["backend"] == "transformers" and (Path(path) / "config.json").is_file():
        weights = ("*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")
        if not any(any(Path(path).glob(g)) for g in weights):
            problems.append(f"target.path: no weights (*.safetensors, pytorch_model*.bin) in {path}, but "
                            f"generation.backend: transformers generates with them in-process (and training runs "
                            f"the target online); point target.path at the full model directory, or generate "
                            f"with generation.backend: openai against a server")
    template = config["target"]["chat_template"]
    if template is not None and not Path(template).is_file():
        problems.append(f"target.chat_template: {template} not found (a .jinja file, or null for the tokenizer's own)")
    if not config["datasets"]:
        problems.append("datasets: no prompt source configured (see config/config.yaml for the shape)")
    for name, src in with_repo_paths(config["datasets"]).items():
        if not src["path"].startswith("hf:") and not Path(src["path"]).exists():
            problems.append(f"datasets.{name}.path: {src['path']} not found")
    for name, src in with_repo_paths(config["eval"]["sets"]).items():
        if not Path(src["path"]).exists():
            problems.append(f"eval.sets.{name}.path: {src['path']} not found")
    eval_bs, trained_bs = config["eval"]["block_size"], config["drafter"]["block_size"]
    if eval_bs is not None and eval_bs > trained_bs:
        problems.append(f"eval.block_size: {eval_bs} exceeds drafter.block_size {trained_bs} (null = the trained one)")
    gen = config["generation"]
    if gen["backend"] == "openai" and not gen["endpoints"]:
        problems.append("generation.endpoints: the openai backend needs at least one {base_url: ...}")
    if gen["client_processes"] > 1 and gen["backend"] != "openai":
        problems.append("generation.client_processes: applies to the openai backend only (transformers generates in-process); leave it at 1")
    if gen["api"] == "completions" and gen["backend"] != "openai":
        problems.append("generation.api: completions applies to the openai backend only (transformers renders locally anyway)")
    if gen["api"] == "completions" and "chat_template_kwargs" in gen["extra_body"]:
        problems.append("generation.extra_body.chat_template_kwargs: not applied with generation.api: completions (the prompt is rendered locally; generation.thinking sets the template kwargs)")
    for ep in gen["endpoints"]:
        if ep.get("api_key_env") and ep["api_key_env"] not in os.environ and gen["backend"] == "openai":
            problems.append(f"generation.endpoints: environment variable {ep['api_key_env']} (api_key_env of {ep['base_url']}) is not set")
    if config["prompts"].get("languages") or any(
        src.get("languages") is not None or src.get("min_language_confidence") is not None
        for src in config["datasets"].values()
    ):  # language codes (imports the prompts module only when a language filter is configured)
        from dflash_pipeline.prompts import language_problems

        problems.extend(language_problems(config["prompts"], config["datasets"]))
    if problems:
        raise WorkflowError("config problems:\n  - " + "\n  - ".join(problems))


check_config()


def target_dir_of_input(wildcards, input):
    """`params.target` derived from the rule's `target` input (the demo dir, or the dir of config.json),
    so the path travels with the input (Snakemake lint: no hard-coded input prefixes in params)."""
    path = Path(input.target)
    return str(path.parent) if path.name == "config.json" else str(path)


def prompts_dir_of_output(wildcards, output):
    """Directory of the prompt shards: the one holding the manifest."""
    return str(Path(output.manifest).parent)


def probe_json():
    return f"{R}/probe/target.json"


def prompts_manifest():
    return f"{R}/prompts/manifest.json"


def prompt_shard():
    return f"{R}/prompts/{{dataset}}/{{shard}}.parquet"


#: generation keys that change what is generated: the generate_completions rerun trigger (params). The
#: others (endpoints, concurrency, client_processes, timeouts, retries, breaker, batch_size) are operational: adding a server
#: or raising a timeout must not regenerate finished shards, so the script reads them from the config.
GENERATION_OUTPUT_KEYS = ("backend", "api", "model", "thinking", "temperature", "top_p", "top_k", "max_tokens",
                          "seed", "extra_body")


def generation_output_params():
    """The output-affecting subset of ``config["generation"]`` (``api`` only when not the default ``chat``)."""
    gen = config["generation"]
    out = {k: gen[k] for k in GENERATION_OUTPUT_KEYS if k in gen}
    if out.get("api") == "chat":
        del out["api"]
    return canonical(out)


def completion_shard():
    return f"{R}/completions/{{dataset}}/{{shard}}.parquet"


def completion_stats():
    """Per-shard generation stats JSON, next to the completion shard."""
    return f"{R}/completions/{{dataset}}/{{shard}}.stats.json"


def tokenization_code():
    """Fingerprint of the code that writes token shards (a `params` of tokenize_completions)."""
    from dflash_pipeline.workflow import code_fingerprint

    return code_fingerprint()


def token_shard():
    return f"{R}/tokens/{{dataset}}/{{shard}}.parquet"


def dataset_inputs():
    """Local prompt source files/dirs (Hugging Face `hf:` ids are not files: their config is a param)."""
    return [d["path"] for d in with_repo_paths(config["datasets"]).values() if not d["path"].startswith("hf:")]


def prompt_filter_target():
    """The prompts checkpoint reads the target tokenizer only for `prompts.max_prompt_tokens` and
    `prompts.special_token_text: drop`; only then is the target an input (a new target re-runs the
    checkpoint, which rewrites only shards whose bytes change, so only those completions regenerate)."""
    needs = config["prompts"]["max_prompt_tokens"] is not None or config["prompts"]["special_token_text"] == "drop"
    return target_input() if needs else []


def prompt_filter_target_dir(wildcards, input):
    """`params.target` of the prompts checkpoint: the target dir when it is an input, else None."""
    return target_dir_of_input(wildcards, input) if input.target else None


def shard_list(wildcards):
    """(dataset, shard) pairs written by the prompts checkpoint."""
    from dflash_pipeline.prompts import list_shards

    return list_shards(checkpoints.shard_prompts.get().output.manifest)


def all_token_shards(wildcards):
    return [f"{R}/tokens/{d}/{s}.parquet" for d, s in shard_list(wildcards)]


def all_completion_shards(wildcards):
    return [f"{R}/completions/{d}/{s}.parquet" for d, s in shard_list(wildcards)]


def all_completion_stats(wildcards):
    return [f"{R}/completions/{d}/{s}.stats.json" for d, s in shard_list(wildcards)]


def checkpoint_dir(run=RUN):
    return f"{R}/checkpoints/{run}"


def eval_json(run=RUN):
    return f"{R}/eval/{run}/acceptance.json"


#: Baseline drafters (config `eval.baselines`) train as run `<run>.<baseline>` with these train.py flags.
BASELINE_TRAIN_FLAGS = {"zero_features": "--zero-target-features"}


def baseline_runs(run=RUN):
    """Label -> run name of each configured baseline drafter, e.g. {"zero_features": "demo.zero_features"}."""
    return {b: f"{run}.{b}" for b in config["eval"]["baselines"]}


def baseline_train_flags(run):
    """Extra train.py flags for a baseline run name (`demo.zero_features`), "" for a regular run."""
    base, _, suffix = run.rpartition(".")
    return BASELINE_TRAIN_FLAGS.get(suffix, "") if base else ""


def baseline_checkpoints(wildcards):
    """Final checkpoints of the baselines of `wildcards.run`, keyed by label (eval input)."""
    return {b: f"{checkpoint_dir(r)}/final" for b, r in baseline_runs(wildcards.run).items()}


def report_targets(run=RUN):
    """Outputs that exist for the HTML report (`snakemake --report`): tables and plots."""
    return [
        f"{R}/report/probe.tsv", f"{R}/report/prompts.tsv", f"{R}/report/generation.tsv", f"{R}/report/tokens.tsv",
        f"{R}/eval/{run}/tau_vs_step.png", f"{R}/eval/{run}/train_curves.png", f"{R}/report/summary.html",
    ]


def run_outputs(run=RUN):
    """(what, path) of the outputs a user looks for after a run (report summary and end-of-run message)."""
    return [
        ("drafter checkpoint (servable)", f"{checkpoint_dir(run)}/final"),
        ("τ table", f"{R}/eval/{run}/acceptance.tsv"),
        ("eval record", eval_json(run)),
        ("data tables", f"{R}/report/"),
        ("logs per job", f"{R}/logs/"),
        ("HTML report", "snakemake --report report.html  (after the run)"),
    ]


def final_targets():
    return [f"{checkpoint_dir()}/final", eval_json(), *report_targets()]


def as_json(obj):
    return json.dumps(obj, sort_keys=True)


def canonical(obj, keep_order=False):
    """``obj`` with the keys of every mapping sorted, recursively. Snakemake's params rerun trigger compares
    ``repr``s, so without this the key order of a YAML file (or of a config written by a script) would
    rerun jobs. ``keep_order`` keeps the top level in config order where it means something
    (``datasets``: the first source wins a duplicate; ``eval.sets``: the order of the eval table)."""
    if isinstance(obj, dict):
        items = obj.items() if keep_order else sorted(obj.items(), key=lambda kv: str(kv[0]))
        return {k: canonical(v) for k, v in items}
    if isinstance(obj, (list, tuple)):
        return [canonical(v) for v in obj]
    return obj


def gpus(rule):
    """The `gpu` resource of one job of `rule` (0 on CPU runs; see dflash_pipeline.workflow.job_gpus)."""
    from dflash_pipeline.workflow import job_gpus

    return job_gpus(config, rule)


def accelerate_launch_args():
    from dflash_pipeline.workflow import accelerate_launch_args as args

    return args(config["train"]["num_processes"], config["train"]["mixed_precision"])
