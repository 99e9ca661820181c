"""The `generate_completions` rule's entry: `generate_shard` (resume, generate what is left, write
the shard and its stats), `make_backend` and the pre-generation chat-template check."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from dflash_pipeline.core import shards
from dflash_pipeline.core.config import generation_problems
from dflash_pipeline.core.contracts import COMPLETION_SCHEMA_VERSION, canonical_json, completion_schema
from dflash_pipeline.core.errors import ConfigError, GenerationError
from dflash_pipeline.target.chat import load_tokenizer, template_kwargs

from .openai_backend import OpenAIBackend
from .records import (
    MAX_SKIPPED_EXAMPLES,
    OnDone,
    RunInfo,
    _quiet_http_logs,
    context_limit,
    read_prompts,
    sampling_params,
)
from .resume import ERRORS_SUFFIX, PROGRESS_SUFFIX, ProgressLog, _drop_other_model, _fingerprint
from .stats import _Progress, ended_early, shard_stats
from .transformers_backend import TransformersBackend

log = logging.getLogger(__package__)  # one logger for the whole completions stage


class Backend(Protocol):
    """A generation backend: answers every user turn of each prompt and reports each conversation."""

    #: model name recorded in every record
    model: str

    def resolve_model(self) -> str:
        """The model name this backend sends and records (may ask the servers). Optional: without it
        `generate_shard` uses `model`."""
        ...

    def run(self, prompts: Sequence[dict], on_done: OnDone, info: RunInfo) -> dict:
        """Generate all `prompts`; call `on_done(record)` once per conversation as it finishes
        (status ok/truncated/error). Returns backend stats (JSON-able). Raises GenerationError to stop."""
        ...


def make_backend(
    gen_cfg: dict, *, target_dir=None, chat_template=None, trust_remote_code=False, dtype="auto"
) -> Backend:
    """The backend named by `gen_cfg["backend"]`. Raises ConfigError for an unknown one."""
    if gen_cfg["backend"] == "transformers":
        problems = generation_problems(gen_cfg, target_dir=target_dir)
        if problems:
            raise ConfigError("; ".join(problems))
        return TransformersBackend(
            target_dir, gen_cfg, chat_template=chat_template, trust_remote_code=trust_remote_code, dtype=dtype
        )
    if gen_cfg["backend"] == "openai":
        return OpenAIBackend(
            gen_cfg, target_dir=target_dir, chat_template=chat_template, trust_remote_code=trust_remote_code
        )
    raise ConfigError(f"generation.backend: unknown backend {gen_cfg['backend']!r}; use transformers or openai")


def preflight_template(
    target_dir: str | Path,
    *,
    gen_cfg: dict,
    tokens_cfg: dict,
    chat_template: str | Path | None = None,
    trust_remote_code: bool = False,
) -> list[str]:
    """Before a completions job generates anything: `target.spans.check_template` on the target's
    tokenizer and template in `gen_cfg["thinking"]`. Warnings are logged and returned.

    Raises:
        ConfigError: the tokens stage could not mask conversations of this template in this mode.
    """
    from dflash_pipeline.target import spans  # the string level only: no numpy/pyarrow in this rule's env

    if tokens_cfg.get("use_server_token_ids"):
        log.warning(
            "tokens.use_server_token_ids is set: the chat-template check is skipped; records without "
            "server token ids will still need the render path"
        )
        return []
    tok = load_tokenizer(target_dir, chat_template=chat_template, trust_remote_code=trust_remote_code)
    name = f"chat template {chat_template}" if chat_template else f"chat template of {target_dir}"
    warnings = spans.check_template(tok, gen_cfg["thinking"], template_name=name)
    for w in warnings:
        log.warning("%s", w)
    return warnings


def too_long_prompts(prompts: Sequence[dict], tok, gen_cfg: dict, limit: int) -> dict[str, dict]:
    """Prompts that cannot fit the target's context: the render of the last turn's prompt with every answer before it
    empty plus `generation.max_tokens` exceeds `limit` (`max_position_embeddings`). Returns `{prompt_id: example}`
    (`prompt_tokens`, `max_tokens`, `max_position_embeddings`)."""
    from dflash_pipeline.target.chat import render, tools_of

    out = {}
    for p in prompts:
        msgs: list[dict] = []
        for m in p["messages"]:
            if m["role"] == "user" and msgs and msgs[-1]["role"] in ("user", "tool"):
                msgs.append({"role": "assistant", "content": ""})  # the answer this turn will get
            msgs.append({k: v for k, v in m.items() if v is not None})  # a source tool call: the call it will make
        tools = tools_of(p.get("tools"))
        n = len(render(tok, msgs, thinking=gen_cfg["thinking"], add_generation_prompt=True, tokenize=True, tools=tools))
        if n + gen_cfg["max_tokens"] > limit:
            out[p["prompt_id"]] = {
                "prompt_id": p["prompt_id"],
                "prompt_tokens": n,
                "max_tokens": gen_cfg["max_tokens"],
                "max_position_embeddings": limit,
            }
    return out


def generate_shard(
    prompt_shard: str | Path,
    out_path: str | Path,
    *,
    target_dir: str | Path | None,
    gen_cfg: dict,
    chat_template: str | Path | None = None,
    trust_remote_code: bool = False,
    progress_path: str | Path | None = None,
    errors_path: str | Path | None = None,
    stats_path: str | Path | None = None,
    dtype: str = "auto",
    backend: Backend | None = None,
) -> dict:
    """Generate the completion shard for one prompt shard (the `generate_completions` rule's entry).

    Args:
        prompt_shard: Parquet file with `contracts.PROMPT_SCHEMA`.
        out_path: completion shard to write (`contracts.COMPLETION_SCHEMA`, atomic).
        target_dir: the target (transformers backend; tokenizer and template for `api: completions`).
        gen_cfg: validated `config["generation"]`.
        chat_template, trust_remote_code, dtype: as `target.*`.
        progress_path: resume file (default `<out_path>.progress.jsonl`), removed once the shard is written.
        errors_path: error sidecar (default `<out_path>.errors.jsonl`), rewritten each run.
        stats_path: if given, the stats are written there as JSON.
        backend: an already built backend; default from `gen_cfg["backend"]`.

    Returns:
        The stats (`contracts.CompletionStats`): the whole shard's counts, this run's (resumed,
        generated, seconds, rates, request counters) in `run`.

    Raises:
        GenerationError: the circuit breaker opened, or more than `max_error_fraction` of the shard
            failed (the shard is not written; finished conversations stay in the progress file).
        DataError: malformed prompt shard. ConfigError: bad generation settings."""
    t_start = time.monotonic()
    paths = _Paths.of(out_path, progress_path, errors_path)
    prompts = read_prompts(prompt_shard)
    template_kwargs(gen_cfg["thinking"])  # validates the mode
    progress = ProgressLog(paths.progress, _fingerprint(gen_cfg["backend"], gen_cfg, target_dir, chat_template))
    done = _resumable(progress, prompts)
    kw = {"target_dir": target_dir, "dtype": dtype, "chat_template": chat_template}
    backend, model_name = _backend_and_model(
        backend, done, prompts, paths, gen_cfg, trust_remote_code=trust_remote_code, **kw
    )
    pending = [p for p in prompts if p["prompt_id"] not in done]
    # conversations that cannot fit the target's context are skipped and counted, never sent
    skipped = _skip_too_long(pending, target_dir, gen_cfg, chat_template, trust_remote_code, paths)
    prompts, pending = _without(prompts, skipped), _without(pending, skipped)
    resumed = len(done)
    if resumed:
        log.info("%s: resuming, %d of %d conversations already finished", paths.out, resumed, len(prompts))
    failed, backend_stats = {}, {}  # prompt_id -> error record; the backend's counters of this run
    if pending:
        model_name, backend_stats = _generate(
            backend, pending, gen_cfg, progress, paths, _Sink(done, failed, len(prompts), skipped)
        )
        prompts = _without(prompts, skipped)  # the backend may have skipped more (a later turn outgrew the context)
    records = _final_records(prompts, done, failed, gen_cfg, paths)
    skip_info = _skip_summary(skipped)
    _write_shard(paths.out, records, gen_cfg, model_name, prompt_shard, skip_info)
    paths.finished(errors=bool(failed))
    stats = shard_stats(
        paths.out,
        backend=gen_cfg["backend"],
        model=model_name,
        records=records,
        generated_ids={p["prompt_id"] for p in pending},
        resumed=resumed,
        wall_s=time.monotonic() - t_start,
        backend_stats=backend_stats,
        skip_info=skip_info,
    )
    _report_stats(paths, stats, stats_path)
    return stats


def _backend_and_model(
    backend: Backend | None, done: dict, prompts: Sequence[dict], paths: _Paths, gen_cfg: dict, **backend_kw
) -> tuple[Backend | None, str | None]:
    """The backend that generates what `done` lacks and the shard's model name so far: the one this run sends when
    records were resumed, else that of the resumed records (None when there are none)."""
    model_name = next(iter(done.values())).get("model") if done else None
    if all(p["prompt_id"] in done for p in prompts):
        return backend, model_name
    if backend is None:
        backend = make_backend(gen_cfg, **backend_kw)
    if done:  # resumed records must come from the model this run sends (generation.model unset: /models)
        model_name = _resumed_model(backend, done, paths, len(prompts))
    return backend, model_name


def _without(prompts: Sequence[dict], skipped: dict[str, dict]) -> list[dict]:
    """`prompts` less those in `skipped` (by prompt_id), in order."""
    return [p for p in prompts if p["prompt_id"] not in skipped]


def _report_stats(paths: _Paths, stats: dict, stats_path: str | Path | None) -> None:
    """The shard's stats as the job reports them: its console line (`_console_summary`) and, when
    `stats_path` is given, the stats JSON there (the rule's `stats` output)."""
    _console_summary(paths, stats)
    if stats_path is not None:
        shards.write_json(stats_path, stats, skip_if_identical=False)


def _console_summary(paths: _Paths, stats: dict) -> None:
    """The job's one console line (`workflow.policy.console`): the shard's counts, this run's."""
    from dflash_pipeline.core.console import console

    run = stats["run"]
    console(
        "%s: %d ok, %d truncated, %d error, %d skipped as too_long%s; %d turns, %d completion tokens; this run "
        "%d generated, %d resumed in %.1f s",
        paths.out,
        stats["ok"],
        stats["truncated"],
        stats["error"],
        stats["skipped"]["too_long"],
        f", {stats['ended_early']['tool_call_diverged']} ended at a diverged tool call"
        if "ended_early" in stats
        else "",
        stats["turns"],
        stats["completion_tokens"],
        run["generated"],
        run["resumed"],
        run["wall_s"],
    )


def _skip_too_long(pending, target_dir, gen_cfg, chat_template, trust_remote_code, paths) -> dict[str, dict]:
    """Prompts of `pending` that cannot fit the target's context (`too_long_prompts`), logged; {}
    when the target's config or tokenizer is not available (then only the backend's own check applies)."""
    limit = context_limit(target_dir)
    if not pending or limit is None:
        return {}
    try:
        tok = load_tokenizer(target_dir, chat_template=chat_template, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ConfigError) as exc:
        log.warning(
            "%s: no target tokenizer to check prompt lengths against max_position_embeddings=%d (%s)",
            paths.out,
            limit,
            exc,
        )
        return {}
    found = too_long_prompts(pending, tok, gen_cfg, limit)
    if found:
        first = next(iter(found.values()))
        log.warning(
            "%s: %d prompts skipped as too_long: their prompt plus generation.max_tokens=%d exceeds the "
            "target's max_position_embeddings=%d (first: prompt %s, %d prompt tokens); drop them earlier "
            "with prompts.max_prompt_tokens",
            paths.out,
            len(found),
            gen_cfg["max_tokens"],
            limit,
            first["prompt_id"],
            first["prompt_tokens"],
        )
    return found


def _skip_summary(skipped: dict[str, dict]) -> dict:
    """`{"skipped": {reason: n}, "skipped_examples": {reason: [example, ...]}}` (examples bounded by
    `MAX_SKIPPED_EXAMPLES`) for the shard's stats and metadata; all skips so far are `too_long`."""
    examples = list(skipped.values())
    return {"skipped": {"too_long": len(examples)}, "skipped_examples": {"too_long": examples[:MAX_SKIPPED_EXAMPLES]}}


@dataclass(frozen=True)
class _Paths:
    """The files of one shard job: the shard, its progress file and its error sidecar."""

    out: Path
    progress: Path
    errors: Path

    @classmethod
    def of(cls, out_path, progress_path, errors_path) -> "_Paths":
        out = Path(out_path)
        return cls(
            out,
            Path(progress_path) if progress_path else Path(str(out) + PROGRESS_SUFFIX),
            Path(errors_path) if errors_path else Path(str(out) + ERRORS_SUFFIX),
        )

    def finished(self, *, errors: bool) -> None:
        """The shard is written: its progress file goes, and its error sidecar too unless `errors`."""
        self.progress.unlink(missing_ok=True)
        if not errors:
            self.errors.unlink(missing_ok=True)


def _resumable(progress: ProgressLog, prompts: Sequence[dict]) -> dict[str, dict]:
    """Finished (ok/truncated) records of this shard's prompts in the progress file, by prompt_id."""
    wanted = {p["prompt_id"] for p in prompts}
    return {pid: r for pid, r in progress.load().items() if pid in wanted and r.get("status") in ("ok", "truncated")}


def _stopped(exc: GenerationError, paths: _Paths, done: dict, n_prompts: int) -> GenerationError:
    """`exc` with the shard named and what a rerun keeps (`done`: the finished records so far)."""
    kept = (
        f"{len(done)} of {n_prompts} conversations are finished and kept in {paths.progress}; rerunning "
        f"sends only the rest"
        if done
        else f"none of the {n_prompts} conversations is finished yet"
    )
    return GenerationError(f"{paths.out}: {str(exc).rstrip('.')}. {kept}")


def _resumed_model(backend: Backend, done: dict, paths: _Paths, n_prompts: int) -> str | None:
    """The model this run sends (may ask the servers); drops from `done` the records of another model.
    Raises GenerationError (`_stopped`) when the breaker opened before any endpoint answered."""
    resolve = getattr(backend, "resolve_model", None)
    try:
        with _quiet_http_logs():
            model_name = resolve() if resolve is not None else backend.model
    except GenerationError as exc:
        raise _stopped(exc, paths, done, n_prompts) from None
    if model_name:
        _drop_other_model(done, model_name, paths.progress)
    return model_name


class _Sink:
    """Where each finished conversation goes: ok/truncated into `done` and the progress file, errors
    into `failed` and the error sidecar; every one to the progress bar. Opened by `_generate`."""

    def __init__(self, done: dict, failed: dict, n_prompts: int, skipped: dict | None = None):
        self.done, self.failed, self.n_prompts = done, failed, n_prompts
        self.skipped = {} if skipped is None else skipped  # prompt_id -> example (updated in place)
        self.progress = self.err_fh = self.bar = None

    def __call__(self, record: dict) -> None:
        if record["status"] == "skipped":  # never generated (completions.records.skipped_record)
            self.skipped[record["prompt_id"]] = record["example"]
            log.warning("prompt %s skipped (%s): %s", record["prompt_id"], record["reason"], record["example"])
            self.bar.update({"status": "skipped", "turns": []})
            return
        if record["status"] == "error":
            self.failed[record["prompt_id"]] = record
            self.err_fh.write(
                json.dumps(
                    {
                        "prompt_id": record["prompt_id"],
                        "dataset": record["dataset"],
                        "error": record["error"],
                        "turns_done": len(record["turns"]),
                        "model": record["model"],
                    },
                    ensure_ascii=False,
                )
                + "\n"
            )
            self.err_fh.flush()
        else:
            self.done[record["prompt_id"]] = record
            self.progress.append(record)
        self.bar.update(record)


def _generate(
    backend: Backend, pending: Sequence[dict], gen_cfg: dict, progress: ProgressLog, paths: _Paths, sink: _Sink
) -> tuple[str, dict]:
    """Run `backend` on `pending`, every record into `sink`. Returns `(model, backend stats)`."""
    info = RunInfo(model=backend.model, sampling=canonical_json(sampling_params(gen_cfg)), thinking=gen_cfg["thinking"])
    progress.open(sink.done.values())
    paths.errors.parent.mkdir(parents=True, exist_ok=True)
    sink.progress = progress
    sink.err_fh = open(paths.errors, "w", encoding="utf-8")
    sink.bar = _Progress(sink.n_prompts, len(sink.done), paths.out.name, resumed_records=sink.done.values())
    try:
        with _quiet_http_logs():
            backend_stats = backend.run(pending, sink, info)
    except GenerationError as exc:
        raise _stopped(exc, paths, sink.done, sink.n_prompts) from None
    finally:
        sink.bar.close()
        progress.close()
        sink.err_fh.close()
    return info.model, backend_stats


def _final_records(prompts: Sequence[dict], done: dict, failed: dict, gen_cfg: dict, paths: _Paths) -> list[dict]:
    """The shard's records in prompt-shard order. Raises GenerationError when a prompt has no record (a
    backend bug) or more than `max_error_fraction` of the shard failed."""
    missing = [p["prompt_id"] for p in prompts if p["prompt_id"] not in done and p["prompt_id"] not in failed]
    if missing:  # a backend bug, never silently dropped
        raise GenerationError(
            f"{paths.out}: backend returned no record for {len(missing)} prompts (first: {missing[0]})"
        )
    n_err = len(failed)
    if n_err > gen_cfg["max_error_fraction"] * len(prompts):
        first = next(iter(failed.values()))
        raise GenerationError(
            f"{paths.out}: {n_err} of {len(prompts)} conversations failed (first: prompt {first['prompt_id']}: "
            f"{first['error']}); all are listed in {paths.errors}. The {len(done)} finished ones are kept in "
            f"{paths.progress}, so a rerun retries only the failed ones. To accept failures as status=error "
            f"rows instead, raise generation.max_error_fraction"
        )
    return [done.get(p["prompt_id"]) or failed[p["prompt_id"]] for p in prompts]


def _write_shard(
    out_path: Path,
    records: list[dict],
    gen_cfg: dict,
    model_name: str | None,
    prompt_shard,
    skip_info: dict | None = None,
) -> None:
    """The completion shard (atomic), with its metadata."""
    counts = Counter(r["status"] for r in records)
    meta = {
        "schema_version": COMPLETION_SCHEMA_VERSION,
        "stage": "completions",
        "backend": gen_cfg["backend"],
        "model": model_name,
        "sampling": sampling_params(gen_cfg),
        "thinking": gen_cfg["thinking"],
        "prompt_shard": Path(prompt_shard).name,
        "num_records": len(records),
        "status_counts": {k: counts.get(k, 0) for k in ("ok", "truncated", "error")},
        **(skip_info if skip_info and any(skip_info["skipped"].values()) else {}),
    }
    ended = ended_early(records)
    if ended and any(ended["ended_early"].values()):
        meta["ended_early"] = ended["ended_early"]
    schema = completion_schema(records)  # the tools schema only when a record has tools: other shards' bytes stay
    shards.write_parquet(out_path, shards.table_from_records(records, schema), metadata=meta)
