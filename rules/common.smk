# Small named helpers: paths of stage outputs, lists of targets, wildcard constraints.
import json
from pathlib import Path

R = config["results_dir"]
RUN = config["run"]
DEMO_TARGET = "resources/demo-target"


wildcard_constraints:
    dataset=r"[A-Za-z0-9_-]+",
    shard=r"\d{5}",
    run=r"[A-Za-z0-9_.-]+",


def target_dir():
    """The target model directory (the demo target is built by the workflow)."""
    path = config["target"]["path"]
    return DEMO_TARGET if path == "demo" else path


def target_input():
    """What rules that read the target depend on: the demo dir, or the real target's config.json."""
    path = config["target"]["path"]
    return DEMO_TARGET if path == "demo" else str(Path(path) / "config.json")


def probe_json():
    return f"{R}/probe/target.json"


def prompts_manifest():
    return f"{R}/prompts/manifest.json"


def prompt_shard():
    return f"{R}/prompts/{{dataset}}/{{shard}}.parquet"


def completion_shard():
    return f"{R}/completions/{{dataset}}/{{shard}}.parquet"


def token_shard():
    return f"{R}/tokens/{{dataset}}/{{shard}}.parquet"


def dataset_inputs():
    return [d["path"] for d in config["datasets"].values()]


def shard_list(wildcards):
    """(dataset, shard) pairs written by the prompts checkpoint."""
    from dflash_pipeline.prompts import list_shards

    return list_shards(checkpoints.shard_prompts.get().output.manifest)


def all_token_shards(wildcards):
    return [f"{R}/tokens/{d}/{s}.parquet" for d, s in shard_list(wildcards)]


def checkpoint_dir(run=RUN):
    return f"{R}/checkpoints/{run}"


def eval_json(run=RUN):
    return f"{R}/eval/{run}/acceptance.json"


def final_targets():
    return [f"{checkpoint_dir()}/final", eval_json()]


def as_json(obj):
    return json.dumps(obj, sort_keys=True)


def accelerate_launch_args():
    from dflash_pipeline.workflow import accelerate_launch_args as args

    return args(config["train"]["num_processes"], config["train"]["mixed_precision"])
