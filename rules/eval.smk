rule evaluate_acceptance:
    """τ with a real speculative loop on held-out prompts: the trained drafter beside its baselines
    (config `eval.baselines`) and an untrained floor; τ across the intermediate step_<N>/ exports."""
    input:
        unpack(get_baseline_checkpoints),
        probe=probe_json(),
        target=target_input(),
        manifest=prompts_manifest(),
        drafter=final_checkpoint(),
    output:
        acceptance=report(
            f"{eval_dir()}/acceptance.json",
            caption="../report/acceptance_json.rst",
            category="4. Evaluation",
            labels={"what": "eval record (JSON)"},
        ),
        table=report(
            f"{eval_dir()}/acceptance.tsv",
            caption="../report/acceptance_table.rst",
            category="4. Evaluation",
            labels={"what": "τ per set and drafter"},
        ),
        plot=report(
            f"{eval_dir()}/acceptance.png",
            caption="../report/acceptance_plot.rst",
            category="4. Evaluation",
            labels={"what": "per-position acceptance"},
        ),
        series=f"{eval_dir()}/tau_vs_step.json",
        series_plot=report(
            f"{eval_dir()}/tau_vs_step.png",
            caption="../report/tau_vs_step.rst",
            category="4. Evaluation",
            labels={"what": "τ across checkpoints"},
        ),
    params:
        target=target_dir_of_input,
        eval={**canonical(config["eval"]), "sets": canonical(with_repo_paths(config["eval"]["sets"]), keep_order=True)},
        baseline_labels=baseline_labels_of,
        thinking=config["generation"]["thinking"],
        chat_template=config["target"]["chat_template"],
        trust_remote_code=config["target"]["trust_remote_code"],
    log:
        log_file("evaluate_acceptance", "{run}"),
    benchmark:
        benchmark_file("evaluate_acceptance", "{run}")
    threads: workflow.cores
    resources:
        gpu=gpus("evaluate_acceptance"),
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/evaluate_acceptance.py"
