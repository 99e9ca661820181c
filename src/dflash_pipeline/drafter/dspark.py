"""The DSpark family (`drafter.family: dspark`): the DFlash backbone drafting a whole block from the anchor, a
low-rank Markov logit bias on the previous token, and a confidence head that sets how many drafts to verify. Its
config, model and objective are in `dspark_model`, which this module names only as strings (`LazyClass`) and
reaches through its drafter class: planning reads this module alone.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dflash_pipeline.drafter.dflash import DFlashFamily
from dflash_pipeline.drafter.families import LazyClass, register

if TYPE_CHECKING:  # pragma: no cover
    import torch

ARCHITECTURE = "Qwen3DSparkModel"
MARKOV_HEAD_TYPES = ("vanilla",)
#: `drafter.dspark.*` keys, written at the top level of `config.json` (`qwen3_dspark.py:205-231`).
SETTINGS_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")


@register
class DSparkFamily(DFlashFamily):
    """DSpark (`drafter.family: dspark`): B drafts per block from the anchor, the Markov bias and the
    confidence head (`train.confidence_weight`), trained with `ce_decay` or `dspark_tv`; served by vLLM's
    V2 model runner (method `dspark`, not by the CPU build) and SGLang's `DSPARK`."""

    name = "dspark"
    title = "DSpark"
    config_class = LazyClass("dflash_pipeline.drafter.dspark_model:DSparkConfig")
    drafter_class = LazyClass("dflash_pipeline.drafter.dspark_model:DSparkDrafter")
    losses = ("ce_decay", "dspark_tv")
    loss_hint = " (DSpark's logits carry the Markov bias the plain objectives leave out)"
    settings_keys = SETTINGS_KEYS
    train_keys = ("confidence_weight",)
    supports_fsdp = False
    supports_packing = False
    served_by_vllm_cpu = False
    adaptive_verification = True

    def apply_settings(self, cfg, settings: Mapping[str, Any]) -> None:
        for k in SETTINGS_KEYS:
            setattr(cfg, k, settings[k])
        cfg.sample_from_anchor = True

    def settings_of(self, raw: Mapping[str, Any]) -> dict:
        return {k: raw[k] for k in SETTINGS_KEYS}

    def has_confidence_head(self, settings: Mapping[str, Any]) -> bool:
        return bool(settings.get("enable_confidence_head"))

    def training_blocks(self, build, block_size, gamma):
        """Blocks of B + 1 label slots read shifted by one (`dspark_view`): slot k predicts p+k+1, weight
        `exp(−k/γ)`, `prev` the gold token at p+k."""
        blk = build(self.label_slots(block_size), None)
        return self.drafter_class.training_view(
            blk.ids, blk.pos, blk.labels, blk.weights, block_size, gamma, rows=blk.rows
        )

    def objective(self, ctx, core, hidden, blocks, teacher, base):
        """`DSparkDrafter.objective` (the plain objectives leave out the Markov bias: `base` is not used)."""
        return core.objective(
            hidden,
            ctx.lm_head.weight,
            blocks,
            loss=ctx.loss,
            teacher_hidden=teacher,
            confidence_weight=ctx.confidence_weight,
            logit_softcap=ctx.logit_softcap,
        )

    def teacher_forced_hits(self, core, lm_head, hidden, blocks) -> torch.Tensor:
        """The argmax of the Markov-biased logits after the gold token at p+k (`blocks.prev`)."""
        import torch

        labels, prev = blocks.labels, blocks.prev
        hits = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
        for i in range(0, hidden.shape[1], 4096):  # chunks of slots: never [Q, V] logits at once
            h, y, p = hidden[:, i : i + 4096], labels[:, i : i + 4096], prev[:, i : i + 4096]
            logits = lm_head(h.to(lm_head.weight.dtype)).float()
            hits[:, i : i + 4096] = core.step_logits(logits, p)[0].argmax(-1) == y
        return hits

    def engine_env(self) -> dict[str, str]:
        return {"VLLM_USE_V2_MODEL_RUNNER": "1"}

    def confidence_problems(self, settings, ev) -> list[str]:
        if ev.get("confidence_threshold", 0.0) and not settings.get("enable_confidence_head"):
            return ["eval.confidence_threshold needs drafter.dspark.enable_confidence_head: true"]
        return []

    def serve_md(self, cfg, meta, drafter_dir, target, port: int = 8000) -> str:
        """vLLM's V2-runner command (with adaptive verification from the confidence head) and SGLang's `DSPARK`."""
        bs = int(cfg["block_size"])
        n = self.drafts_per_block(bs)
        env = " ".join(f"{k}={v}" for k, v in self.engine_env().items())
        vllm = f"{env} " + self.serve_commands(drafter_dir, target, bs, port=port)["vllm"]
        adaptive = json.dumps(
            self.speculative_config(drafter_dir, bs, adaptive=bool(cfg.get("enable_confidence_head")))
        )
        sglang = shlex.join(
            [
                "python",
                "-m",
                "sglang.launch_server",
                "--model-path",
                target,
                "--port",
                str(port),
                "--speculative-algorithm",
                "DSPARK",
                "--speculative-draft-model-path",
                str(drafter_dir),
            ]
        )
        return (
            self.serve_head(cfg, target)
            + f"""vLLM ≥ 0.32 serves DSpark with method `dspark` on the V2 model runner
(`vllm/v1/worker/gpu/spec_decode/dspark/`); a block proposes all {n} tokens from the anchor, so
`num_speculative_tokens` = block size (its default for DSpark; more than the block size is refused).

```bash
{vllm}
```

With the confidence head, vLLM can size each step's verification from it (`enable_adaptive_verification`):

```bash
{env} python -m vllm.entrypoints.openai.api_server --model {shlex.quote(target)} --port {port} --speculative-config {shlex.quote(adaptive)}
```

SGLang (upstream `--speculative-algorithm DSPARK`: sgl-project/sglang PR #30261, released in v0.5.16 for
DeepSeek-V4's DSpark, described in the lm-sys DSpark blog, PR #357; DSpark takes no
`--speculative-num-draft-tokens`, the block comes from the checkpoint; check that your release loads a Qwen3
DSpark drafter, `Qwen3DSparkModel`, before relying on it):

```bash
{sglang}
```

The CPU build (vllm-cpu 0.32.0, no Triton) cannot run the V2 runner's speculators, so it does not serve DSpark.
"""
        )
