from dflash_pipeline.probe import probe_target, write_probe
from dflash_pipeline.workflow.policy import log_to

with log_to(snakemake.log[0]):
    p = snakemake.params
    decisions = {
        k: p.drafter[k]
        for k in ("block_size", "num_draft_layers", "num_target_features", "target_layer_ids", "mask_token_id")
    }
    record = probe_target(p.target, **decisions, trust_remote_code=p.trust_remote_code, chat_template=p.chat_template)
    write_probe(record, snakemake.output[0])
