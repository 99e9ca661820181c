"""`features.backend: hf`: target features from transformers (`output_hidden_states`).

One record per forward pass (no padding, so a record's features do not depend on its batch and a resumed shard equals an
uninterrupted one). With `gpus > 0` the layers are spread over the job's devices with `device_map="auto"`; on CPU the
target runs in float32 unless `target_dtype` says otherwise.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np


class HFExtractor:
    """Runs the target with transformers and yields `(record, features [T, K*H], last_hidden [T, H] | None)`.

    `last_hidden` is the output of the last decoder layer before the final norm (a forward hook on it:
    HF's last `hidden_states` entry is already normed).
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
        **_ignored,
    ):
        import torch

        from dflash_pipeline.target.layer_ids import hf_hidden_state_index
        from dflash_pipeline.target.loading import load_target

        cuda = gpus > 0 and torch.cuda.is_available()
        # the one target loader (nested text_config families, dtype policy); layers spread over the job's GPUs
        self.model = load_target(
            target_dir,
            dtype=target_dtype,
            device="cuda" if cuda else "cpu",
            trust_remote_code=trust_remote_code,
            device_map="auto" if cuda else None,
        )
        self.device = next(self.model.parameters()).device
        self.index = [hf_hidden_state_index(l) for l in layer_ids]
        self._last = None
        self._hook = None
        if last_hidden:
            layers = self.model.get_decoder().layers
            if len(layers) != num_hidden_layers:
                raise ValueError(f"{target_dir}: {len(layers)} decoder layers, probe says {num_hidden_layers}")

            def grab(_mod, _inp, out):
                self._last = out[0] if isinstance(out, tuple) else out

            self._hook = layers[-1].register_forward_hook(grab)

    def run(self, records: Sequence[int], token_ids: Sequence[np.ndarray]) -> Iterator[tuple]:
        import torch

        from dflash_pipeline.target.loading import hidden_states_of

        with torch.inference_mode():
            for r, ids in zip(records, token_ids):
                x = torch.from_numpy(np.asarray(ids, dtype=np.int64))[None].to(self.device)
                out = hidden_states_of(self.model, x, use_cache=False)  # no full-vocabulary logits (logits_to_keep)
                feats = torch.cat([out.hidden_states[i][0].to("cpu") for i in self.index], dim=-1)
                last = self._last[0].to("cpu") if self._hook is not None else None
                yield r, feats, last

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        self.model = None
