"""Every problem of a config, found at plan time: the schema's, then each stage's cross-field checks.

The Snakefile calls `problems` before Snakemake's `validate`, so `snakemake -n` names every problem (one
line each, config key first). The checks live in the stages that own them and are gathered here, above
the stages (core imports no other package).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from dflash_pipeline.core.config import fill_defaults, generation_problems, resolve_path, schema_problems
from dflash_pipeline.core.errors import strip_url_credentials
from dflash_pipeline.core.vllm_env import VLLMNotFound, require_vllm_python
from dflash_pipeline.drafter.block_size import BlockSizeError, resolve_block_size
from dflash_pipeline.drafter.families import config_problems as family_problems
from dflash_pipeline.target.chat import tokenizer_files_missing


def language_block_problems(cfg: Mapping[str, Any]) -> list[str]:
    """Problems of the language block of a validated config: codes the language filter does not know, confidences out
    of range. Imports the prompts stage only when a filter is configured."""
    if not cfg["prompts"].get("languages") and not any(
        src.get("languages") is not None or src.get("min_language_confidence") is not None
        for src in cfg["datasets"].values()
    ):
        return []
    from dflash_pipeline.prompts import language_problems  # here: the prompts package loads pyarrow

    return language_problems(cfg["prompts"], cfg["datasets"])


def cross_field_problems(cfg: Mapping[str, Any], *, base_dir: str | Path | None = None) -> list[str]:
    """Problems of a validated config that no single key shows, one line each: files that must exist, no dataset, an
    eval block size above the trained one, `generation_problems` and `language_block_problems`."""
    out = []
    path = cfg["target"]["path"]
    if path != "demo" and not (Path(path) / "config.json").is_file():
        out.append(f"target.path: {path}/config.json not found (a model directory, or `demo`)")
    elif path != "demo":
        out += target_architecture_problems(path)
        why = tokenizer_files_missing(Path(path))
        if why:
            out.append(
                f"target.path: {why}; the tokens stage (and generation.api: completions) need the "
                f"target's tokenizer (weights are needed only by the transformers backend)"
            )
    if path != "demo" and cfg["generation"]["backend"] == "transformers" and (Path(path) / "config.json").is_file():
        weights = (
            "*.safetensors",
            "model.safetensors.index.json",
            "pytorch_model*.bin",
            "pytorch_model.bin.index.json",
        )
        if not any(any(Path(path).glob(g)) for g in weights):
            out.append(
                f"target.path: no weights (*.safetensors, pytorch_model*.bin) in {path}, but "
                f"generation.backend: transformers generates with them in-process (and training runs "
                f"the target online); point target.path at the full model directory, or generate "
                f"with generation.backend: openai against a server"
            )
    template = cfg["target"]["chat_template"]
    if template is not None and not Path(template).is_file():
        out.append(f"target.chat_template: {template} not found (a .jinja file, or null for the tokenizer's own)")
    if not cfg["datasets"]:
        out.append("datasets: no prompt source configured (see config/config.yaml for the shape)")
    for name, src in cfg["datasets"].items():
        src_path = resolve_path(src["path"], base_dir)
        if not src_path.startswith("hf:") and not Path(src_path).exists():
            out.append(f"datasets.{name}.path: {src_path} not found")
    for name, src in cfg["eval"]["sets"].items():
        src_path = resolve_path(src["path"], base_dir)
        if not Path(src_path).exists():
            out.append(f"eval.sets.{name}.path: {src_path} not found")
    for key, edges in (
        ("eval.context_length_buckets", cfg["eval"]["context_length_buckets"]),
        ("train.validation_length_buckets", cfg["train"]["validation_length_buckets"]),
    ):
        if any(a >= b for a, b in zip(edges, edges[1:])):
            out.append(f"{key}: {edges} must be ascending token counts (bucket edges)")
    try:
        resolve_block_size(cfg["eval"]["block_size"], cfg["drafter"]["block_size"])
    except BlockSizeError as exc:
        out.append(str(exc))
    out += generation_problems(cfg["generation"], target_dir=path)
    out += language_block_problems(cfg)
    out += training_problems(cfg)
    return out


def target_architecture_problems(target_dir: str | Path) -> list[str]:
    """The probe's refusal of the target's architecture, read from `<target_dir>/config.json` alone, as one
    `target.path` line; [] when the probe would not refuse it there.

    The probe rule runs the same check, but completions do not wait for it (the probe record is not their
    input, so that upgrading never reruns them): refusing at plan time stops `snakemake` before the first
    completion is requested. Imports no transformers (planning stays fast)."""
    from dflash_pipeline.probe.checks import raw_config_refusal

    refusal = raw_config_refusal(target_dir)
    if refusal is None:
        return []
    return [f"target.path: the probe refuses this target ({refusal.reason}): {refusal}"]


#: The sources the probe's config-only checks run through (`probe.check_target_config`), relative to the package.
PROBE_GATE_SOURCES = ("probe", "target", "drafter/config.py", "drafter/block_size.py", "drafter/rope.py")


def probe_gate_problems(cfg: Mapping[str, Any], probe_record: str | Path) -> list[str]:
    """The probe's config-only checks (`probe.check_target_config`) of a local target without a probe
    record, or with one older than its `config.json`: one `target.path` line when the probe would refuse it.
    [] for the demo target and for a target its probe record accepted (nothing imported then). The Snakefile
    raises it while planning: a refused target must not cost a generation pass first.

    The answer is cached (`core.plan_cache`, under `probe-gate/`) by the target's `config.json` (and remote code),
    the `drafter` section, transformers' version and the checks' sources, so plans before the probe job has run read
    a file instead of importing transformers each time."""
    from dflash_pipeline.core.plan_cache import cache_root, cached_json, source_digest, target_config_key

    path = cfg["target"]["path"]
    config_json = Path(path) / "config.json"
    record = Path(probe_record)
    if path == "demo" or not config_json.is_file():
        return []
    if record.is_file() and record.stat().st_mtime >= config_json.stat().st_mtime:
        return []
    trust = bool(cfg["target"]["trust_remote_code"])
    key = {
        "probe_gate": target_config_key(path, trust),
        "drafter": cfg["drafter"],
        "code": source_digest(*PROBE_GATE_SOURCES),
    }
    try:
        return cached_json(cache_root() / "probe-gate", key, lambda: _probe_gate_check(cfg))
    except _NotARefusal:
        return []


class _NotARefusal(Exception):
    """The check failed on something other than a refusal (the probe job reports it); never cached."""


def _probe_gate_check(cfg: Mapping[str, Any]) -> list[str]:
    """`probe_gate_problems` computed: `probe.check_target_config` on the configured target.

    Raises:
        _NotARefusal: it failed otherwise than by refusing (not cached; the probe job reports it with its traceback).
    """
    from dflash_pipeline.core.errors import ConfigError, ProbeError
    from dflash_pipeline.probe import check_target_config

    try:
        check_target_config(
            cfg["target"]["path"], **cfg["drafter"], trust_remote_code=cfg["target"]["trust_remote_code"]
        )
    except (ProbeError, ConfigError) as exc:
        reason = getattr(exc, "reason", None)
        return [f"target.path: the probe refuses this target{f' ({reason})' if reason else ''}: {exc}"]
    except Exception as exc:  # noqa: BLE001 - not a refusal: the probe job reports it, with its traceback in the log
        raise _NotARefusal(str(exc)) from exc
    return []


def training_problems(cfg: Mapping[str, Any]) -> list[str]:
    """Combinations of the train / features / eval settings that cannot run, found before anything does."""
    out = []
    train, ev = cfg["train"], cfg["eval"]
    stream = cfg["features"].get("stream") or {}  # partial configs (tests, direct calls) have none
    if ev["engine"] == "sglang" and not ev["engine_base_url"]:
        out.append(
            "eval.engine: sglang measures τ on a running SGLang server, which the pipeline cannot start: "
            "start it with the trained drafter (the SGLang line of the export's serve.md) and set "
            "eval.engine_base_url (e.g. http://host:30000/v1)"
        )
    needs_vllm = []  # (setting, its vLLM python, what else fixes it)
    if ev["engine"] == "vllm" and not ev["engine_base_url"]:
        needs_vllm.append(("eval.engine: vllm", None, "; or give eval.engine_base_url"))
    if train["target_features"] == "shards" and cfg["features"]["backend"] == "vllm":
        needs_vllm.append(("features.backend: vllm", cfg["features"]["vllm"]["python"], "; or features.backend: hf"))
    if train["target_features"] == "stream" and stream.get("backend") == "vllm" and not stream.get("endpoints"):
        needs_vllm.append(
            ("features.stream.backend: vllm", cfg["features"]["vllm"]["python"], "; or features.stream.backend: hf")
        )
    for setting, python, alternative in needs_vllm:
        try:
            require_vllm_python(python)
        except VLLMNotFound as exc:
            out.append(f"{setting} runs vLLM from its own environment: {exc}{alternative}")
    urls = [
        (f"features.stream.endpoints[{i}].base_url", "api_key_env", e.get("base_url") or "")
        for i, e in enumerate(stream.get("endpoints") or [])
    ]
    urls.append(("eval.engine_base_url", "eval.engine_api_key_env", ev.get("engine_base_url") or ""))
    for key, instead, url in urls:
        if strip_url_credentials(url) != url:  # these URLs travel in job params and command lines
            out.append(
                f"{key}: {strip_url_credentials(url)} with user:password@ in it; the URL is stored in the "
                f"job's params and passed on its command line, so credentials cannot go there: give the key "
                f"through {instead} (the name of an environment variable)"
            )
    if train["target_features"] == "stream":
        for i, ep in enumerate(stream.get("endpoints") or []):
            env = ep.get("api_key_env")
            if env and not os.environ.get(env):
                out.append(
                    f"features.stream.endpoints[{i}].api_key_env: ${env} (the key of "
                    f"{strip_url_credentials(ep['base_url'])}) is not set; export it (the key itself never goes "
                    "into the config)"
                )
    return out + family_problems(cfg)  # drafter.family × settings (the family decides)


def problems(config: Mapping[str, Any], *, base_dir: str | Path | None = None) -> list[str]:
    """Every problem of `config` (as loaded, defaults not filled), one line each; empty when none.

    The schema's problems (`schema_problems`) first; only when there are none, the
    `cross_field_problems` of the validated config (they need the defaults). The Snakefile calls
    this before Snakemake's `validate`, so `snakemake -n` fails in seconds on settings that would
    otherwise fail hours later.
    """
    found = schema_problems(config)
    if found:
        return found
    return cross_field_problems(fill_defaults(config), base_dir=base_dir)
