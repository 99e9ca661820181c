"""The console: one-line progress of long jobs and each job's summary, shown on the stderr Snakemake
shows as well as in the job's log (the tee lives in `workflow.policy`)."""

import logging

#: Records of this logger reach the console (the stderr Snakemake shows) as well as the job's log file:
#: one-line progress of long jobs and each job's summary (`console`).
CONSOLE_LOGGER = "dflash_pipeline.console"

#: Output lines with these prefixes (printed by training, the eval and the engine eval) are echoed to the
#: console too.
CONSOLE_PREFIXES = ("[train]", "[eval]", "[eval-server]", "[eval-engine]")


def console(msg: str, *args) -> None:
    """Log one line for the console and the job log (inside `log_to`: both; elsewhere: logging)."""
    logging.getLogger(CONSOLE_LOGGER).info(msg, *args)
