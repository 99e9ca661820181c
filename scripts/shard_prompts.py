from dflash_pipeline.prompts import build_prompt_shards
from dflash_pipeline.workflow import log_to

with log_to(snakemake.log[0]):
    p = snakemake.params
    build_prompt_shards(p.datasets, p.out_dir, shard_size=p.prompts["shard_size"], seed=p.prompts["seed"])
