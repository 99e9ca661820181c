from dflash_pipeline.evaluate.engine_acceptance import evaluate_engine
from dflash_pipeline.evaluate.eval_sets import training_prompt_ids
from dflash_pipeline.workflow.policy import claim_gpus, log_to

with log_to(snakemake.log.job, snakemake.threads), claim_gpus(snakemake.resources.gpu):
    p, inp = snakemake.params, snakemake.input
    eval_cfg = dict(p.eval)
    if p.trust_remote_code and "--trust-remote-code" not in eval_cfg["engine_args"]:  # target.trust_remote_code
        eval_cfg["engine_args"] = [*eval_cfg["engine_args"], "--trust-remote-code"]
    evaluate_engine(
        target_dir=p.target,
        drafter_dir=inp.drafter,
        eval_cfg=eval_cfg,
        thinking=p.thinking,
        out_json=snakemake.output.engine,
        log_path=snakemake.log.engine,
        chat_template=p.chat_template,
        exclude_prompt_ids=training_prompt_ids(inp.manifest) if p.eval["exclude_training_prompts"] else (),
        target_dtype=p.target_dtype,
    )
