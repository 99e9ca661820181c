from dflash_pipeline.report import tables as report
from dflash_pipeline.workflow.policy import log_to

with log_to(snakemake.log[0], snakemake.threads):
    report.tokens_table(snakemake.input.shards, snakemake.output[0])
