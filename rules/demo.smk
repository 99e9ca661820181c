rule build_demo_target:
    """Tiny Qwen3 target + BPE tokenizer + Qwen3-style chat template, briefly trained on bundled data."""
    input:
        corpus=demo_corpus(),
    output:
        directory(DEMO_TARGET),
    params:
        demo=canonical(config["target"]["demo"]),
    log:
        "logs/build_demo_target.log",
    benchmark:
        "benchmarks/build_demo_target.tsv"
    threads: workflow.cores
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/build_demo_target.py"
