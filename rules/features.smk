# The features stage (train.target_features: shards): one feature shard per token shard, then training
# reads them instead of running the target (README "Targets larger than one GPU").


include: "features_helpers.smk"


rule extract_features:
    """Target features of one token shard (K layers at target_layer_ids per token) with the configured
    backend; resumes a killed job (finished records kept in the hidden .partial file), written atomically."""
    input:
        tokens=token_shard(),
        probe=probe_json(),
        target=target_input(),
    output:
        features=feature_shard(),
    params:
        target=target_dir_of_input,
        features=as_json(features_job_config()),
        python=lambda wc: features_python(),
        target_dtype=config["target"]["dtype"],
        trust="--trust-remote-code" if config["target"]["trust_remote_code"] else "",
    log:
        log_file("extract_features", "{dataset}", "{shard}"),
    benchmark:
        benchmark_file("extract_features", "{dataset}", "{shard}")
    threads: workflow.cores
    resources:
        gpu=gpus("extract_features"),
    conda:
        "../envs/torch.yaml"
    shell:
        "OMP_NUM_THREADS={threads} python -m dflash_pipeline.workflow gpus {resources.gpu} -- "
        "{params.python:q} -m dflash_pipeline.features extract --probe {input.probe:q} --target {params.target:q} "
        "--token-shard {input.tokens:q} --out {output.features:q} --features-config {params.features:q} "
        "--target-dtype {params.target_dtype} --gpus {resources.gpu} {params.trust} > {log:q} 2>&1"


rule clean_features:
    """`snakemake clean_features`: delete every feature shard (and partial extractions) of this results dir."""
    log:
        log_file("clean_features"),
    run:
        import shutil

        shutil.rmtree(f"{RESULTS}/features", ignore_errors=True)
        Path(log[0]).write_text(f"removed {RESULTS}/features\n")
