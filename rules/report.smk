# Tables and plots for the HTML report: `snakemake --report report.html` after a run (see README).


report: "../report/workflow.rst"


# Summaries and plots take a second each: on a cluster profile they run on the submitting host, not as
# jobs that wait in the queue (and each start a Python) for that second.
localrules:
    summarize_probe,
    summarize_prompts,
    summarize_generation,
    summarize_tokens,
    plot_training,
    plot_data_lengths,
    summarize_run,


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


rule plot_data_lengths:
    """The training data's length histogram: tokens and supervised tokens per sequence, from the token shards."""
    input:
        shards=get_token_shards,
    output:
        report(f"{RESULTS}/report/data_lengths.png", caption="../report/data_lengths.rst", category="2. Data"),
    log:
        log_file("plot_data_lengths"),
    conda:
        "../envs/data.yaml"
    script:
        "../scripts/plot_data_lengths.py"


rule summarize_run:
    """The landing page a person reads first (results/report/summary.html, dflash_pipeline.report.page): a
    header (target, drafter, steps, wall time, data counts), the findings (what is wrong, with the figure behind
    each and the config key that changes it), the τ tables, every plot inline, the data tables, the eval record
    folded; report/workflow.rst embeds it in the `snakemake --report` landing page."""
    input:
        probe=report_table("probe"),
        prompts=report_table("prompts"),
        generation=report_table("generation"),
        tokens=report_table("tokens"),
        tau=f"{eval_dir(RUN_NAME)}/acceptance.tsv",
        eval=eval_json(),
        probe_record=probe_json(),
        drafter=final_checkpoint(RUN_NAME),
        acceptance_plot=f"{eval_dir(RUN_NAME)}/acceptance.png",
        tau_vs_step=f"{eval_dir(RUN_NAME)}/tau_vs_step.png",
        train_curves=f"{eval_dir(RUN_NAME)}/train_curves.png",
        val_tau=f"{eval_dir(RUN_NAME)}/val_tau.png",
        data_lengths=f"{RESULTS}/report/data_lengths.png",
    output:
        page=report(f"{RESULTS}/report/summary.html", caption="../report/summary.rst", category="0. Summary",
                    labels={"what": "run summary (landing page)"}),
        tau_per_set=f"{RESULTS}/report/tau_per_set.png",
        tau_by_length=f"{RESULTS}/report/tau_by_length.png",
    params:
        run=RUN_NAME,
        outputs=run_outputs(),
        benchmarks=f"{RESULTS}/benchmarks",
        demo_benchmark=f"benchmarks/build_demo_target{DEMO_TAG}.tsv" if config["target"]["path"] == "demo" else None,
        **findings_params(),
    log:
        log_file("summarize_run"),
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/summarize_run.py"
