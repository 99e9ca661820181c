from pathlib import Path

from dflash_pipeline.evaluate.acceptance import plot_training, plot_validation
from dflash_pipeline.workflow.policy import log_to

with log_to(snakemake.log[0], snakemake.threads):
    runs = {
        "trained": snakemake.input.drafter,
        **{b: getattr(snakemake.input, b) for b in snakemake.params.baseline_labels},
    }
    plot_training(
        {label: Path(final).parent / "train_log.jsonl" for label, final in runs.items()}, snakemake.output.curves
    )
    plot_validation(
        Path(snakemake.input.drafter).parent / "val_log.jsonl", snakemake.output.validation, placeholder=True
    )
