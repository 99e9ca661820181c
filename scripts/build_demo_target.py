from dflash_pipeline.demo import build_demo_target
from dflash_pipeline.workflow.policy import log_to

with log_to(snakemake.log[0], snakemake.threads):
    build_demo_target(snakemake.output[0], list(snakemake.input.corpus), **snakemake.params.demo)
