rule train_drafter:
    """Train the DFlash drafter with `accelerate launch` (target frozen; its features online or from feature shards).

    Resumes from results/checkpoints/{run}/state/ after a kill; writes final/ atomically.
    """
    input:
        probe=probe_json(),
        target=target_input(),
        tokens=all_token_shards,
        features=train_feature_shards,
    output:
        directory(f"{R}/checkpoints/{{run}}/final"),
    params:
        target=target_dir_of_input,
        run_dir=lambda wc: checkpoint_dir(wc.run),
        train=as_json(train_params()),
        arch=as_json({k: config["drafter"][k] for k in ("layer_types", "sliding_window")}),
        launch=" ".join(accelerate_launch_args()),
        # + `--feature-shard F` per feature shard with train.target_features: shards (rules/features.smk); in
        # one param and the online default left out of `train`, so an online run's params are unchanged
        baseline=lambda wc, input: " ".join(filter(None, [baseline_train_flags(wc.run), train_feature_flags(wc, input)])),
    log:
        f"{R}/logs/train_drafter/{{run}}.log",
    benchmark:
        f"{R}/benchmarks/train_drafter/{{run}}.tsv"
    threads: workflow.cores
    resources:
        gpu=gpus("train_drafter"),
    conda:
        "../envs/torch.yaml"
    shell:
        "OMP_NUM_THREADS={threads} python -m dflash_pipeline.workflow gpus {resources.gpu} -- "
        "python -m accelerate.commands.launch {params.launch} "
        "-m dflash_pipeline.train --probe {input.probe:q} --target {params.target:q} "
        "--out-dir {params.run_dir:q} --train-config {params.train:q} {params.baseline} --drafter-arch {params.arch:q} {input.tokens:q} > {log:q} 2>&1"
