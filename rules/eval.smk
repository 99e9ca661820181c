rule evaluate_acceptance:
    """τ with a real speculative loop on held-out prompts: the trained drafter beside its baselines
    (config `eval.baselines`) and an untrained floor; τ across the intermediate step_<N>/ exports."""
    input:
        unpack(baseline_checkpoints),
        probe=probe_json(),
        target=target_input(),
        manifest=prompts_manifest(),
        drafter=f"{R}/checkpoints/{{run}}/final",
    output:
        acceptance=report(
            f"{R}/eval/{{run}}/acceptance.json",
            caption="../report/acceptance_json.rst",
            category="4. Evaluation",
            labels={"what": "eval record (JSON)"},
        ),
        table=report(
            f"{R}/eval/{{run}}/acceptance.tsv",
            caption="../report/acceptance_table.rst",
            category="4. Evaluation",
            labels={"what": "τ per set and drafter"},
        ),
        plot=report(
            f"{R}/eval/{{run}}/acceptance.png",
            caption="../report/acceptance_plot.rst",
            category="4. Evaluation",
            labels={"what": "per-position acceptance"},
        ),
        series=f"{R}/eval/{{run}}/tau_vs_step.json",
        series_plot=report(
            f"{R}/eval/{{run}}/tau_vs_step.png",
            caption="../report/tau_vs_step.rst",
            category="4. Evaluation",
            labels={"what": "τ across checkpoints"},
        ),
    params:
        target=target_dir_of_input,
        eval={**canonical(config["eval"]), "sets": canonical(with_repo_paths(config["eval"]["sets"]), keep_order=True)},
        baseline_labels=lambda wc: list(baseline_runs(wc.run)),
        thinking=config["generation"]["thinking"],
        chat_template=config["target"]["chat_template"],
        trust_remote_code=config["target"]["trust_remote_code"],
    log:
        f"{R}/logs/evaluate_acceptance/{{run}}.log",
    threads: workflow.cores
    resources:
        gpu=gpus("evaluate_acceptance"),
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/evaluate_acceptance.py"
