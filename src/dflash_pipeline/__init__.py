"""dflash-pipeline: build a servable DFlash drafter from a target LLM, prompt datasets and endpoints.

Stages (one module each, data flows one way):
``demo`` (tiny target) -> ``probe`` -> ``prompts`` -> ``completions`` -> ``tokens`` -> ``train`` -> ``evaluate``.
The drafter itself lives in :mod:`dflash_pipeline.model`; record schemas in :mod:`dflash_pipeline.contracts`;
atomic shard I/O in :mod:`dflash_pipeline.shards`.
"""

__version__ = "0.1.0"
