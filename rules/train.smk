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
        features=train_feature_shards,
    output:
        directory(final_checkpoint()),
    params:
        target=target_dir_of_input,
        run_dir=run_dir_of,
        train=as_json(train_params()),
        arch=as_json(drafter_families.arch_params(config["drafter"])),  # + family and its section when not dflash
        srun=srun_prefix(),
        # + `--feature-shard F` per feature shard with train.target_features: shards (rules/features.smk); in
        # one param and the online default left out of `train`, so an online run's params are unchanged
        baseline=lambda wc, input: " ".join(filter(None, [baseline_flags_of(wc), train_feature_flags(wc, input)])),
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
        "-m dflash_pipeline.train --probe {input.probe:q} --target {params.target:q} "
        f"--target-dtype {config['target']['dtype']} --device {config['train']['device']} "
        f"{'--trust-remote-code ' if config['target']['trust_remote_code'] else ''}"
        "--out-dir {params.run_dir:q} --train-config {params.train:q} {params.baseline} --drafter-arch {params.arch:q} {input.tokens:q} "
        "2>&1 | python -m dflash_pipeline.workflow tee {log:q}"  # the log, and [train] lines on the console
