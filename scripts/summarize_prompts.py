from dflash_pipeline.report import tables as report
from dflash_pipeline.workflow.policy import log_to

with log_to(snakemake.log[0], snakemake.threads):
    report.prompts_table(snakemake.input[0], snakemake.output[0])
