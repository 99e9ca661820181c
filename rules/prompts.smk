checkpoint shard_prompts:
    """Load, normalize, dedupe and mix the datasets into stable prompt shards (+ manifest).

    Only the manifest is a declared output: shard files are rewritten only when their bytes change,
    so unchanged shards keep their mtime and their completions stay valid. The target is an input only
    when its tokenizer is needed: `prompts.max_prompt_tokens`, or `prompts.special_token_text: drop` (the
    default; see `prompt_filter_target`).
    """
    input:
        datasets=dataset_inputs(),
        target=prompt_filter_target(),
    output:
        manifest=prompts_manifest(),
    params:
        datasets=canonical(with_repo_paths(config["datasets"]), keep_order=True),
        prompts=canonical(config["prompts"]),
        out_dir=prompts_dir_of_output,
        target=prompt_filter_target_dir,
        trust_remote_code=config["target"]["trust_remote_code"],
        chat_template=config["target"]["chat_template"],
    log:
        log_file("shard_prompts"),
    benchmark:
        benchmark_file("shard_prompts")
    conda:
        "../envs/data.yaml"
    script:
        "../scripts/shard_prompts.py"
