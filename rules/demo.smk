if not DEMO_SHIPPED:  # the default settings' target is committed (data/demo-target): nothing builds it

    rule build_demo_target:
        """Tiny Qwen3 target + BPE tokenizer + Qwen3-style chat template, briefly trained on bundled data; in a
        directory keyed by its `target.demo` settings (DEMO_TARGET, rules/common.smk)."""
        input:
            corpus=demo_corpus(),
        output:
            directory(DEMO_TARGET),
        params:
            demo=canonical(config["target"]["demo"]),
        log:
            f"logs/build_demo_target{DEMO_TAG}.log",
        benchmark:
            f"benchmarks/build_demo_target{DEMO_TAG}.tsv"
        threads: workflow.cores
        conda:
            "../envs/torch.yaml"
        script:
            "../scripts/build_demo_target.py"
