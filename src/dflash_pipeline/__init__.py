"""dflash-pipeline: build a servable DFlash drafter from a target LLM, prompt datasets and endpoints.

Stages (data flows one way; docs/reference/layout.md): `demo` -> `probe` -> `prompts` -> `completions` ->
`tokens` -> [`features`] -> `train` -> `evaluate` -> `report`. The drafter is `drafter.model`; record
schemas are in `core.contracts`.
"""

__version__ = "0.1.0"
