rule evaluate_acceptance:
    """τ with a real speculative loop on held-out prompts: trained drafter beside an untrained floor."""
    input:
        probe=probe_json(),
        target=target_input(),
        drafter=f"{R}/checkpoints/{{run}}/final",
    output:
        acceptance=f"{R}/eval/{{run}}/acceptance.json",
        plot=f"{R}/eval/{{run}}/acceptance.png",
    params:
        target=target_dir_of_input,
        eval={**config["eval"], "sets": with_repo_paths(config["eval"]["sets"])},
        thinking=config["generation"]["thinking"],
        chat_template=config["target"]["chat_template"],
        trust_remote_code=config["target"]["trust_remote_code"],
    log:
        f"logs/evaluate_acceptance/{{run}}.log",
    threads: workflow.cores
    resources:
        gpu=gpus("evaluate_acceptance"),
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/evaluate_acceptance.py"
