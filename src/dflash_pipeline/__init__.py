"""dflash-pipeline: build a servable DFlash drafter from a target LLM, prompt datasets and endpoints.

Stages (a module or package each, data flows one way; README "Layout" maps them to rules, contracts, tests):
`demo` (tiny target) -> `probe` -> `prompts` -> `completions` -> `tokens` -> [`features`] ->
`train` -> `evaluate` (+ `evaluate_engine`) -> `report`.
The drafter itself lives in `dflash_pipeline.drafter.model`; record schemas in `dflash_pipeline.core.contracts`;
atomic shard I/O in `dflash_pipeline.core.shards`.
"""

__version__ = "0.1.0"
