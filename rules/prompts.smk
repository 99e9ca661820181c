checkpoint shard_prompts:
    """Load, normalize, dedupe and mix the datasets into stable prompt shards (+ manifest).

    Only the manifest is a declared output: shard files are rewritten only when their bytes change,
    so unchanged shards keep their mtime and their completions stay valid.
    """
    input:
        dataset_inputs(),
    output:
        manifest=prompts_manifest(),
    params:
        datasets=with_repo_paths(config["datasets"]),
        prompts=config["prompts"],
        out_dir=prompts_dir_of_output,
    log:
        "logs/shard_prompts.log",
    conda:
        "../envs/data.yaml"
    script:
        "../scripts/shard_prompts.py"
