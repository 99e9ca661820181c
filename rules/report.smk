# Tables and plots for the HTML report: `snakemake --report report.html` after a run (see README).


report: "../report/workflow.rst"


rule summarize_probe:
    """The config probe record as a key/value table."""
    input:
        probe_json(),
    output:
        report(f"{R}/report/probe.tsv", caption="../report/probe.rst", category="1. Target"),
    log:
        f"{R}/logs/summarize_probe.log",
    conda:
        "../envs/data.yaml"
    script:
        "../scripts/summarize_report.py"


rule summarize_prompts:
    """Prompts kept and dropped (per reason) per dataset, from the manifest."""
    input:
        prompts_manifest(),
    output:
        report(f"{R}/report/prompts.tsv", caption="../report/prompts.rst", category="2. Data"),
    log:
        f"{R}/logs/summarize_prompts.log",
    conda:
        "../envs/data.yaml"
    script:
        "../scripts/summarize_report.py"


rule summarize_generation:
    """ok / truncated / error and token throughput per dataset, from the completion shards."""
    input:
        shards=all_completion_shards,
        stats=all_completion_stats,
    output:
        report(f"{R}/report/generation.tsv", caption="../report/generation.rst", category="2. Data"),
    params:
        benchmark_dir=f"{R}/benchmarks/generate_completions",
    log:
        f"{R}/logs/summarize_generation.log",
    conda:
        "../envs/data.yaml"
    script:
        "../scripts/summarize_report.py"


rule summarize_tokens:
    """Sequences, supervised tokens, truncation and drops per reason per dataset, from the token shards."""
    input:
        shards=all_token_shards,
    output:
        report(f"{R}/report/tokens.tsv", caption="../report/tokens.rst", category="2. Data"),
    log:
        f"{R}/logs/summarize_tokens.log",
    conda:
        "../envs/data.yaml"
    script:
        "../scripts/summarize_report.py"


rule plot_training:
    """Training loss and EAL proxy vs step of the drafter and its baselines (their train_log.jsonl)."""
    input:
        unpack(baseline_checkpoints),
        drafter=f"{R}/checkpoints/{{run}}/final",
    output:
        report(
            f"{R}/eval/{{run}}/train_curves.png",
            caption="../report/train_curves.rst",
            category="3. Training",
        ),
    params:
        baseline_labels=lambda wc: list(baseline_runs(wc.run)),
    log:
        f"{R}/logs/plot_training/{{run}}.log",
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/plot_training.py"


rule summarize_run:
    """The τ table, the eval record's summary and every data count as HTML tables (the report's landing page
    embeds them: report/workflow.rst)."""
    input:
        probe=f"{R}/report/probe.tsv",
        prompts=f"{R}/report/prompts.tsv",
        generation=f"{R}/report/generation.tsv",
        tokens=f"{R}/report/tokens.tsv",
        tau=f"{R}/eval/{RUN}/acceptance.tsv",
        eval=eval_json(),
    output:
        report(f"{R}/report/summary.html", caption="../report/summary.rst", category="0. Summary",
               labels={"what": "run summary (tables)"}),
    params:
        run=RUN,
        outputs=run_outputs(),
    log:
        f"{R}/logs/summarize_run.log",
    conda:
        "../envs/data.yaml"
    script:
        "../scripts/summarize_report.py"
