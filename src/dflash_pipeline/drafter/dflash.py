"""The DFlash family (`drafter.family: dflash`, the default) and the base class of every drafter family.

A family is a `DFlashFamily` subclass registered with `.families.register`; its module names its config
class and model (`LazyClass`: the module imports neither torch nor transformers, so planning stays light), its anchors and slots (`drafts_per_block`, `label_slots`, `first_draft_slot`), its
training hooks (`training_blocks`, `objective`), its verify rule (`teacher_forced_hits`) and proposal,
its export (`speculative_config`, `engine_env`, `serve_md`) and its planning checks and params
(docs/how-to/add-a-drafter-family.md).

DFlash (reference/dflash.md): block [anchor, MASK×(B−1)], slot k predicts the token at p+k, so a block
proposes B − 1 drafts; vLLM serves it with method `dflash` and `num_speculative_tokens` B − 1, SGLang with
`--speculative-algorithm DFLASH`.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from dflash_pipeline.drafter.block_size import check_block_size
from dflash_pipeline.drafter.families import DEFAULT, LazyClass, register
from dflash_pipeline.target.layer_ids import hf_hidden_state_index

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from dflash_pipeline.drafter.config import DFlashConfig
    from dflash_pipeline.drafter.model import DFlashDrafter

#: `Blocks` builder the training step and held-out acceptance hand to `DFlashFamily.training_blocks`:
#: `build(slots, gamma)` → blocks of `slots` same-position label slots from each anchor (`ids`, `pos`,
#: `rows`, `labels`, `weights`, each [b, N·slots]).
BlockBuilder = Callable[[int, Optional[float]], Any]


@register
class DFlashFamily:
    """DFlash, and the defaults every family inherits (module docstring)."""

    #: `drafter.family` value and the `drafter.<name>` section of the family's settings.
    name = DEFAULT
    #: The config class (`config.json`); its class attributes name what the engines dispatch on. Imported when
    #: first read: planning asks the family its settings and checks, and must not import torch or transformers.
    config_class = LazyClass("dflash_pipeline.drafter.config:DFlashConfig")
    #: The drafter module class (imported when first read, as `config_class`).
    drafter_class = LazyClass("dflash_pipeline.drafter.model:DFlashDrafter")
    #: `train.loss` values this family trains with.
    losses: tuple[str, ...] = ("ce_decay", "dpace", "kl")
    #: `drafter.<name>` keys (the family's settings; validated by config/schema.yaml).
    settings_keys: tuple[str, ...] = ()
    #: `train.*` keys only this family reads (left out of the default family's train params).
    train_keys: tuple[str, ...] = ()
    #: Whether FSDP2 / packed rows / vLLM's CPU build are supported (refused at planning otherwise).
    supports_fsdp = True
    supports_packing = True
    served_by_vllm_cpu = True
    #: Display name in serve.md.
    title = "DFlash"

    # -- identity and slots -----------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        """`config.json` `architectures[0]` (what vLLM's and SGLang's registries dispatch on)."""
        return self.config_class.architecture

    @property
    def drafts_from_anchor(self) -> bool:
        """Whether slot 0 (the anchor) already drafts: B drafts per block instead of B − 1."""
        return self.config_class.drafts_from_anchor

    def drafts_per_block(self, block_size: int) -> int:
        """Tokens a block of `block_size` proposes: B when `drafts_from_anchor`, else B − 1."""
        return int(block_size) if self.drafts_from_anchor else int(block_size) - 1

    def label_slots(self, block_size: int) -> int:
        """Same-position label slots a training block of `block_size` reads."""
        return int(block_size) + int(self.drafts_from_anchor)

    @property
    def first_draft_slot(self) -> int:
        """The block slot of the first draft (0 when drafting from the anchor, else 1)."""
        return 0 if self.drafts_from_anchor else 1

    def acceptance_slots(self, block_size: int) -> int:
        """Length of the acceptance histogram: drafts per block + 1 (all accepted plus the bonus token)."""
        return self.drafts_per_block(block_size) + 1

    # -- config and model -------------------------------------------------------------------------

    def make_config(self, cfg: DFlashConfig, settings: Optional[Mapping[str, Any]] = None) -> DFlashConfig:
        """This family's config from a DFlash config `cfg` (`DFlashConfig.from_target`) and its
        `drafter.<name>` section `settings` (validated; defaults filled).

        Raises:
            ValueError: a settings key missing (naming the section and keys).
        """
        s = dict(settings or {})
        missing = [k for k in self.settings_keys if k not in s]
        if missing:
            raise ValueError(f"drafter.{self.name}: missing {missing}")
        out = cfg if type(cfg) is self.config_class else self.config_class(**cfg.to_dict())
        out.architectures = [self.architecture]
        self.apply_settings(out, s)
        return out

    def apply_settings(self, cfg: DFlashConfig, settings: Mapping[str, Any]) -> None:
        """Put the `drafter.<name>` keys on `cfg` (this family's config class) in place; DFlash has none."""

    def settings_of(self, raw: Mapping[str, Any]) -> dict:
        """The `drafter.<name>` section a `config.json` dict was written from (inverse of `make_config`)."""
        return {}

    def build(self, cfg: DFlashConfig) -> DFlashDrafter:
        """A freshly initialised drafter of this family on `cfg` (callers seed the RNG)."""
        return self.drafter_class(cfg)

    # -- training hooks (dflash_pipeline.train.step.step_objective) --------------------------------

    def training_blocks(self, build: BlockBuilder, block_size: int, gamma: Optional[float]):
        """The blocks a training step (or held-out acceptance, `gamma` None) feeds the drafter: `build`'s blocks of
        `label_slots` slots, as this family reads them. DFlash: `build(B, gamma)` (slot 0 the anchor, slot k ≥ 1
        weighted `exp(−(k−1)/γ)`). The result has `ids`, `pos`, `rows`, `labels`, `weights` [b, N·B]."""
        return build(block_size, gamma)

    def objective(self, ctx, core, hidden: torch.Tensor, blocks, teacher: Optional[torch.Tensor], base: Callable):
        """The step's objective (a `LossOutput`, unnormalised) from the drafter's final-normed `hidden` [b, N·B, H]
        on `blocks`. `ctx`: the step's settings; `core`: the unwrapped drafter; `teacher`: the target's last hidden
        state per slot [b, N·B, H] (teacher losses) or None; `base()`: the plain `train.loss` objective on the LM head's
        logits. DFlash: `base()`."""
        return base()

    def teacher_forced_hits(self, core, lm_head, hidden: torch.Tensor, blocks) -> torch.Tensor:
        """bool [b, Q]: whether this family's draft rule, teacher-forced, proposes each slot's label. DFlash:
        the argmax of the LM head's logits (chunks of 4096 slots: never [Q, V] logits at once)."""
        import torch

        labels = blocks.labels
        hits = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
        for i in range(0, hidden.shape[1], 4096):
            h = hidden[:, i : i + 4096]
            hits[:, i : i + 4096] = lm_head(h.to(lm_head.weight.dtype)).argmax(-1) == labels[:, i : i + 4096]
        return hits

    # -- serving ---------------------------------------------------------------------------------

    def engine_env(self) -> dict[str, str]:
        """Environment a vLLM server needs to serve this family (none for DFlash)."""
        return {}

    def speculative_config(self, drafter_dir: str | Path, block_size: int, *, adaptive: bool = False) -> dict:
        """vLLM's `--speculative-config` for an export of this family: method `config_class`
        `.speculative_method`, `num_speculative_tokens` = `drafts_per_block` (vLLM reads no
        `block_size` from the checkpoint). `adaptive`: confidence-scheduled verification.

        Raises:
            BlockSizeError (a ValueError): `block_size` < 2; ValueError: `adaptive` without a confidence head.
        """
        bs = check_block_size(block_size)
        if adaptive and not self.adaptive_verification:
            raise ValueError("adaptive verification needs DSpark's confidence head (family dspark)")
        spec = {
            "method": self.config_class.speculative_method,
            "model": str(drafter_dir),
            "num_speculative_tokens": self.drafts_per_block(bs),
        }
        if adaptive:
            spec["enable_adaptive_verification"] = True
        return spec

    #: Whether vLLM can size each step's verification from a confidence head (`enable_adaptive_verification`).
    adaptive_verification = False

    def serve_commands(
        self, drafter_dir: str | Path, target: str | Path, block_size: int, *, port: int = 8000
    ) -> dict[str, str]:
        """`{"vllm": ..., "sglang": ...}`: the launch lines that serve `drafter_dir` beside `target`
        (dflash.md §8.4): vLLM with `speculative_config`; SGLang with `--speculative-num-draft-tokens` =
        `block_size` (it counts the bonus slot)."""
        vllm = shlex.join(
            [
                "python",
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(target),
                "--port",
                str(port),
                "--speculative-config",
                json.dumps(self.speculative_config(drafter_dir, block_size)),
            ]
        )
        sglang = shlex.join(
            [
                "python",
                "-m",
                "sglang.launch_server",
                "--model-path",
                str(target),
                "--port",
                str(port),
                "--speculative-algorithm",
                "DFLASH",
                "--speculative-draft-model-path",
                str(drafter_dir),
                "--speculative-num-draft-tokens",
                str(int(block_size)),
            ]
        )
        return {"vllm": vllm, "sglang": sglang}

    def serve_head(self, cfg: Mapping[str, Any], target: str) -> str:
        """The first lines of a family's `serve.md` (`title`): block, drafts per step, layers, target."""
        bs = int(cfg["block_size"])
        layers = (cfg.get("dflash_config") or {}).get("target_layer_ids")
        return (
            f"# Serving this {self.title} drafter\n\n"
            f"Block size {bs} ({self.drafts_per_block(bs)} drafts per step), {cfg.get('num_hidden_layers')} draft "
            f"layer(s), target layers {layers} (aux hidden states {[hf_hidden_state_index(i) for i in layers or []]}), "
            f"target `{target}`.\n\n"
        )

    def serve_md(self, cfg: Mapping[str, Any], meta: Mapping[str, Any], drafter_dir: str | Path, target: str) -> str:
        """`serve.md` of an export: how to serve it with vLLM and SGLang."""
        bs = int(cfg["block_size"])
        layers = [int(i) for i in cfg["dflash_config"]["target_layer_ids"]]
        cmds = self.serve_commands(drafter_dir, target, bs)
        text = f"""# Serving this DFlash drafter

Block size {bs} ({bs - 1} drafts per step), {cfg["num_hidden_layers"]} draft layer(s), target layers
{layers} (the engines capture them as aux hidden states {[hf_hidden_state_index(i) for i in layers]}), target `{target}`.

vLLM (`num_speculative_tokens` = block size − 1; vLLM ignores the checkpoint's `block_size`):

```bash
{cmds["vllm"]}
```

SGLang (`--speculative-num-draft-tokens` = block size; add a non-causal draft attention backend, e.g.
`--speculative-draft-attention-backend flashinfer`):

```bash
{cmds["sglang"]}
```

Acceptance as the engine reports it (vLLM `/metrics`: τ = 1 + Δ`vllm:spec_decode_num_accepted_tokens_total`
/ Δ`vllm:spec_decode_num_drafts_total`): `dflash-eval server --base-url http://127.0.0.1:8000/v1
--set NAME=PATH --out engine.json`. SGLang reports it per answer (`meta_info`:
`spec_verify_ct`, `spec_correct_drafts_histogram`): add `--engine sglang`.

In the pipeline: with SGLang started by the line above, `eval: {{engine: sglang, engine_base_url:
"http://<host>:8000/v1"}}` puts its τ and per-position acceptance beside our loop's (the pipeline cannot start
SGLang itself); `eval: {{engine: vllm}}` starts vLLM in the eval job.
"""
        if meta.get("zero_target_features"):
            text += """
Note: this drafter was trained with the target features zeroed (a baseline); the engines feed it the real
features, so served acceptance says nothing about it.
"""
        if int(cfg["num_hidden_layers"]) > 1:
            text += """
Note: vllm-cpu 0.32.0 (the CPU build) normalises every draft layer's context keys with layer 0's `k_norm`
(its `rms_norm` kernel ignores a stacked per-layer weight; fixed for XPU in vLLM PR #56431), so a drafter
with more than one layer is served with lower acceptance there. CUDA builds are not affected.
"""
        return text

    # -- planning and Snakemake params -------------------------------------------------------------

    def has_confidence_head(self, settings: Mapping[str, Any]) -> bool:
        """Whether a drafter built from the `drafter.<name>` section `settings` has a confidence head."""
        return False

    def config_problems(self, cfg: Mapping[str, Any]) -> list[str]:
        """This family × setting combinations refused at planning, one line each (`cfg` validated, defaults
        filled): a `train.loss` outside `losses`; `dspark_tv` with feature shards (they carry no
        final-normed last hidden state); FSDP2, packed rows or vLLM's CPU build where unsupported."""
        d, train, ev = cfg["drafter"], cfg["train"], cfg["eval"]
        out = []
        if train["loss"] not in self.losses:
            out.append(
                f"train.loss: {train['loss']} cannot train drafter.family {self.name}; use one of "
                f"{', '.join(self.losses)}" + self.loss_hint
            )
        if train["loss"] == "dspark_tv" and train["target_features"] == "shards":
            out.append(
                "train.loss: dspark_tv compares with the target's distribution (its final-normed last hidden "
                "state), which feature shards do not carry; use train.target_features: online or train.loss: ce_decay"
            )
        if not self.supports_fsdp and train.get("fsdp"):
            out.append(
                f"train.fsdp is not supported with drafter.family: {self.name} yet (its heads run on parameters "
                f"outside the sharded decoder layers, after the drafter's forward); train it with DDP (train.fsdp: false)"
            )
        if not self.supports_packing and train["packing"]:
            out.append(f"train.packing is not supported with drafter.family: {self.name} yet; set train.packing: false")
        if (
            not self.served_by_vllm_cpu
            and ev["engine"] == "vllm"
            and not ev["engine_base_url"]
            and _local_vllm_is_cpu_build(cfg)
        ):
            out.append(
                f"eval.engine: vllm cannot serve drafter.family {self.name} with the CPU build (vllm-cpu has no "
                f"Triton, and vLLM's {self.name} speculator runs only on the V2 model runner's Triton kernels); give "
                f"eval.engine_base_url of a GPU server started as the export's serve.md says, or eval.engine: none"
            )
        out += self.confidence_problems(d.get(self.name) or {}, ev)
        return out

    #: Appended to the wrong-loss line (why the family's logits need their own objectives).
    loss_hint = ""

    def confidence_problems(self, settings: Mapping[str, Any], ev: Mapping[str, Any]) -> list[str]:
        """`eval.confidence_threshold` problems for this family (none for DFlash: the threshold is ignored)."""
        return []

    def arch_params(self, drafter: Mapping[str, Any]) -> dict:
        """The train rule's `arch` param: `layer_types`/`sliding_window`, plus `family` and its section
        for a family other than the default (so default runs keep their params)."""
        out = {k: drafter[k] for k in ("layer_types", "sliding_window")}
        if self.name != DEFAULT:
            out["family"] = self.name
            out[self.name] = dict(drafter.get(self.name) or {})
        return out

    def train_params(self, train: Mapping[str, Any]) -> dict:
        """The train rule's `train` param: every key for a non-default family; the default family leaves out
        the keys only other families read (so default runs keep their params)."""
        if self.name != DEFAULT:
            return dict(train)
        from dflash_pipeline.drafter.families import family_train_keys

        drop = set(family_train_keys())
        return {k: v for k, v in train.items() if k not in drop}


def _local_vllm_is_cpu_build(cfg: Mapping[str, Any]) -> bool:
    """Whether the vLLM environment `eval.engine` would start is the CPU build (a `vllm_cpu` dist-info in
    its site-packages). False when no environment is found (that problem is reported on its own)."""
    from dflash_pipeline.core.vllm_env import VLLMNotFound, require_vllm_python

    try:
        python = Path(require_vllm_python(None))
    except VLLMNotFound:
        return False
    venv = python.parent.parent
    return any(venv.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))
