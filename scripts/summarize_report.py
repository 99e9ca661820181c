from dflash_pipeline import report
from dflash_pipeline.workflow import log_to

with log_to(snakemake.log[0], snakemake.threads):
    if snakemake.rule == "summarize_probe":
        report.probe_table(snakemake.input[0], snakemake.output[0])
    elif snakemake.rule == "summarize_prompts":
        report.prompts_table(snakemake.input[0], snakemake.output[0])
    elif snakemake.rule == "summarize_run":
        i = snakemake.input
        report.summary_html(
            snakemake.output[0], run=snakemake.params.run, tau_tsv=i.tau, eval_json=i.eval, probe_tsv=i.probe,
            prompts_tsv=i.prompts, generation_tsv=i.generation, tokens_tsv=i.tokens,
            outputs=[tuple(o) for o in snakemake.params.outputs],
        )
    elif snakemake.rule == "summarize_tokens":
        report.tokens_table(snakemake.input.shards, snakemake.output[0])
    else:
        report.generation_table(snakemake.input.shards, snakemake.output[0], benchmark_dir=snakemake.params.benchmark_dir)
