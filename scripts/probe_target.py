from dflash_pipeline.probe import probe_target, write_probe
from dflash_pipeline.workflow import log_to

with log_to(snakemake.log[0]):
    p = snakemake.params
    record = probe_target(
        p.target, **p.drafter, trust_remote_code=p.trust_remote_code, chat_template=p.chat_template
    )
    write_probe(record, snakemake.output[0])
