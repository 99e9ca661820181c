from pathlib import Path

from dflash_pipeline.core.shards import read_json, write_json
from dflash_pipeline.evaluate.acceptance import (
    checkpoint_info,
    evaluate,
    step_checkpoints,
    write_eval_table,
)
from dflash_pipeline.evaluate.engine_vs_loop import attach_engine_tau
from dflash_pipeline.evaluate.eval_sets import training_prompt_ids
from dflash_pipeline.workflow.policy import claim_gpus, log_to

with log_to(snakemake.log[0], snakemake.threads), claim_gpus(snakemake.resources.gpu):
    p, inp, out = snakemake.params, snakemake.input, snakemake.output
    final = Path(inp.drafter)
    drafters = {"trained": str(final), **{b: getattr(inp, b) for b in p.baseline_labels}, "untrained": None}
    series = {**step_checkpoints(final.parent), checkpoint_info(final)["train_steps"]: final}
    record = evaluate(
        target_dir=p.target,
        probe=read_json(inp.probe),
        drafters=drafters,
        eval_cfg=p.eval,
        thinking=p.thinking,
        out_json=out.acceptance,
        plot_png=out.plot,
        table_tsv=out.table,
        chat_template=p.chat_template,
        trust_remote_code=p.trust_remote_code,
        target_dtype=p.target_dtype,
        exclude_prompt_ids=training_prompt_ids(inp.manifest) if p.eval["exclude_training_prompts"] else (),
        checkpoint_series=series,
        series_json=out.series,
        series_png=out.series_plot,
        train_log=final.parent / "train_log.jsonl",
    )
    if len(inp.engine):  # eval.engine: the engine's τ beside the loop's in the record and the table
        attach_engine_tau(record, read_json(inp.engine[0]))
        write_json(out.acceptance, record, skip_if_identical=False)
        write_eval_table(record, out.table)
