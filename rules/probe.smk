# A target the probe would refuse stops the run while it is planned, before any job (completions do not wait
# for the probe job: its record is not their input). Checked until the probe record accepts this config.json.
from dflash_pipeline.workflow.problems import probe_gate_problems

target_refusals = probe_gate_problems(config, probe_json())
if target_refusals:
    raise WorkflowError("target refused:\n  - " + "\n  - ".join(target_refusals))


rule probe_target:
    """Normalized config probe of the target + the drafter decisions (DESIGN.md §2)."""
    input:
        target=target_input(),
    output:
        probe_json(),
    params:
        target=target_dir_of_input,
        drafter=canonical(drafter_families.probe_params(config["drafter"])),  # the family keys do not change the probe
        trust_remote_code=config["target"]["trust_remote_code"],
        chat_template=config["target"]["chat_template"],
    log:
        log_file("probe_target", RUN_NAME),  # per run, as its record
    conda:
        "../envs/probe.yaml"
    script:
        "../scripts/probe_target.py"
