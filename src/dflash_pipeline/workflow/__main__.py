"""`python -m dflash_pipeline.workflow gpus|launch|tee ...` (the rules' job wrappers)."""

import sys

from dflash_pipeline.workflow.policy import run_with_gpus

if __name__ == "__main__":
    sys.exit(run_with_gpus())
