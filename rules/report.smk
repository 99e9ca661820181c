# Tables and plots for the HTML report: `snakemake --report report.html` after a run (see README).


report: "../report/workflow.rst"


rule summarize_probe:
    """The config probe record as a key/value table."""
    input:
        probe_json(),
    output:
        report(report_table("probe"), caption="../report/probe.rst", category="1. Target"),
    log:
        log_file("summarize_probe"),
    conda:
        "../envs/data.yaml"
    script:
        "../scripts/summarize_probe.py"


rule summarize_prompts:
    """Prompts kept and dropped (per reason) per dataset, from the manifest."""
    input:
        prompts_manifest(),
    output:
        report(report_table("prompts"), caption="../report/prompts.rst", category="2. Data"),
    log:
        log_file("summarize_prompts"),
    conda:
        "../envs/data.yaml"
    script:
        "../scripts/summarize_prompts.py"


rule summarize_generation:
    """ok / truncated / error and token throughput per dataset, from the completion shards."""
    input:
        shards=get_completion_shards,
        stats=get_completion_stats,
    output:
        report(report_table("generation"), caption="../report/generation.rst", category="2. Data"),
    params:
        benchmark_dir=f"{RESULTS}/benchmarks/generate_completions",
    log:
        log_file("summarize_generation"),
    conda:
        "../envs/data.yaml"
    script:
        "../scripts/summarize_generation.py"


rule summarize_tokens:
    """Sequences, supervised tokens, truncation and drops per reason per dataset, from the token shards."""
    input:
        shards=get_token_shards,
    output:
        report(report_table("tokens"), caption="../report/tokens.rst", category="2. Data"),
    log:
        log_file("summarize_tokens"),
    conda:
        "../envs/data.yaml"
    script:
        "../scripts/summarize_tokens.py"


rule plot_training:
    """Training loss and EAL proxy vs step of the drafter and its baselines (their train_log.jsonl), and the
    drafter's held-out validation τ (its val_log.jsonl)."""
    input:
        unpack(get_baseline_checkpoints),
        drafter=final_checkpoint(),
    output:
        curves=report(
            f"{eval_dir()}/train_curves.png",
            caption="../report/train_curves.rst",
            category="3. Training",
        ),
        validation=report(
            f"{eval_dir()}/val_tau.png",
            caption="../report/val_tau.rst",
            category="3. Training",
        ),
    params:
        baseline_labels=baseline_labels_of,
    log:
        log_file("plot_training", "{run}"),
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/plot_training.py"


rule summarize_run:
    """The τ table, the eval record's summary and every data count as HTML tables (the report's landing page
    embeds them: report/workflow.rst)."""
    input:
        probe=report_table("probe"),
        prompts=report_table("prompts"),
        generation=report_table("generation"),
        tokens=report_table("tokens"),
        tau=f"{eval_dir(RUN_NAME)}/acceptance.tsv",
        eval=eval_json(),
    output:
        report(f"{RESULTS}/report/summary.html", caption="../report/summary.rst", category="0. Summary",
               labels={"what": "run summary (tables)"}),
    params:
        run=RUN_NAME,
        outputs=run_outputs(),
    log:
        log_file("summarize_run"),
    conda:
        "../envs/data.yaml"
    script:
        "../scripts/summarize_run.py"
