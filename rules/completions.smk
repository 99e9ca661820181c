rule generate_completions:
    """Regenerate every assistant turn of one prompt shard with the target (transformers or servers)."""
    input:
        prompts=prompt_shard(),
        target=target_input(),
    output:
        shard=completion_shard(),
        stats=completion_stats(),
    params:
        target=target_dir_of_input,
        generation=generation_output_params(),  # rerun trigger; the script takes the whole section
        chat_template=config["target"]["chat_template"],
        trust_remote_code=config["target"]["trust_remote_code"],
        dtype=config["target"]["dtype"],
    log:
        log_file("generate_completions", "{dataset}", "{shard}"),
    benchmark:
        benchmark_file("generate_completions", "{dataset}", "{shard}")
    threads: workflow.cores if config["generation"]["backend"] == "transformers" else config["generation"]["client_processes"]
    resources:
        gpu=gpus("generate_completions"),
    conda:
        "../envs/completions.yaml"
    script:
        "../scripts/generate_completions.py"
