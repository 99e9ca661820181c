from dflash_pipeline import report
from dflash_pipeline.workflow.policy import log_to

with log_to(snakemake.log[0], snakemake.threads):
    report.prompts_table(snakemake.input[0], snakemake.output[0])
