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
