rule train_drafter:
    """Train the DFlash drafter with `accelerate launch` (target frozen; its features online or from feature shards).

    `workflow launch` resolves the machine count / rank / main address on the machine that runs it
    (train.num_machines, $DFLASH_MACHINE_RANK, or the SLURM allocation); with train.num_machines > 1 the
    rule starts one launcher per node with `srun --ntasks-per-node=1`.
    Resumes from results/checkpoints/{run}/state/ after a kill; writes final/ atomically.
    """
    input:
        probe=probe_json(),
        target=target_input(),
        tokens=get_token_shards,
        features=get_train_feature_shards,
    output:
        directory(final_checkpoint()),
    params:
        target=target_dir_of_input,
        run_dir=run_dir_of,
        train=as_json(train_params()),
        arch=as_json(train_arch()),
        srun=srun_prefix(),
        # + `--feature-shard F` per feature shard with train.target_features: shards (rules/features.smk); in
        # one param and the online default left out of `train`, so an online run's params are unchanged
        baseline=train_extra_flags,
        target_dtype=config["target"]["dtype"],
        trust=trust_remote_code_flag(),
    log:
        log_file("train_drafter", "{run}"),
    benchmark:
        benchmark_file("train_drafter", "{run}")
    threads: workflow.cores
    resources:
        gpu=gpus("train_drafter"),
    conda:
        "../envs/train.yaml"
    shell:
        "OMP_NUM_THREADS={threads} python -m dflash_pipeline.workflow gpus {resources.gpu} -- "
        "{params.srun}python -m dflash_pipeline.workflow launch {params.train:q} -- "
        "--no_python dflash-train --probe {input.probe:q} --target {params.target:q} "
        "--target-dtype {params.target_dtype} "
        f"--device {config['train']['device']} "  # where, not what: not a param (see train_params)
        "{params.trust} --out-dir {params.run_dir:q} --train-config {params.train:q} {params.baseline} "
        "--drafter-arch {params.arch:q} {input.tokens:q} "
        "2>&1 | python -m dflash_pipeline.workflow tee {log:q}"  # the log, and [train] lines on the console


# --- plan-time check (common/checks.smk) ---------------------------------------------------------


device_memory_plan()  # one step's peak per trainer rank against train.device_memory_gb
