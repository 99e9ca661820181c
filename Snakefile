# dflash-pipeline: target LLM + prompt datasets + endpoints -> trained, servable DFlash drafter.
# Stages and contracts: DESIGN.md; run: `snakemake --profile local` (plan first with `-n`).
from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version, validate

min_version("9.0")


configfile: "config/config.yaml"


# every schema problem on one line each (Snakemake's validate prints the whole schema and the first only)
from dflash_pipeline.config import normalize_numbers, schema_problems

if schema_problems(config):
    raise WorkflowError("config problems:\n  - " + "\n  - ".join(schema_problems(config)))
validate(config, "config/schema.yaml")  # fills the defaults
normalize_numbers(config)  # `temperature: 0` and `0.0` are one setting (params compare reprs)


include: "rules/common.smk"
include: "rules/demo.smk"
include: "rules/probe.smk"
include: "rules/prompts.smk"
include: "rules/completions.smk"
include: "rules/tokens.smk"
include: "rules/features.smk"
include: "rules/train.smk"
include: "rules/eval.smk"
include: "rules/report.smk"


rule all:
    input:
        final_targets(),
    default_target: True
