"""The features stage: target features for training, extracted once, stored in feature shards.

`extract_features` (rules/features.smk) writes one feature shard per token shard with a backend:
`vllm` (the serving engine's `extract_hidden_states` method: targets larger than one GPU, e.g. Kimi K2.6
with TP8) or `hf` (transformers, `device_map` across the job's GPUs; the CPU default). With
`train.target_features: shards` the trainer reads them memory-mapped and never loads the target
(only its embedding, LM head and, for `kl`, final norm: `.weights`).

Modules: `.format` (file format, writer, reader), `.extract` (one shard, resumable),
`.hf_backend`, `.vllm_backend` + `.vllm_connector` (engine side), `.plan` (disk
arithmetic at plan time), `.weights` (embedding / LM head from the target's safetensors).
Streaming (`train.target_features: stream`): `.server` (the hf feature server, vLLM's request
contract), `.stream_client` (`FeatureClient` over the completions fleet), `.colocate`
(servers started beside the trainer).
CLI: `python -m dflash_pipeline.features extract|extract-many|serve|colocate ...` (what the rules run, in
the backend's environment); `.extract_stream`: shards through the stream client, one server set per job.

This package imports only numpy at the top (torch, transformers, vllm inside the functions that need them),
so it loads in the vLLM venv, in the training env and in Snakemake's planning process.
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
