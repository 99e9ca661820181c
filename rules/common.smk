# What every rule file shares: the config-derived roots, the wildcard constraints, and the named helpers
# rules call (never lambdas or string concatenation of paths), one file per kind:
#   common/paths.smk   pattern builders: where each stage writes (`{RESULTS}/<stage>/...`)
#   common/inputs.smk  input functions `get_*(wildcards)`: evaluated per job, after the prompts checkpoint
#   common/params.smk  params: what a job reads from the config, and so what reruns it (the rerun policy
#                      itself lives in dflash_pipeline.workflow.policy, with unit tests)
#   common/checks.smk  plan-time checks that read files (the features stage's disk check)
RESULTS = config["results_dir"]
RUN_NAME = config["run"]
# the demo target's directory names its settings (other settings: resources/demo-target-<digest>), and the
# probe record is per run: two configs in one checkout never rebuild each other's (workflow.keyed_paths)
from dflash_pipeline.core.config import resolve_path
from dflash_pipeline.workflow import keyed_paths


DEMO = config["target"]["demo"]
# the committed demo target of the default settings (under -d elsewhere: the checkout's); no rule builds it
SHIPPED_DEMO_TARGET = resolve_path(keyed_paths.SHIPPED_DEMO_TARGET, workflow.basedir)
DEMO_TARGET = keyed_paths.demo_target_dir(
    DEMO, keyed_paths.embedded_demo_settings(workflow.basedir), shipped=SHIPPED_DEMO_TARGET
)
DEMO_SHIPPED = DEMO_TARGET == SHIPPED_DEMO_TARGET
# "" for resources/demo-target (and the shipped one), "-<digest>" else: the demo build's log and benchmark names
DEMO_TAG = "" if DEMO_TARGET == keyed_paths.DEMO_TARGET_DIR or DEMO_SHIPPED else f"-{keyed_paths.params_digest(DEMO)}"
FEATURES = config["features"]
FEATURES_FROM_SHARDS = config["train"]["target_features"] == "shards"  # the features stage runs (train reads shards)
FEATURES_STREAM = config["train"]["target_features"] == "stream"  # train streams features from servers


wildcard_constraints:
    dataset=r"[A-Za-z0-9_-]+",
    shard=r"\d{5}",
    run=r"[A-Za-z0-9_.-]+",


include: "common/paths.smk"
include: "common/inputs.smk"
include: "common/params.smk"
include: "common/checks.smk"
