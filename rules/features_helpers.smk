# Helpers of the features stage (rules/features.smk includes this file; kept out of common.smk).
import json
import shlex
import sys

FEATURES = config["features"]
FEATURES_FROM_SHARDS = config["train"]["target_features"] == "shards"


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
    """`--feature-shard F` per feature shard (train.py), "" online."""
    files = input.features
    files = [files] if isinstance(files, str) else list(files)  # one input file comes as a plain str
    return " ".join(f"--feature-shard {shlex.quote(str(f))}" for f in files)


def train_params():
    """`config["train"]` for the train rule's params, without `device` (where, not what: `--device`) and
    without `target_features` when it is `online` (the key's default: runs trained before the key existed
    keep their params, so they are not retrained)."""
    train = drafter_families.train_params(config["train"], config["drafter"]["family"])  # family-only keys: non-default families
    return {k: v for k, v in train.items()
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
