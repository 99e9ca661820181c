from dflash_pipeline.report.page import plot_data_lengths
from dflash_pipeline.workflow import log_to

with log_to(snakemake.log[0], snakemake.threads):
    summary = plot_data_lengths(list(snakemake.input.shards), snakemake.output[0])
    print(f"[report] training data lengths: {summary}", flush=True)
