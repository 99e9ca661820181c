rule train_drafter:
    """Train the DFlash drafter with `accelerate launch` (target frozen, online features).

    `workflow launch` resolves the machine count / rank / main address on the machine that runs it
    (train.num_machines, $DFLASH_MACHINE_RANK, or the SLURM allocation); with train.num_machines > 1 the
    rule starts one launcher per node with `srun --ntasks-per-node=1`.
    Resumes from results/checkpoints/{run}/state/ after a kill; writes final/ atomically.
    """
    input:
        probe=probe_json(),
        target=target_input(),
        tokens=all_token_shards,
    output:
        directory(f"{R}/checkpoints/{{run}}/final"),
    params:
        target=target_dir_of_input,
        run_dir=lambda wc: checkpoint_dir(wc.run),
        train=as_json({k: v for k, v in config["train"].items() if k != "device"}),  # where, not what: --device
        arch=as_json({k: config["drafter"][k] for k in ("layer_types", "sliding_window")}),
        srun=srun_prefix(),
        baseline=lambda wc: baseline_train_flags(wc.run),
    log:
        f"{R}/logs/train_drafter/{{run}}.log",
    benchmark:
        f"{R}/benchmarks/train_drafter/{{run}}.tsv"
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
        "--out-dir {params.run_dir:q} --train-config {params.train:q} {params.baseline} --drafter-arch {params.arch:q} {input.tokens:q} > {log:q} 2>&1"
