# Helpers of the features stage (rules/features.smk includes this file; kept out of common.smk).
import json
import shlex
import sys

FEATURES = config["features"]
FEATURES_FROM_SHARDS = config["train"]["target_features"] == "shards"
FEATURES_STREAM = config["train"]["target_features"] == "stream"


def feature_shard():
    """Path of one feature shard (safetensors + offsets index; format in dflash_pipeline.features.format)."""
    path = f"{RESULTS}/features/{{dataset}}/{{shard}}.safetensors"
    return path if FEATURES["keep"] else temp(path)


def all_feature_shards(wildcards):
    """Feature shards of every token shard (same order as get_token_shards)."""
    return [f"{RESULTS}/features/{d}/{s}.safetensors" for d, s in get_shard_list(wildcards)]


def train_feature_shards(wildcards):
    """`train_drafter` input: the feature shards with target_features: shards, none online."""
    return all_feature_shards(wildcards) if FEATURES_FROM_SHARDS else []


def train_feature_flags(wildcards, input):
    """`--feature-shard F` per feature shard (train.py), `--stream-config JSON` with target_features: stream
    (the launcher starts colocated servers from it: dflash_pipeline.features.colocate), "" online."""
    if FEATURES_STREAM:
        return f"--stream-config {shlex.quote(json.dumps(stream_job_config(wildcards.run), sort_keys=True))}"
    files = input.features
    files = [files] if isinstance(files, str) else list(files)  # one input file comes as a plain str
    return " ".join(f"--feature-shard {shlex.quote(str(f))}" for f in files)


#: The generation.* fleet knobs the stream client reuses (dflash_pipeline.features.stream_client).
STREAM_FLEET_KEYS = ("request_timeout_s", "endpoint_max_failures", "endpoint_reprobe_s", "retry_backoff_s",
                     "retry_backoff_max_s", "circuit_breaker_failures")


def stream_job_config(run):
    """The stream settings the train job reads (train.target_features: stream): features.stream, the
    features dtype / last_hidden, the generation fleet knobs, the scratch dir (default
    <results>/stream_scratch/<run>), the longest record (tokens.max_length) and the vLLM environment."""
    st = dict(FEATURES["stream"])
    st["scratch_dir"] = st["scratch_dir"] or f"{RESULTS}/stream_scratch/{run}"
    st.update(dtype=FEATURES["dtype"], last_hidden=FEATURES["last_hidden"], max_len=config["tokens"]["max_length"],
              fleet={k: config["generation"][k] for k in STREAM_FLEET_KEYS})
    if st["backend"] == "vllm" and not st["endpoints"]:
        from dflash_pipeline.core.vllm_env import require_vllm_python

        st["vllm"] = {"python": require_vllm_python(FEATURES["vllm"]["python"]),
                      **{k: FEATURES["vllm"][k] for k in ("expert_parallel", "engine_args")}}
    return st


def stream_plan():
    """The `[plan] stream:` line: servers x GPUs (or the endpoints), trainer ranks, the window against the
    scratch filesystem's free space; fails the plan when the window does not fit (disk need = the window,
    never the dataset)."""
    import shutil

    from dflash_pipeline.features.plan import human, window_bytes
    
    st = stream_job_config(RUN_NAME)
    k, h = feature_dims()
    wire = (k + int(st["last_hidden"])) * h * st["wire_bytes_per_value"]
    tr = config["train"]
    window = window_bytes(st["prefetch_batches"], tr["batch_size"], config["tokens"]["max_length"], wire,
                          st["max_inflight_bytes"])
    scratch = Path(st["scratch_dir"])
    probe_dir = next(p for p in [scratch, *scratch.parents] if p.exists())
    free = shutil.disk_usage(probe_dir).free
    ranks = tr["num_processes"] * (tr.get("num_machines") or 1)
    if st["endpoints"]:
        servers = f"{len(st['endpoints'])} remote endpoint(s) ({', '.join(e['base_url'] for e in st['endpoints'])})"
    else:
        servers = f"{st['servers']} colocated {st['backend']} server(s) x {st['gpus_per_server']} GPU(s)"
    print(f"[plan] stream: {servers}; {ranks} trainer rank(s); window {human(window)} per rank "
          f"({st['prefetch_batches']} batches x {tr['batch_size']} x {config['tokens']['max_length']} tokens x "
          f"{wire:,} B, cap {human(st['max_inflight_bytes'])}) against {human(free)} free on the scratch filesystem "
          f"({scratch}); no feature shards",
          file=sys.stderr)
    if window * ranks > free:
        raise WorkflowError(f"features.stream: the window needs {human(window * ranks)} on the scratch filesystem "
                            f"({scratch}) but only {human(free)} is free; lower features.stream.prefetch_batches / "
                            "max_inflight_bytes or point features.stream.scratch_dir elsewhere")


