from dflash_pipeline.completions import generate_shard, preflight_template
from dflash_pipeline.workflow.policy import claim_gpus, log_to

with log_to(snakemake.log[0], snakemake.threads), claim_gpus(snakemake.resources.gpu):
    p = snakemake.params
    preflight_template(  # fail in seconds, not after generation, if the tokens stage cannot mask this template
        p.target,
        gen_cfg=snakemake.config["generation"],
        tokens_cfg=snakemake.config["tokens"],
        chat_template=p.chat_template,
        trust_remote_code=p.trust_remote_code,
    )
    generate_shard(
        snakemake.input.prompts,
        snakemake.output.shard,
        target_dir=p.target,
        gen_cfg=snakemake.config["generation"],
        chat_template=p.chat_template,
        trust_remote_code=p.trust_remote_code,
        dtype=p.dtype,
        stats_path=snakemake.output.stats,
    )
