"""`features.backend: vllm`: target features from vLLM's offline `LLM` engine.

The engine runs the `extract_hidden_states` speculative method (aux layer ids = canonical
`target_layer_ids` + 1, plus `num_hidden_layers` for the last layer's pre-norm output) with a
hidden-states KV connector that writes one safetensors file per request (`hidden_states` [T, n_aux, H],
`token_ids` [T]) into a scratch directory: vLLM's `ExampleHiddenStatesConnector` on GPUs, our
`CPUHiddenStatesConnector` on CPU. Tensor parallel over the job's GPUs, prefix caching off (a cached
prefix's hidden states would be missing), prompts as token ids. Runs in the vLLM environment.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np


def hidden_states_engine_config(aux: Sequence[int], scratch: str | os.PathLike, cuda: bool) -> tuple[dict, dict]:
    """vLLM's `(speculative_config, kv_transfer_config)` for extracting hidden states: the `extract_hidden_states`
    method on the HF hidden-state indices `aux` (ints), and the connector that writes them under `scratch`. Pure; raises
    nothing."""
    connector = (
        {"kv_connector": "ExampleHiddenStatesConnector"}
        if cuda
        else {
            "kv_connector": "CPUHiddenStatesConnector",
            "kv_connector_module_path": "dflash_pipeline.features.vllm_connector",
        }
    )
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(aux)}},
    }
    kv = {
        **connector,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(scratch)},
    }
    return spec, kv


class VLLMExtractor:
    """Yields `(record, features [T, K*H], last_hidden [T, H] | None)` for token-id prompts.

    `options` (config `features.vllm`): `expert_parallel` (bool) and `engine_args`.

    Raises:
        ValueError: the engine returned token ids that differ from the record's (names the record).
    """

    def __init__(
        self,
        target_dir,
        layer_ids: Sequence[int],
        *,
        num_hidden_layers: int,
        last_hidden: bool = False,
        gpus: int = 0,
        target_dtype: str = "auto",
        trust_remote_code: bool = False,
        max_len: int = 1024,
        options: dict | None = None,
        scratch_dir: Path | None = None,
        **_ignored,
    ):
        import torch

        from dflash_pipeline.target.layer_ids import hf_hidden_state_index

        options = dict(options or {})
        cuda = gpus > 0 and torch.cuda.is_available()
        if not cuda:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; otherwise sized from all memory
        from vllm import LLM

        self.aux = [hf_hidden_state_index(l) for l in layer_ids]
        self.k = len(self.aux)
        self.last_hidden = last_hidden
        aux = self.aux + ([num_hidden_layers] if last_hidden else [])
        self.scratch = Path(scratch_dir or "vllm-hidden-states").resolve()
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.scratch.mkdir(parents=True)
        from dflash_pipeline.target.loading import resolve_dtype

        dtype = str(resolve_dtype(target_dtype, "cuda" if cuda else "cpu")).removeprefix("torch.")
        max_model_len = int(max_len) + 8
        args = dict(
            model=str(target_dir),
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            skip_tokenizer_init=True,
            tensor_parallel_size=max(1, gpus) if cuda else 1,
            enable_expert_parallel=bool(options.get("expert_parallel", False)),
            enable_prefix_caching=False,
            max_model_len=max_model_len,
            max_num_batched_tokens=max(max_model_len, 2048),
            enforce_eager=not cuda,
        )
        args["speculative_config"], args["kv_transfer_config"] = hidden_states_engine_config(aux, self.scratch, cuda)
        args.update(options.get("engine_args") or {})
        self.llm = LLM(**args)
        self.engine_version = __import__("vllm").__version__

    def run(self, records: Sequence[int], token_ids: Sequence[np.ndarray]) -> Iterator[tuple]:
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        prompts = [{"prompt_token_ids": [int(t) for t in ids]} for ids in token_ids]
        outs = self.llm.generate(
            prompts, SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False
        )
        for r, ids, o in zip(records, token_ids, outs):
            path = (o.kv_transfer_params or {}).get("hidden_states_path")
            if not path:
                raise ValueError(
                    f"record {r}: the engine returned no hidden_states_path (kv_transfer_params={o.kv_transfer_params})"
                )
            data = load_hidden_states(path)  # waits on the file's .lock until the connector has written it
            cleanup_hidden_states(path)
            got = data["token_ids"].numpy()
            if not np.array_equal(got.astype(np.int64), np.asarray(ids, dtype=np.int64)):
                raise ValueError(
                    f"record {r}: the engine's token_ids ({len(got)}) differ from the token shard's ({len(ids)})"
                )
            hs = data["hidden_states"]  # [T, n_aux, H]
            feats = hs[:, : self.k].reshape(hs.shape[0], -1)
            yield r, feats, (hs[:, self.k] if self.last_hidden else None)

    def close(self) -> None:
        import gc

        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort; process exit ends it anyway
            pass
        self.llm = None
        gc.collect()
        shutil.rmtree(self.scratch, ignore_errors=True)
