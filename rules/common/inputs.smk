# Input functions (`get_*`, as the snakemake-workflows name them): called per job with its wildcards;
# those below the prompts checkpoint read its manifest, so the DAG is re-evaluated after it ran.

from dflash_pipeline.workflow import policy as wf


def get_shard_list(wildcards):
    """(dataset, shard) pairs written by the prompts checkpoint (parsed once per manifest version)."""
    return wf.shard_list(checkpoints.shard_prompts.get().output.manifest)


def get_token_shards(wildcards):
    return [token_shard(d, s) for d, s in get_shard_list(wildcards)]


def get_completion_shards(wildcards):
    return [completion_shard(d, s) for d, s in get_shard_list(wildcards)]


def get_completion_stats(wildcards):
    return [completion_stats(d, s) for d, s in get_shard_list(wildcards)]


def get_feature_shards(wildcards):
    """Feature shards of every token shard (same order as get_token_shards)."""
    return [f"{RESULTS}/features/{d}/{s}.safetensors" for d, s in get_shard_list(wildcards)]


def get_train_feature_shards(wildcards):
    """`train_drafter` input: the feature shards with train.target_features: shards, none online."""
    return get_feature_shards(wildcards) if FEATURES_FROM_SHARDS else []


def get_baseline_checkpoints(wildcards):
    """Final checkpoints of the baselines of `wildcards.run`, keyed by label (eval and plot input)."""
    return {b: final_checkpoint(r) for b, r in baseline_runs(wildcards.run).items()}


def get_engine_record(wildcards):
    """evaluate_acceptance's engine τ input (eval.engine): `engine.json` of the run, none when eval.engine is none."""
    return [] if config["eval"]["engine"] == "none" else [f"{eval_dir(wildcards.run)}/engine.json"]
