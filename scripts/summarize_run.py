from pathlib import Path

from dflash_pipeline.core.shards import read_json
from dflash_pipeline.report import findings as report_findings
from dflash_pipeline.report import page as report_page
from dflash_pipeline.report import tables as report
from dflash_pipeline.workflow import log_to

with log_to(snakemake.log[0], snakemake.threads):
    i, o, p = snakemake.input, snakemake.output, snakemake.params
    record = read_json(i.eval)
    report_page.plot_tau_per_set(record, o.tau_per_set)
    report_page.plot_tau_by_length(record, o.tau_by_length)
    generation_rows = report.read_tsv(i.generation)[1]
    tokens_rows = report.read_tsv(i.tokens)[1]
    facts = report_page.run_facts(
        eval_json=i.eval,
        probe_json=i.probe_record,
        checkpoint=i.drafter,
        prompts_rows=report.read_tsv(i.prompts)[1],
        generation_rows=generation_rows,
        tokens_rows=tokens_rows,
        benchmark_dir=p.benchmarks,
        extra_benchmarks=[p.demo_benchmark] if p.demo_benchmark else [],
    )
    results = Path(p.benchmarks).parent  # results_dir: the completions' stats files and job logs live there
    run_dir = Path(i.drafter).parent
    found = report_findings.run_findings(
        thresholds_=report_findings.thresholds(getattr(p, "findings", None)),
        generation_rows=generation_rows,
        tokens_rows=tokens_rows,
        record=record,
        block_size=facts["drafter"]["block_size"],
        train_log=run_dir / "train_log.jsonl",
        val_log=run_dir / "val_log.jsonl",
        template_warnings_=report_findings.template_warnings_from_logs(results / "logs" / "generate_completions"),
        endpoints=report_findings.endpoint_counts(results / "completions"),
    )
    report_page.summary_page(
        o.page,
        run=p.run,
        facts=facts,
        tau_tsv=i.tau,
        eval_json=i.eval,
        tables=[
            (i.prompts, "Prompts: kept and dropped per dataset", "prompts"),
            (i.generation, "Generation per dataset", "generation"),
            (i.tokens, "Token shards per dataset", "tokens"),
            (i.probe, "Target probe", "probe"),
        ],
        figures=report_page.run_figures(i, o, record),
        outputs=[tuple(x) for x in p.outputs],
        findings=found,
    )
