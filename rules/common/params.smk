# Params: what a job takes from the config. Snakemake reruns a job when one of its params' repr changes,
# so every value here is canonical (sorted keys) and carries only what changes the output; the policy is
# in dflash_pipeline.workflow.policy (tests/unit/test_workflow.py pins it).
import json
import shlex

from dflash_pipeline.workflow import policy as wf
from dflash_pipeline.workflow.policy import as_json, canonical
from dflash_pipeline.drafter import families as drafter_families


def generation_output_params():
    """The output-affecting subset of `generation` (the generate_completions rerun trigger)."""
    return wf.generation_output_params(config["generation"])


def tokenization_code():
    """Revision of the token-shard bytes (a `params` of tokenize_completions; see
    dflash_pipeline.workflow.policy.TOKENIZATION_REVISION)."""
    return wf.TOKENIZATION_REVISION


def baseline_runs(run=RUN_NAME):
    """Label -> run name of each configured baseline drafter, e.g. {"zero_features": "demo.zero_features"}."""
    return wf.baseline_runs(run, config["eval"]["baselines"])


def gpus(rule):
    """The `gpu` resource of one job of `rule` (0 on CPU runs; see dflash_pipeline.workflow.policy.job_gpus)."""
    return wf.job_gpus(config, rule)


def srun_prefix():
    """`srun --ntasks-per-node=1 …` before the launcher when the run spans several machines (one
    `workflow launch` per node resolves its rank there), else ''."""
    n = config["train"]["num_machines"]
    return "srun --ntasks-per-node=1 --kill-on-bad-exit=1 " if n is not None and n > 1 else ""


def target_dir_of_input(wildcards, input):
    """`params.target` derived from the rule's `target` input (the demo dir, or the dir of config.json),
    so the path travels with the input (Snakemake lint: no hard-coded input prefixes in params)."""
    return wf.target_dir_of(str(input.target))


def prompts_dir_of_output(wildcards, output):
    """Directory of the prompt shards: the one holding the manifest."""
    return str(Path(output.manifest).parent)


def prompt_filter_target_dir(wildcards, input):
    """`params.target` of the prompts checkpoint: the target dir when it is an input, else None."""
    return target_dir_of_input(wildcards, input) if input.target else None


def run_dir_of(wildcards):
    """`params.run_dir` of train_drafter: the run's checkpoint directory (final/, state/, step_*/)."""
    return checkpoint_dir(wildcards.run)


def baseline_flags_of(wildcards):
    """`params.baseline` of train_drafter: the extra train.py flags of a baseline run, "" otherwise."""
    return wf.baseline_train_flags(wildcards.run)


def baseline_labels_of(wildcards):
    """`params.baseline_labels`: the labels of the baselines evaluated beside `wildcards.run`."""
    return list(baseline_runs(wildcards.run))


def train_params():
    """`config["train"]` for the train rule's params, without `device` (where, not what: `--device`) and
    without `target_features` when it is `online` (the key's default: runs trained before the key existed
    keep their params, so they are not retrained)."""
    train = drafter_families.train_params(config["train"], config["drafter"]["family"])  # family keys: non-default only
    return {k: v for k, v in wf.without_new_defaults("train", train).items()
            if k != "device" and not (k == "target_features" and v == "online")}


def train_arch():
    """`params.arch` of train_drafter: the optional sliding-window draft layers (drafter.layer_types/sliding_window)."""
    return drafter_families.arch_params(config["drafter"])  # + family and its section when not dflash


def train_feature_flags(wildcards, input):
    """`--feature-shard F` per feature shard (train.target_features: shards), `--stream-config JSON` with
    target_features: stream (the launcher starts colocated servers from it: dflash_pipeline.features.colocate),
    "" online."""
    if FEATURES_STREAM:
        return f"--stream-config {shlex.quote(json.dumps(stream_job_config(wildcards.run), sort_keys=True))}"
    files = input.features
    files = [files] if isinstance(files, str) else list(files)  # one input file comes as a plain str
    return " ".join(f"--feature-shard {shlex.quote(str(f))}" for f in files)


def train_extra_flags(wildcards, input):
    """`params.baseline` of train_drafter: a baseline run's flags, then `--feature-shard F` per feature shard;
    one param, and empty for an online run of the main drafter, so such a run's params are unchanged."""
    return " ".join(filter(None, [baseline_flags_of(wildcards), train_feature_flags(wildcards, input)]))


def trust_remote_code_flag():
    """`--trust-remote-code` when target.trust_remote_code, else "" (the shell rules' flag)."""
    return "--trust-remote-code" if config["target"]["trust_remote_code"] else ""


def features_python():
    """Interpreter that runs the extraction: the vLLM environment's for backend vllm, else the job's own
    `python`. A missing vLLM environment is reported before this runs, with every other config problem
    (dflash_pipeline.workflow.problems.training_problems)."""
    if FEATURES["backend"] != "vllm":
        return "python"
    from dflash_pipeline.core.vllm_env import require_vllm_python

    return require_vllm_python(FEATURES["vllm"]["python"])


def features_python_of(wildcards):
    """`params.python` of extract_features (:func:`features_python`), resolved when the job runs."""
    return features_python()


def features_last_hidden():
    """features.last_hidden, or true when train.loss reads the teacher (kl, dspark_tv): shards and servers
    then carry the last decoder layer's output (the trainer applies the target's final norm)."""
    return bool(FEATURES["last_hidden"]) or config["train"]["loss"] in ("kl", "dspark_tv")


def features_job_config():
    """The `features` settings the extraction job reads (a rerun trigger: operational keys keep/
    min_free_fraction/vllm.python are left out)."""
    cfg = {k: FEATURES[k] for k in ("backend", "dtype", "last_hidden", "chunk_tokens")}
    cfg["last_hidden"] = features_last_hidden()
    cfg["vllm"] = {k: FEATURES["vllm"][k] for k in ("expert_parallel", "engine_args")}
    return canonical(cfg)


def stream_job_config(run):
    """The stream settings the train job reads (train.target_features: stream): features.stream, the
    features dtype / last_hidden, the generation fleet knobs, the scratch dir (default
    <results>/stream_scratch/<run>), the longest record (tokens.max_length) and the vLLM environment."""
    from dflash_pipeline.features.stream_client import FLEET_KEYS  # the knobs the stream client's fleet reuses

    st = dict(FEATURES["stream"])
    if st["cache"] == "none":  # the defaults stay out of the params (no rerun of existing stream runs)
        for k in ("cache", "cache_max_bytes", "cache_dir"):
            st.pop(k)
    st["scratch_dir"] = st["scratch_dir"] or f"{RESULTS}/stream_scratch/{run}"
    st.update(dtype=FEATURES["dtype"], last_hidden=features_last_hidden(), max_len=config["tokens"]["max_length"],
              fleet={k: config["generation"][k] for k in FLEET_KEYS})
    if st["backend"] == "vllm" and not st["endpoints"]:
        from dflash_pipeline.core.vllm_env import require_vllm_python

        st["vllm"] = {"python": require_vllm_python(FEATURES["vllm"]["python"]),
                      **{k: FEATURES["vllm"][k] for k in ("expert_parallel", "engine_args")}}
    return st
