rule evaluate_acceptance:
    """τ with a real speculative loop on held-out prompts: the trained drafter beside its baselines
    (config `eval.baselines`) and an untrained floor; τ across the intermediate step_<N>/ exports."""
    input:
        unpack(get_baseline_checkpoints),
        probe=probe_json(),
        target=target_input(),
        # engine τ beside the loop's (eval.engine; evaluate_engine below), none when eval.engine is none
        engine=get_engine_record,
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
        # the engine* keys reach the loop only through engine.json: changing them reruns evaluate_engine only
        eval={
            **canonical({k: v for k, v in config["eval"].items() if not k.startswith("engine")}),
            "sets": canonical(with_repo_paths(config["eval"]["sets"]), keep_order=True),
        },
        baseline_labels=baseline_labels_of,
        thinking=config["generation"]["thinking"],
        chat_template=config["target"]["chat_template"],
        trust_remote_code=config["target"]["trust_remote_code"],
        target_dtype=config["target"]["dtype"],
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


# --- engine τ ------------------------------------------------------------------------------------------


rule evaluate_engine:
    """τ and per-position acceptance as the engine reports them with the trained drafter loaded, on the
    same held-out prompts as evaluate_acceptance (config `eval.engine`): vLLM started here in the loop's
    dtype (/metrics deltas), or a running SGLang (`eval.engine_base_url`; each answer's meta_info)."""
    input:
        target=target_input(),
        manifest=prompts_manifest(),
        drafter=final_checkpoint(),
    output:
        engine=f"{eval_dir()}/engine.json",
    params:
        target=target_dir_of_input,
        eval={**canonical(config["eval"]), "sets": canonical(with_repo_paths(config["eval"]["sets"]), keep_order=True)},
        thinking=config["generation"]["thinking"],
        chat_template=config["target"]["chat_template"],
        trust_remote_code=config["target"]["trust_remote_code"],
        target_dtype=config["target"]["dtype"],  # the engine serves the loop's dtype (vLLM --dtype)
    log:
        job=log_file("evaluate_engine", "{run}"),
        engine=f"{RESULTS}/logs/evaluate_engine/{{run}}.vllm.log",
    benchmark:
        benchmark_file("evaluate_engine", "{run}")
    threads: workflow.cores
    resources:
        gpu=gpus("evaluate_engine"),
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/evaluate_engine.py"
