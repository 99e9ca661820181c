from dflash_pipeline.tokens.shard import tokenize_shard
from dflash_pipeline.workflow.policy import log_to

with log_to(snakemake.log[0]):
    p = snakemake.params
    tokenize_shard(
        snakemake.input.completions, snakemake.output[0], target_dir=p.target, tokens_cfg=p.tokens,
        chat_template=p.chat_template, trust_remote_code=p.trust_remote_code,
    )
