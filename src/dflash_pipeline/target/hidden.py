"""The target's hidden states as the drafter consumes them: the tapped layers, concatenated."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from dflash_pipeline.target import loading as T


def target_features(
    target, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], layer_ids: Sequence[int], **kw
):
    """Run the frozen target and concatenate the outputs of decoder layers `layer_ids`.

    Uses `probe.hf_hidden_state_index`. Returns `(features [b, S, K·H] in the target dtype, model output)`.
    """
    out = T.hidden_states_of(target, input_ids, attention_mask, **kw)
    return T.select_layers(out.hidden_states, layer_ids), out
