from dflash_pipeline import report
from dflash_pipeline.workflow.policy import log_to

with log_to(snakemake.log[0], snakemake.threads):
    i = snakemake.input
    report.summary_html(
        snakemake.output[0], run=snakemake.params.run, tau_tsv=i.tau, eval_json=i.eval, probe_tsv=i.probe,
        prompts_tsv=i.prompts, generation_tsv=i.generation, tokens_tsv=i.tokens,
        outputs=[tuple(o) for o in snakemake.params.outputs],
    )
