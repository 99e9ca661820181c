rule tokenize_completions:
    """Render one completion shard with the target's chat template; assistant-only loss mask."""
    input:
        completions=completion_shard(),
        target=target_input(),
    output:
        token_shard(),
    params:
        target=target_dir_of_input,
        tokens=canonical(config["tokens"]),
        chat_template=config["target"]["chat_template"],
        trust_remote_code=config["target"]["trust_remote_code"],
        # a new revision of the token-shard bytes (workflow.TOKENIZATION_REVISION) reruns this rule, never generate_completions
        code=tokenization_code(),
    log:
        log_file("tokenize_completions", "{dataset}", "{shard}"),
    benchmark:
        benchmark_file("tokenize_completions", "{dataset}", "{shard}")
    conda:
        "../envs/tokens.yaml"
    script:
        "../scripts/tokenize_completions.py"
