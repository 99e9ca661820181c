# The features stage (train.target_features: shards): one feature shard per token shard, then training
# reads them instead of running the target (README "Targets larger than one GPU"). Its paths, inputs and
# params are in common/ (feature_shard, get_train_feature_shards, features_job_config, ...), its plan-time
# check (the feature bytes the results filesystem must hold) in common/checks.smk, run below the rules.


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
        python=features_python_of,
        target_dtype=config["target"]["dtype"],
        trust=trust_remote_code_flag(),
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


# --- plan-time check (common/checks.smk) ---------------------------------------------------------


if FEATURES_FROM_SHARDS:
    features_python()  # no vLLM environment: fail at plan time, not in the job
    check_feature_disk()
if FEATURES_STREAM:
    stream_plan()  # the window against the scratch disk, never the dataset
