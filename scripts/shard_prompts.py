from dflash_pipeline.prompts import shard_prompts
from dflash_pipeline.workflow.policy import log_to

with log_to(snakemake.log[0]):
    p = snakemake.params
    shard_prompts(
        p.datasets,
        p.out_dir,
        p.prompts,
        target_dir=p.target,
        trust_remote_code=p.trust_remote_code,
        chat_template=p.chat_template,
    )
