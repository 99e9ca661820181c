# dflash-pipeline: target LLM + prompt datasets + endpoints -> trained, servable DFlash drafter.
# Stages and contracts: docs/DESIGN.md; run: `snakemake --profile local` (plan first with `-n`).
from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version, validate

min_version("9.0")


configfile: "config/config.yaml"


# every problem on one line each: the schema's (Snakemake's validate prints the whole schema and the first
# only), then the cross-field checks that would otherwise fail hours later (dflash_pipeline.workflow.problems)
from dflash_pipeline.core.config import coerce_cli_strings, normalize_numbers
from dflash_pipeline.workflow.problems import problems

coerce_cli_strings(config)  # `--config "drafter={block_size: 4}"` hands Snakemake's strings ('4') over
config_problems = problems(config, base_dir=workflow.basedir)
if config_problems:
    raise WorkflowError("config problems:\n  - " + "\n  - ".join(config_problems))
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


onsuccess:
    # end a run with the τ table and where the outputs are (Snakemake's own last line is "N of N steps done")
    import sys
    from dflash_pipeline.report.tables import console_summary

    # the landing page first (not in run_outputs(): that list is summarize_run's params, and the page lists it)
    page = ("run summary (read first)", f"{RESULTS}/report/summary.html")
    text = console_summary(f"{eval_dir(RUN_NAME)}/acceptance.tsv", [page, *run_outputs()])
    if text:
        print(text, file=sys.stderr, flush=True)
