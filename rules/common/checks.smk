# Plan-time checks of a stage that read files (they run while Snakemake parses, before any job): the features
# stage's disk check. Called from the stage's rule file when the stage is on.
import sys


def feature_dims():
    """(K, H) of the features: from the probe record when it exists, else as the probe will decide them
    (dflash_pipeline.probe.target_feature_count, text_hidden_size; the demo target's configured size)."""
    from dflash_pipeline.probe import target_feature_count, text_hidden_size

    probe = Path(probe_json())
    if probe.is_file():
        import json

        rec = json.loads(probe.read_text())
        return len(rec["drafter"]["target_layer_ids"]), rec["hidden_size"]
    k = target_feature_count(config["drafter"])
    if config["target"]["path"] == "demo":
        return k, config["target"]["demo"]["hidden_size"]
    return k, text_hidden_size(config["target"]["path"])


def check_feature_disk():
    """State feature bytes per token and in total at plan time; fail when the results filesystem lacks them."""
    from dflash_pipeline.features.plan import plan_features, prompt_counts_from_manifest
    from dflash_pipeline.prompts import list_shards

    manifest = Path(prompts_manifest())
    shards = list_shards(manifest) if manifest.is_file() else None
    counts = prompt_counts_from_manifest(manifest) if manifest.is_file() else None
    k, h = feature_dims()
    plan = plan_features(num_layers=k, hidden_size=h, dtype=FEATURES["dtype"], last_hidden=features_last_hidden(),
                         results_dir=RESULTS, shards=shards, max_length=config["tokens"]["max_length"], prompt_counts=counts)
    print(f"[plan] {plan.describe()}" + ("" if FEATURES["keep"] else " (deleted after training: features.keep false)"),
          file=sys.stderr)
    why = plan.shortfall(FEATURES["min_free_fraction"])
    if why:
        raise WorkflowError(f"features: {why}")


def stream_plan():
    """The `[plan] stream:` line: servers x GPUs (or the endpoints), trainer ranks, the window against the
    scratch filesystem's free space; fails the plan when the window does not fit (disk need = the window,
    never the dataset)."""
    import shutil

    from dflash_pipeline.features.plan import human, scratch_problem, window_bytes

    st = stream_job_config(RUN_NAME)
    k, h = feature_dims()
    wire = (k + int(st["last_hidden"])) * h * st["wire_bytes_per_value"]
    tr = config["train"]
    window = window_bytes(st["prefetch_batches"], tr["batch_size"], config["tokens"]["max_length"], wire,
                          st["max_inflight_bytes"])
    scratch = Path(st["scratch_dir"])
    path_transport = not st["endpoints"] or any(e.get("transport", "path") == "path" for e in st["endpoints"])
    why = scratch_problem(scratch) if path_transport else None
    if why:
        raise WorkflowError(f"features.stream.scratch_dir: {why}; the feature servers write their answers there "
                            "(transport: path)")
    probe_dir = next(p for p in [scratch, *scratch.parents] if p.exists())
    free = shutil.disk_usage(probe_dir).free
    ranks = tr["num_processes"] * (tr.get("num_machines") or 1)
    if st["endpoints"]:
        from dflash_pipeline.core.errors import strip_url_credentials

        urls = ", ".join(strip_url_credentials(e["base_url"]) for e in st["endpoints"])
        servers = f"{len(st['endpoints'])} remote endpoint(s) ({urls})"
    else:
        servers = f"{st['servers']} colocated {st['backend']} server(s) x {st['gpus_per_server']} GPU(s)"
    print(f"[plan] stream: {servers}; {ranks} trainer rank(s); window {human(window)} per rank "
          f"({st['prefetch_batches']} batches x {tr['batch_size']} x {config['tokens']['max_length']} tokens x "
          f"{wire:,} B, cap {human(st['max_inflight_bytes'])}) "
          + (f"against {human(free)} free on the scratch filesystem ({scratch}"
             + ("; remote servers with transport path write there: it must be their --scratch-dir, seen from here"
                if st["endpoints"] else "") + ")"
             if path_transport else "in memory (transport bytes: no shared scratch)")
          + "; no feature shards",
          file=sys.stderr)
    if path_transport and window * ranks > free:
        raise WorkflowError(f"features.stream: the window needs {human(window * ranks)} on the scratch filesystem "
                            f"({scratch}) but only {human(free)} is free; lower features.stream.prefetch_batches / "
                            "max_inflight_bytes or point features.stream.scratch_dir elsewhere")


def device_memory_plan():
    """The `[plan] device memory:` line: the peak of one training step per trainer rank, planned on fake tensors
    by torch's memory tracker (dflash_pipeline.train.memory; cached per config under the user's cache dir), with
    what gradient checkpointing saves; fails the plan when it exceeds train.device_memory_gb, naming the knobs
    that help. Skipped in jobs (the main process planned it)."""
    if not workflow.is_main_process:
        return
    from dflash_pipeline.train.memory import over_budget, plan_cache_dir, plan_for_workflow

    k, _ = feature_dims()
    probe = Path(probe_json())
    block = (json.loads(probe.read_text())["drafter"]["block_size"] if probe.is_file()
             else config["drafter"]["block_size"])
    target = Path(wf.target_dir_of(target_input()))
    plan, other, line = plan_for_workflow(config, target_dir=target, num_target_features=k, block_size=block,
                                          cache_dir=plan_cache_dir())
    print(f"[plan] {line}", file=sys.stderr)
    why = over_budget(plan, config["train"]["device_memory_gb"], other) if plan is not None else None
    if why:
        raise WorkflowError(why)
