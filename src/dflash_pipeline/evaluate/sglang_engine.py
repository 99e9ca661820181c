"""SGLang as the eval engine (`eval.engine: sglang`): what its answers and its server say.

SGLang reports acceptance per request in `meta_info` (`tokenizer_manager`; asked with
`return_meta_info: true`, non-streaming): `spec_verify_ct`, `spec_accept_length` = completion tokens /
verify steps, and `spec_correct_drafts_histogram` (older `spec_accept_histogram`), `h[n]` = steps that
accepted exactly n drafts. `histogram_acceptance_stats` pools a set's histograms into vLLM's figures, so
`engine_vs_loop.compare_tau` can test the agreement. Tested with the SGLang-shaped test server;
`bench/gpu_check.sh` runs the real check.
"""

from __future__ import annotations

from collections.abc import Sequence

from dflash_pipeline.evaluate.engine_metrics import (
    EngineComparisonError,
    _http_json,
    engine_acceptance_stats,
)

#: Why `eval.engine: sglang` needs `eval.engine_base_url` (the job's error; config.problems says it at plan time).
SGLANG_NEEDS_URL = (
    "eval.engine: sglang measures τ on a running SGLang server: start it with the target and the trained drafter "
    "(the SGLang line of results/checkpoints/<run>/final/serve.md) and give its URL as eval.engine_base_url "
    "(e.g. http://host:30000/v1); SGLang cannot be started here"
)


def response_acceptance(resp: dict) -> tuple[int, float | None, list[int] | None]:
    """`(completion tokens, a+1 mean, histogram)` of one chat response: SGLang's `meta_info.spec_accept_length` (or
    `completion_tokens / meta_info.spec_verify_ct`) and its `spec_correct_drafts_histogram`; None for what the response
    does not carry (vLLM: neither)."""
    n_out = int((resp.get("usage") or {}).get("completion_tokens") or 0)
    meta = (resp.get("choices") or [{}])[0].get("meta_info") or resp.get("meta_info") or {}
    hist = meta.get("spec_correct_drafts_histogram")
    hist = meta.get("spec_accept_histogram") if hist is None else hist
    hist = [int(c) for c in hist] if isinstance(hist, list) and hist else None
    if meta.get("spec_accept_length") is not None:
        return n_out, float(meta["spec_accept_length"]), hist
    if meta.get("spec_verify_ct"):
        return n_out, n_out / float(meta["spec_verify_ct"]), hist
    return n_out, None, hist


def histogram_acceptance_stats(
    histograms: Sequence[Sequence[int]], block_size: int | None, *, base_url: str = "the server"
) -> dict:
    """Pooled acceptance from SGLang's per-response histograms, `h[n]` = verify steps that accepted exactly
    n drafts (SGLang `tokenizer_manager`: `spec_correct_drafts_histogram`): the figures of
    `engine_acceptance_stats` from the counter deltas the histograms imply (steps = Σ h, accepted =
    Σ n·h[n], steps whose draft k was accepted = Σ_{n>k} h[n]; dflash.md §7.1: acceptance is a prefix), so
    τ = Σ (n+1)·h[n] / Σ h is pooled over verify steps like vLLM's. `block_size` None: the histograms'
    length (SGLang's `--speculative-num-draft-tokens`).

    Raises:
        EngineComparisonError: a histogram longer than `block_size` (the server runs another drafter), or
            no verify step at all.
    """
    width = max(len(h) for h in histograms)
    bs = int(block_size or width)
    if width > bs:
        raise EngineComparisonError(
            f"{base_url}: SGLang's spec_correct_drafts_histogram has {width} entries (0..{width - 1} accepted "
            f"drafts), more than block size {bs} allows: the server runs another drafter "
            f"(--speculative-num-draft-tokens {width})"
        )
    total = [sum(h[n] for h in histograms if n < len(h)) for n in range(bs)]
    if sum(total) <= 0:
        raise EngineComparisonError(f"{base_url}: SGLang's meta_info histograms count no verify step")
    delta = {
        "drafts": float(sum(total)),
        "draft_tokens": float(sum(total) * (bs - 1)),
        "accepted": float(sum(n * c for n, c in enumerate(total))),
        "per_pos": {k: float(sum(total[k + 1 :])) for k in range(bs - 1)},
    }
    return engine_acceptance_stats(delta, bs)


def sglang_server_facts(base_url: str, api_key: str | None) -> dict:
    """`version` and `dtype` (its `--dtype`; `auto` = the checkpoint's) of a running SGLang server from
    `GET /get_server_info` (newer: `/server_info`); what it does not answer is None, with a note."""
    root = base_url.rstrip("/").removesuffix("/v1")
    for path in ("/server_info", "/get_server_info"):
        try:
            info = _http_json(root + path, api_key=api_key, timeout_s=10)
        except Exception:  # noqa: BLE001, S112 - informational only: try the other path
            continue
        if isinstance(info, dict):
            return {
                "version": info.get("version"),
                "dtype": info.get("dtype"),
                "dtype_note": f"the server's --dtype ({path}); auto = the checkpoint's dtype",
            }
    return {"version": None}
