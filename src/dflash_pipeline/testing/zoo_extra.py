"""Zoo twins of architectures the model corpus has no `config.json` for, built from transformers' own
config classes: a state-space hybrid (Jamba, Falcon-H1), a short-convolution hybrid (LFM2), NoPE layers
(SmolLM3), sparse-attention MLA (DeepSeek-V3.2), LongCat's double-attention layers, an image-text wrapper
one level deeper (Mistral-3). Each must run every zoo stage or be refused at planning with the reason,
never crash mid-run. `extra_source_dir` writes a corpus-style directory for `zoo.build_twin`.

The sweep goes over every causal LM transformers ships (`sweep_types`): `probe_type` probes the config
class's defaults as the pipeline probes a target; a type is `ok` when layer count, width and vocabulary
match what transformers builds, `refused` on a `ProbeRefusal` or `ConfigError`, else a `crash`. No model
is built. The full pipeline runs on a sample (`PIPELINE_SAMPLE` plus a rotating pick of
`PIPELINE_VERIFIED`) through `zoo.run_stages`.

`python -m dflash_pipeline.testing.zoo_extra` prints the supported-types table
(docs/reference/model-types.md; `--write` writes it there).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The tiny multi-head latent attention (low-rank q/kv) and routed-expert sizes the MLA twins share.
_TINY_MLA_MOE = {
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 4,
}

#: name → (transformers config class, architecture, kwargs, corpus family whose chat template it renders).
EXTRA_FAMILIES: dict[str, tuple[str, str, dict, str]] = {
    "Jamba-twin": (
        "JambaConfig",
        "JambaForCausalLM",
        {
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mamba_d_state": 8,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "use_mamba_kernels": False,
        },
        "Qwen3-8B",
    ),
    "FalconH1-twin": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        {
            "mamba_d_ssm": 64,
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "mamba_n_groups": 1,
            "mamba_d_state": 8,
            "mamba_d_conv": 4,
            "mamba_chunk_size": 16,
        },
        "Qwen3-8B",
    ),
    "LFM2-twin": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        {
            "num_hidden_layers": 4,
            "layer_types": ["conv", "full_attention", "conv", "full_attention"],
            "conv_L_cache": 3,
            "tie_word_embeddings": False,
        },
        "Qwen3-8B",
    ),
    "SmolLM3-NoPE": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        {"no_rope_layer_interval": 2, "use_sliding_window": False, "tie_word_embeddings": False},
        "Qwen3-8B",
    ),
    "DeepSeek-V3.2-twin": (
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        {
            "num_hidden_layers": 4,
            **_TINY_MLA_MOE,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "index_n_heads": 2,
            "index_head_dim": 16,
            "index_topk": 8,
        },
        "DeepSeek-V3.1",
    ),
    "LongCat-Flash-twin": (
        "LongcatFlashConfig",
        "LongcatFlashForCausalLM",
        {
            **_TINY_MLA_MOE,
            "moe_topk": 2,
            "zero_expert_num": 2,
            "ffn_hidden_size": 96,
            "expert_ffn_hidden_size": 32,
        },
        "DeepSeek-V3.1",
    ),
    "Mistral3-twin": (
        "Mistral3Config",
        "Mistral3ForConditionalGeneration",
        {
            "text_config": {"model_type": "mistral", "num_hidden_layers": 4, "sliding_window": None},
            "vision_config": {"model_type": "pixtral"},
            "tie_word_embeddings": False,
        },
        "Llama-3.1-8B-Instruct",
    ),
}


#: Weight seed offsets per extra twin. The extras untie their embeddings: a tied twin's scaled head also scales
#: its input embedding, and its greedy completions are one token repeated (nothing to supervise).
TWIN_SEEDS: dict[str, int] = {}


def extra_config(name: str) -> dict:
    """The `config.json` dict of extra family `name`, as its transformers config class writes it (plus
    `architectures`). Sizes are then shrunk by the zoo like any corpus config.

    Raises:
        KeyError: not an extra family. AttributeError: this transformers has no such config class.
    """
    import transformers

    cls_name, arch, kwargs, _ = EXTRA_FAMILIES[name]
    cfg = getattr(transformers, cls_name)(**json.loads(json.dumps(kwargs)))
    raw = cfg.to_dict()
    raw["architectures"] = [arch]
    for k in ("transformers_version", "_name_or_path"):
        raw.pop(k, None)
    return raw


def extra_source_dir(models_dir: str | Path, name: str, out: str | Path) -> Path:
    """A corpus-style directory `out/<name>` for an extra family; returns `out`."""
    from dflash_pipeline.testing.zoo_templates import family_template_text

    root = Path(out)
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(extra_config(name), indent=1) + "\n", encoding="utf-8")
    tmpl_family = EXTRA_FAMILIES[name][3]
    (d / "chat_template.jinja").write_text(family_template_text(models_dir, tmpl_family), encoding="utf-8")
    tc = Path(models_dir) / tmpl_family / "tokenizer_config.json"
    if tc.is_file():
        shutil.copyfile(tc, d / "tokenizer_config.json")
    return root


# --- the sweep over every causal-LM model type

#: Config-class keyword overrides where the defaults do not validate or do not make a decoder the
#: formula can place layers in (the reason each is needed in the comment).
TYPE_OVERRIDES: dict[str, dict] = {
    "bloom": {"n_layer": 4},  # defaults to 2 layers; the layer-id formula needs 4
    "gemma4_assistant": {  # the class's own validator rejects its default text config
        "text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0, "enable_moe_block": False}
    },
}

#: Types that always run the full in-process pipeline in the tests: a hyper-connection target (DeepSeek-V4:
#: hidden states [b, t, 4, h]) and a hybrid cache whose linear-attention layers record only their last state
#: (ZAYA). `rotating_sample` adds `ROTATION_SIZE` of `PIPELINE_VERIFIED` each day.
PIPELINE_SAMPLE = ("deepseek_v4", "zaya")
#: Types whose twin ran every stage (`python -m dflash_pipeline.testing.zoo --table --family type:<type>`):
#: the rotation walks them, so each stays verified; add a type here once its run is clean.
PIPELINE_VERIFIED = (
    "codegen",
    "deepseek_v4",
    "gpt2",
    "idefics2",
    "minicpmv4_6",
    "nemotron_h",
    "qwen3_next",
    "zaya",
)
ROTATION_SIZE = 1

#: Chat template family the twins of swept types render (the zoo corpus's Qwen3 template).
TEMPLATE_FAMILY = "Qwen3-8B"
#: Prefix of zoo family names that stand for a transformers model type (`type:deepseek_v4`).
TYPE_PREFIX = "type:"


@dataclass(frozen=True)
class SweepRow:
    """One model type's probe: `status` `ok` / `refused` / `crash`; `reason` the refusal's kind
    (`probe.checks.REASONS`, or `settings`); `refused_at` `config.json` or `config class`; `detail` the
    message, or what the probe found (one line)."""

    model_type: str
    kind: str
    architecture: str
    status: str
    reason: str
    detail: str
    refused_at: str = ""


def _arch(name: Any) -> str:
    return name[0] if isinstance(name, (list, tuple)) else str(name)


def sweep_types() -> list[tuple[str, str, str]]:
    """`(model_type, kind, architecture)` for every causal-LM type (`causal-lm`) and every image-text-to-text type
    outside it whose config holds a decoder text config (`image-text`). Sorted by kind, then type."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    out = [(mt, "causal-lm", _arch(a)) for mt, a in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())]
    for mt, a in sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items()):
        if mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or mt not in CONFIG_MAPPING:
            continue
        try:
            cfg = CONFIG_MAPPING[mt](**TYPE_OVERRIDES.get(mt, {}))
            text = cfg.get_text_config(decoder=True)
        except Exception:  # noqa: BLE001 - a wrapper whose defaults do not build is no decoder to sweep
            continue
        if text is not cfg and not getattr(cfg, "is_encoder_decoder", False):
            out.append((mt, "image-text", _arch(a)))
    return out


