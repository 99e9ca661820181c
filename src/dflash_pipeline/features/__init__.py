"""The features stage: target features for training, extracted once, stored in feature shards.

`extract_features` writes one feature shard per token shard with the `vllm` backend (the engine's
`extract_hidden_states`: targets larger than one GPU) or `hf` (transformers; the CPU default). With
`train.target_features: shards` the trainer reads them memory-mapped and never loads the target;
with `stream` it asks feature servers (`.server`, `.stream_client`, `.colocate`).
CLI: `python -m dflash_pipeline.features extract|extract-many|serve|colocate ...`. Only numpy is imported
at the top, so the package loads in the vLLM venv and at planning.
"""

from dflash_pipeline.core.faces import lazy_face

from .colocate import ENDPOINTS_ENV, colocated_servers
from .format import FeatureLayout, FeatureShard, FeatureShardError, FeatureShardWriter, bytes_per_token
from .plan import scratch_problem, window_bytes
from .stream_client import FLEET_KEYS, FeatureClient, Features, StreamError, fleet_config

#: Names of the face loaded on first use from the module that owns them (their modules import more).
_OWNERS = {"extract": "read_token_arrays", "weights": "load_embed_and_head load_final_norm"}

__getattr__, __dir__, _LAZY = lazy_face(__name__, _OWNERS, globals)

__all__ = [
    "ENDPOINTS_ENV",
    "FLEET_KEYS",
    "FeatureClient",
    "FeatureLayout",
    "FeatureShard",
    "FeatureShardError",
    "FeatureShardWriter",
    "Features",
    "StreamError",
    "bytes_per_token",
    "colocated_servers",
    "fleet_config",
    "scratch_problem",
    "window_bytes",
    *_LAZY,
]
