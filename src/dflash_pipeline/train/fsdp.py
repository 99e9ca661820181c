"""FSDP2 (Accelerate `fsdp_version=2`) for drafters whose weights + Adam state do not fit one rank.

Under DDP every rank holds 16 bytes per parameter (dflash.md §4.7; ≈ 52 GB for a ~3B drafter sized from
Kimi K2.6). FSDP2 shards them per decoder layer, as SpecForge does. State is saved sharded; the servable
export gathers the full weights once on rank 0. On CPU (gloo) Accelerate ignores an FSDP plugin, so
`make_accelerator` switches its shared state to FSDP there.
"""

from __future__ import annotations

from typing import Optional

import torch

#: Bytes per trainable parameter under DDP with AdamW and fp32 master weights (weights 4 + grads 4 + m 4 + v 4).
TRAINING_BYTES_PER_PARAM = 16

#: The unit FSDP2 shards (one per draft layer); the fused `fc`/norms stay in the root unit.
WRAP_CLASSES = (
    "DFlashDecoderLayer",
)  # accelerate requires each listed class in the model; FSDP2 is DFlash-only (drafter.families refuses the others at planning)


def training_bytes(num_params: int, num_shards: int = 1) -> int:
    """Bytes of fp32 weights + grads + AdamW state per rank: `16 · num_params / num_shards` (activations
    and the frozen target not included)."""
    return TRAINING_BYTES_PER_PARAM * int(num_params) // max(1, int(num_shards))


def fsdp_plugin(
    *, reshard_after_forward: bool = True, activation_checkpointing: bool = False, mixed_precision: str = "no"
):
    """The `FullyShardedDataParallelPlugin` (FSDP2) the trainer uses.

    `reshard_after_forward`: True frees gathered layer weights after each forward; False keeps them to the backward
    (SHARD_GRAD_OP, SpecForge's choice: faster, more memory). State dicts are `SHARDED_STATE_DICT` (resume), the export
    asks for a full one (`full_drafter`).
    """
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=list(WRAP_CLASSES),
        reshard_after_forward=reshard_after_forward,
        state_dict_type="SHARDED_STATE_DICT",
        cpu_ram_efficient_loading=False,
        activation_checkpointing=activation_checkpointing,
    )
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    return plugin


def make_accelerator(*, cpu: bool, mixed_precision: str = "no", plugin=None, **kwargs):
    """`Accelerator(cpu=…, mixed_precision=…, fsdp_plugin=plugin, **kwargs)`; with a plugin on CPU ranks,
    Accelerate's shared state is switched to FSDP (see the module docstring).

    Raises:
        RuntimeError: the plugin did not take effect (`accelerator.is_fsdp2` false), e.g. a single process.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    accelerator = Accelerator(cpu=cpu, mixed_precision=mixed_precision, fsdp_plugin=plugin, **kwargs)
    if plugin is None:
        return accelerator
    if accelerator.distributed_type == DistributedType.MULTI_CPU:
        for shared in (AcceleratorState._shared_state, PartialState._shared_state):
            shared["distributed_type"] = DistributedType.FSDP
        AcceleratorState._shared_state["fsdp_plugin"] = plugin
    if not accelerator.is_fsdp2:
        raise RuntimeError(
            f"train.fsdp is on but the run is {accelerator.distributed_type} with {accelerator.num_processes} process(es); "
            "FSDP needs ≥ 2 processes (train.num_processes) under accelerate launch"
        )
    return accelerator


def full_drafter(accelerator, drafter) -> Optional[torch.nn.Module]:
    """A plain CPU fp32 copy of the (possibly FSDP-sharded) drafter with its full weights, on the main
    process (None elsewhere). Collective under FSDP: every rank must call it."""

    state = accelerator.get_state_dict(drafter)  # full (gathered) under FSDP, on rank 0
    if not accelerator.is_main_process:
        return None
    core = accelerator.unwrap_model(drafter)
    plain = type(core)(core.config)  # the drafter family's class
    missing, unexpected = plain.load_state_dict(
        {k: v.detach().to("cpu", torch.float32) for k, v in state.items()}, strict=False
    )
    missing = [m for m in missing if not m.startswith("rotary_emb.")]
    if missing or unexpected:
        raise RuntimeError(f"gathered drafter state: missing {missing}, unexpected {unexpected}")
    return plain