def type_config(model_type: str, architecture: str) -> dict:
    """The `config.json` dict of `model_type` as its config class writes it with its defaults.

    Raises:
        Exception: whatever the config class raises on its defaults (the sweep reports it as `crash`).
    """
    from transformers import CONFIG_MAPPING

    raw = CONFIG_MAPPING[model_type](**json.loads(json.dumps(TYPE_OVERRIDES.get(model_type, {})))).to_dict()
    raw["architectures"] = [architecture]
    raw.pop("_name_or_path", None)
    return raw


def _one_line(text: str, limit: int = 400) -> str:
    return " ".join(str(text).split())[:limit]


def probe_type(model_type: str, kind: str, architecture: str, work: Path) -> SweepRow:
    """Probe `model_type`'s defaults config in `work/<model_type>` (config.json only, no tokenizer, mask id
    given) and check the record against the config class (see the module docstring)."""
    from transformers import AutoConfig

    from dflash_pipeline.core.errors import ConfigError, ProbeRefusal
    from dflash_pipeline.probe import probe_target
    from dflash_pipeline.probe.checks import raw_config_refusal

    def row(status: str, reason: str, detail: str) -> SweepRow:
        at = ""
        if status == "refused":
            at = "config.json" if raw_config_refusal(d) is not None else "config class"
        return SweepRow(model_type, kind, architecture, status, reason, _one_line(detail), at)

    d = work / model_type
    d.mkdir(parents=True, exist_ok=True)
    try:
        raw = type_config(model_type, architecture)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return row("crash", "config class defaults", f"{type(exc).__name__}: {exc}")
    (d / "config.json").write_text(json.dumps(raw, indent=1, default=str) + "\n", encoding="utf-8")
    try:
        rec = probe_target(d, block_size=4, num_draft_layers=1, mask_token_id=0, strict=False)
    except ProbeRefusal as exc:
        return row("refused", exc.reason, str(exc).replace(str(d), model_type))
    except ConfigError as exc:
        return row("refused", "settings", str(exc).replace(str(d), model_type))
    except Exception as exc:  # noqa: BLE001 - a crash is what the sweep exists to catch
        return row("crash", type(exc).__name__, f"{type(exc).__name__}: {exc}")
    if rec["target_loader"]["error"]:
        return row("refused", "not loadable", rec["target_loader"]["error"].replace(str(d), model_type))
    text = AutoConfig.from_pretrained(str(d), local_files_only=True).get_text_config(decoder=True)
    facts = {k: rec[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size")}
    built = {k: getattr(text, k, None) for k in facts}
    if facts != built:
        return row("crash", "wrong facts", f"probe {facts}, transformers builds {built}")
    return row(
        "ok",
        "",
        f"{rec['num_hidden_layers']} layers, hidden {rec['hidden_size']}, {rec['attention']['kind']}"
        + (f", {len(set(rec['layer_types']))} layer types" if rec.get("layer_types") else "")
        + (", MoE" if rec.get("moe") else ""),
    )


def sweep(work: Path | None = None) -> list[SweepRow]:
    """`probe_type` of every `sweep_types` type, in that order (`work`: a temp dir when None)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # config classes warn about their own defaults
    tmp = None
    if work is None:
        tmp = work = Path(tempfile.mkdtemp(prefix="dflash-sweep-"))
    try:
        return [probe_type(mt, kind, arch, work) for mt, kind, arch in sweep_types()]
    finally:
        hf_logging.set_verbosity(verbosity)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def rotating_sample(
    verified: tuple[str, ...] = PIPELINE_VERIFIED, *, day: datetime.date | None = None, size: int = ROTATION_SIZE
) -> list[str]:
    """`size` types of `verified` beyond `PIPELINE_SAMPLE`, a different pick each day, so successive runs walk every
    verified type through the full pipeline."""
    pool = sorted(t for t in verified if t not in PIPELINE_SAMPLE)
    if not pool:
        return []
    if day is None:
        named = os.environ.get("DFLASH_SWEEP_DAY")
        day = datetime.date.fromisoformat(named) if named else datetime.date.today()
    start = day.toordinal() * size
    return [pool[(start + i) % len(pool)] for i in range(min(size, len(pool)))]


# --- twins of a model type for the zoo's full-pipeline stages

#: Config keys set on a swept type's twin so it builds and trains on CPU in seconds (the rest of the
#: shrinking is the zoo's `testing.zoo_shrink.shrink_config`).
TWIN_OVERRIDES: dict[str, dict] = {
    "deepseek_v4": {"num_hidden_layers": 4},
    "nemotron_h": {
        "layers_block_type": ["linear_attention", "mlp", "full_attention", "moe"],
        "n_routed_experts": 4,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "ssm_state_size": 8,
        "n_groups": 1,
        "chunk_size": 16,
        "use_mamba_kernels": False,
    },
}


def type_source_dir(models_dir: str | Path, model_type: str, out: str | Path) -> Path:
    """A corpus-style directory `out/type:<model_type>` for a swept type; returns `out`.

    Raises:
        KeyError: `model_type` is not a swept type.
    """
    from dflash_pipeline.testing.zoo_templates import family_template

    arch = {mt: a for mt, _, a in sweep_types()}[model_type]
    raw = type_config(model_type, arch)
    # untied, as the zoo's extra twins (see TWIN_SEEDS)
    for d in (raw, raw.get("text_config")):
        if isinstance(d, dict) and "tie_word_embeddings" in d:
            d["tie_word_embeddings"] = False
    raw.update(json.loads(json.dumps(TWIN_OVERRIDES.get(model_type, {}))))
    root = Path(out)
    d = root / f"{TYPE_PREFIX}{model_type}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(raw, indent=1, default=str) + "\n", encoding="utf-8")
    shutil.copyfile(family_template(models_dir, TEMPLATE_FAMILY), d / "chat_template.jinja")
    tc = Path(models_dir) / TEMPLATE_FAMILY / "tokenizer_config.json"
    if tc.is_file():
        shutil.copyfile(tc, d / "tokenizer_config.json")
    return root


# --- the supported-types table

PAGE = Path("docs/reference/model-types.md")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table_markdown(rows: list[SweepRow], transformers_version: str) -> str:
    """The supported-types page: a header, counts per status, and one row per type (status, reason, what the
    probe found or why it refused). Types of `PIPELINE_SAMPLE` are marked as run through the full
    pipeline in the tests. Deterministic in `rows`."""
    counts = {s: sum(r.status == s for r in rows) for s in ("ok", "refused", "crash")}
    lines = [
        "# Supported model types",
        "",
        "<!-- generated by `python -m dflash_pipeline.testing.zoo_extra --write`; do not edit by hand -->",
        "",
        f"Every causal-LM model type transformers {transformers_version} ships (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`)",
        "and every image-text-to-text wrapper around a decoder, probed as the pipeline probes a target: the",
        "config class's defaults written as `config.json`.",
        "",
        "- **ok**: the probe reads the layers, width and vocabulary transformers builds, and sizes the drafter.",
        "  Types marked **(full pipeline)** also build a tiny twin (the same config class, shrunk) that runs",
        "  completions, tokens, training (fp32 and bf16) and evaluation in the test suite",
        "  (`tests/unit/testing/test_zoo_sweep.py`: DeepSeek-V4 and ZAYA always, one of the others each day).",
        "- **refused**: `snakemake` (and `snakemake -n`) stops while it plans the run, before any job runs and",
        "  before any completion is requested. *config.json*: the reason is in `config.json` alone and is listed",
        "  with the other config problems; *config class*: the reason shows through the config class (e.g. a",
        "  layer count it derives), found by the plan-time gate while no probe record has accepted the target.",
        "",
        "Refusal reasons: *attention-free* (state-space / recurrent: no attention heads to size the drafter",
        "from), *looped layers* (layers run more than once per token), *per-layer values* (a size the drafter",
        "copies differs per layer), *no context length*, *encoder-decoder* (the decoder of an encoder-decoder",
        "model), *not a causal LM*, *no language-model config*, *embedding width* (a factorized embedding",
        "narrower than the layers), *sublayer count*, *drafter cannot be sized*, *rotary not servable* (vLLM",
        "would serve the drafter's rotary differently), *not loadable*, *settings* (a drafter setting to change).",
        "A refused default can be an ok model with other values (Dory with `n_recurrent_loops: 1`; a real",
        "GLM-4.5 config, whose head_dim differs from the class default).",
        "",
        f"{len(rows)} types: {counts['ok']} ok, {counts['refused']} refused, {counts['crash']} crash.",
        "",
        "| model type | kind | architecture | status | refused at | reason | probe |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        full = r.model_type in PIPELINE_SAMPLE + PIPELINE_VERIFIED and r.status == "ok"
        status = r.status + (" (full pipeline)" if full else "")
        lines.append(
            f"| `{r.model_type}` | {r.kind} | `{r.architecture}` | {status} | {r.refused_at} | {_cell(r.reason)} "
            f"| {_cell(r.detail)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """CLI: print the supported-types table (`--write`: write it to `PAGE` under `--repo`)."""
    import transformers

    ap = argparse.ArgumentParser(prog="python -m dflash_pipeline.testing.zoo_extra", description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help=f"write {PAGE} instead of printing it")
    ap.add_argument("--repo", default=".", help="repository root for --write")
    a = ap.parse_args(argv)
    text = table_markdown(sweep(), transformers.__version__)
    if a.write:
        from dflash_pipeline.core.shards import atomic_write_bytes

        atomic_write_bytes(Path(a.repo) / PAGE, text.encode("utf-8"))
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
