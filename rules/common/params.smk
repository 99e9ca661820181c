# Params: what a job takes from the config. Snakemake reruns a job when one of its params' repr changes,
# so every value here is canonical (sorted keys) and carries only what changes the output; the policy is
# in dflash_pipeline.workflow.policy (tests/unit/test_workflow.py pins it).
from dflash_pipeline.workflow import policy as wf
from dflash_pipeline.workflow.policy import as_json, canonical
from dflash_pipeline.drafter import families as drafter_families


def generation_output_params():
    """The output-affecting subset of `generation` (the generate_completions rerun trigger)."""
    return wf.generation_output_params(config["generation"])


def tokenization_code():
    """Revision of the token-shard bytes (a `params` of tokenize_completions; see
    dflash_pipeline.workflow.policy.TOKENIZATION_REVISION)."""
    return wf.TOKENIZATION_REVISION


def baseline_runs(run=RUN_NAME):
    """Label -> run name of each configured baseline drafter, e.g. {"zero_features": "demo.zero_features"}."""
    return wf.baseline_runs(run, config["eval"]["baselines"])


def gpus(rule):
    """The `gpu` resource of one job of `rule` (0 on CPU runs; see dflash_pipeline.workflow.policy.job_gpus)."""
    return wf.job_gpus(config, rule)


def srun_prefix():
    """`srun --ntasks-per-node=1 …` before the launcher when the run spans several machines (one
    `workflow launch` per node resolves its rank there), else ''."""
    n = config["train"]["num_machines"]
    return "srun --ntasks-per-node=1 --kill-on-bad-exit=1 " if n is not None and n > 1 else ""


def target_dir_of_input(wildcards, input):
    """`params.target` derived from the rule's `target` input (the demo dir, or the dir of config.json),
    so the path travels with the input (Snakemake lint: no hard-coded input prefixes in params)."""
    path = Path(input.target)
    return str(path.parent) if path.name == "config.json" else str(path)


def prompts_dir_of_output(wildcards, output):
    """Directory of the prompt shards: the one holding the manifest."""
    return str(Path(output.manifest).parent)


def prompt_filter_target_dir(wildcards, input):
    """`params.target` of the prompts checkpoint: the target dir when it is an input, else None."""
    return target_dir_of_input(wildcards, input) if input.target else None


def run_dir_of(wildcards):
    """`params.run_dir` of train_drafter: the run's checkpoint directory (final/, state/, step_*/)."""
    return checkpoint_dir(wildcards.run)


def baseline_flags_of(wildcards):
    """`params.baseline` of train_drafter: the extra train.py flags of a baseline run, "" otherwise."""
    return wf.baseline_train_flags(wildcards.run)


def baseline_labels_of(wildcards):
    """`params.baseline_labels`: the labels of the baselines evaluated beside `wildcards.run`."""
    return list(baseline_runs(wildcards.run))
