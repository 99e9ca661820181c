from dflash_pipeline.evaluate import evaluate
from dflash_pipeline.shards import read_json
from dflash_pipeline.workflow import claim_gpus, log_to

with log_to(snakemake.log[0], snakemake.threads), claim_gpus(snakemake.resources.gpu):
    p = snakemake.params
    evaluate(
        target_dir=p.target, probe=read_json(snakemake.input.probe),
        drafters={"trained": snakemake.input.drafter, "untrained": None}, eval_cfg=p.eval,
        thinking=p.thinking, out_json=snakemake.output.acceptance, plot_png=snakemake.output.plot,
        chat_template=p.chat_template, trust_remote_code=p.trust_remote_code,
    )
