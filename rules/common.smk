# What every rule file shares: the config-derived roots, the wildcard constraints, and the named helpers
# rules call (never lambdas or string concatenation of paths), one file per kind:
#   common/paths.smk   pattern builders: where each stage writes (`{RESULTS}/<stage>/...`)
#   common/inputs.smk  input functions `get_*(wildcards)`: evaluated per job, after the prompts checkpoint
#   common/params.smk  params: what a job reads from the config, and so what reruns it (the rerun policy
#                      itself lives in dflash_pipeline.workflow.policy, with unit tests)
from pathlib import Path

RESULTS = config["results_dir"]
RUN_NAME = config["run"]
# the demo target's directory names its settings (other settings: resources/demo-target-<digest>), and the
# probe record is per run: two configs in one checkout never rebuild each other's (workflow.keyed_paths)
from dflash_pipeline.workflow import keyed_paths


def default_demo_settings():
    """`target.demo` of the embedded default config (config/config.yaml), schema defaults filled: its demo
    target keeps the path of earlier releases, resources/demo-target."""
    import yaml
    from dflash_pipeline.core.config import schema_defaults

    with open(Path(workflow.basedir) / "config" / "config.yaml", encoding="utf-8") as fh:
        embedded = yaml.safe_load(fh) or {}
    return {**schema_defaults("target", "demo"), **((embedded.get("target") or {}).get("demo") or {})}


DEMO_TARGET = keyed_paths.demo_target_dir(config["target"]["demo"], default_demo_settings())
DEMO_TAG = (
    "" if DEMO_TARGET == keyed_paths.DEMO_TARGET_DIR else "-" + keyed_paths.params_digest(config["target"]["demo"])
)


wildcard_constraints:
    dataset=r"[A-Za-z0-9_-]+",
    shard=r"\d{5}",
    run=r"[A-Za-z0-9_.-]+",


include: "common/paths.smk"
include: "common/inputs.smk"
include: "common/params.smk"