def train_params():
    """`config["train"]` for the train rule's params, without `device` (where, not what: `--device`) and
    without `target_features` when it is `online` (the key's default: runs trained before the key existed
    keep their params, so they are not retrained)."""
    return {k: v for k, v in config["train"].items()
            if k != "device" and not (k == "target_features" and v == "online")}


def features_python():
    """Interpreter that runs the extraction: the vLLM environment's for backend vllm, else the job's own
    `python`. A missing vLLM environment is reported before this runs, with every other config problem
    (dflash_pipeline.core.config.training_problems)."""
    if FEATURES["backend"] != "vllm":
        return "python"
    from dflash_pipeline.core.vllm_env import require_vllm_python

    return require_vllm_python(FEATURES["vllm"]["python"])


def features_job_config():
    """The `features` settings the extraction job reads (a rerun trigger: operational keys keep/
    min_free_fraction/vllm.python are left out)."""
    cfg = {k: FEATURES[k] for k in ("backend", "dtype", "last_hidden", "chunk_tokens")}
    cfg["vllm"] = {k: FEATURES["vllm"][k] for k in ("expert_parallel", "engine_args")}
    return canonical(cfg)


def feature_dims():
    """(K, H) of the features: from the probe record when it exists, else the config and target config."""
    probe = Path(probe_json())
    if probe.is_file():
        rec = json.loads(probe.read_text())
        return len(rec["drafter"]["target_layer_ids"]), rec["hidden_size"]
    d = config["drafter"]
    k = len(d["target_layer_ids"]) if d["target_layer_ids"] else (d["num_target_features"] or d["num_draft_layers"])
    if config["target"]["path"] == "demo":
        return k, config["target"]["demo"]["hidden_size"]
    from dflash_pipeline.probe import _find_text_config

    raw = json.loads((Path(config["target"]["path"]) / "config.json").read_text())
    text = _find_text_config(raw)[1]
    return k, next(text[a] for a in ("hidden_size", "n_embd", "d_model", "dim") if text.get(a) is not None)


def check_feature_disk():
    """State feature bytes per token and in total at plan time; fail when the results filesystem lacks them."""
    from dflash_pipeline.features.plan import plan_features, prompt_counts_from_manifest
    from dflash_pipeline.prompts import list_shards

    manifest = Path(prompts_manifest())
    shards = list_shards(manifest) if manifest.is_file() else None
    counts = prompt_counts_from_manifest(manifest) if manifest.is_file() else None
    k, h = feature_dims()
    plan = plan_features(num_layers=k, hidden_size=h, dtype=FEATURES["dtype"], last_hidden=FEATURES["last_hidden"],
                         results_dir=RESULTS, shards=shards, max_length=config["tokens"]["max_length"], prompt_counts=counts)
    print(f"[plan] {plan.describe()}" + ("" if FEATURES["keep"] else " (deleted after training: features.keep false)"),
          file=sys.stderr)
    why = plan.shortfall(FEATURES["min_free_fraction"])
    if why:
        raise WorkflowError(f"features: {why}")


if FEATURES_FROM_SHARDS:
    features_python()  # no vLLM environment: fail at plan time, not in the job
    check_feature_disk()
if FEATURES_STREAM:
    stream_plan()
