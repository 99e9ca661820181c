# The job's settings on its command line: the values of its params (a shell rule, not a script: Snakemake reads
# a script rule's script per job at plan time; dflash_pipeline.workflow.jobs).
from dflash_pipeline.workflow.jobs import tokenize_args

TOKENS = canonical(config["tokens"])
TOKENIZE_ARGS = tokenize_args(TOKENS, config["target"]["chat_template"], config["target"]["trust_remote_code"])
# the command with the settings written in (braces escaped for Snakemake's formatting), so the rule's shell names
# no variable from outside the rule (snakemake --lint)
TOKENIZE_SHELL = (
    "python -m dflash_pipeline.workflow.jobs tokenize {input.completions:q} {output:q} --target {params.target:q} "
    + TOKENIZE_ARGS.replace("{", "{{").replace("}", "}}")
    + " --log {log:q}"
)


rule tokenize_completions:
    """Render one completion shard with the target's chat template; assistant-only loss mask."""
    input:
        completions=completion_shard(),
        target=target_input(),
    output:
        token_shard(),
    params:
        target=target_dir_of_input,
        tokens=TOKENS,
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
    shell:
        TOKENIZE_SHELL
