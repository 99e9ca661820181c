"""What the engines report and how it is read: vLLM's Prometheus speculative-decoding counters, their deltas
and the acceptance figures they give (τ, per-position acceptance, histogram), and the engines' JSON over
HTTP. Shared by `.engine_acceptance` (vLLM, any OpenAI server) and `.sglang_engine` (SGLang's
per-answer `meta_info`), which both build on it; it imports neither.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

from dflash_pipeline.core.errors import PipelineError

#: vLLM Prometheus counters (feasibility.md §9). Mean acceptance length = 1 + accepted / drafts.
VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


class EngineComparisonError(PipelineError):
    """The engine reported no acceptance, or its record does not match the eval record it is compared with."""


# --- Prometheus counters


def _split_sample(line: str) -> Optional[tuple[str, dict[str, str], float]]:
    """`name{a="x",b="y"} value [timestamp]` → (name, labels, value); None for comments/blank/unparsable."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    if "{" in line:
        name, rest = line.split("{", 1)
        label_text, _, tail = rest.rpartition("}")
        labels = {}
        for part in label_text.split(","):
            k, eq, v = part.partition("=")
            if eq:
                labels[k.strip()] = v.strip().strip('"')
    else:
        name, _, tail = line.partition(" ")
        labels = {}
    fields = tail.split()
    if not fields:
        return None
    try:
        return name.strip(), labels, float(fields[0])
    except ValueError:
        return None


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition → name → value summed over label sets (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        s = _split_sample(line)
        if s is not None:
            out[s[0]] = out.get(s[0], 0.0) + s[2]
    return out


def parse_prometheus_by_label(text: str, name: str, label: str) -> dict[str, float]:
    """Values of metric `name` per value of `label` (summed over its other labels, e.g. model_name)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        s = _split_sample(line)
        if s is not None and s[0] == name and label in s[1]:
            out[s[1][label]] = out.get(s[1][label], 0.0) + s[2]
    return out


def spec_counters(text: str) -> dict[str, Any]:
    """vLLM's speculative-decoding counters from a `/metrics` body: `drafts`, `draft_tokens`,
    `accepted` and `per_pos` (position k → steps whose draft k was accepted)."""
    tot = parse_prometheus(text)
    per_pos = {int(k): v for k, v in parse_prometheus_by_label(text, VLLM_ACCEPTED_PER_POS, "position").items()}
    return {
        "drafts": tot.get(VLLM_DRAFTS, 0.0),
        "draft_tokens": tot.get(VLLM_DRAFT_TOKENS, 0.0),
        "accepted": tot.get(VLLM_ACCEPTED, 0.0),
        "per_pos": per_pos,
    }


def counters_delta(before: dict, after: dict) -> dict[str, Any]:
    """`after − before` of two `spec_counters` readings."""
    keys = set(before["per_pos"]) | set(after["per_pos"])
    return {
        **{k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")},
        "per_pos": {k: after["per_pos"].get(k, 0.0) - before["per_pos"].get(k, 0.0) for k in sorted(keys)},
    }


def engine_acceptance_stats(delta: dict, block_size: int) -> dict:
    """Acceptance figures from counter deltas (`counters_delta`) of B = `block_size`.

    Returns `tau` (1 + accepted / drafts, pooled over verify steps), `per_position_acceptance`
    (k = 1..B−1: share of steps that accepted ≥ k drafts = per_pos[k−1] / drafts), `histogram` (steps per
    a+1 = 1..B, from the per-position counts), `num_steps` (= drafts), `accepted_tokens`,
    `tau_sd` (per-step standard deviation of a+1).

    Raises:
        EngineComparisonError: no verify step in the delta (is the drafter loaded?), or per-position counts
            that do not add up to the accepted total (another engine's counters).
    """
    drafts = int(round(delta["drafts"]))
    if drafts <= 0:
        raise EngineComparisonError(
            f"the engine counted no speculative verify step ({VLLM_DRAFTS} did not increase); is the drafter "
            "loaded (vLLM --speculative-config with method dflash)?"
        )
    accepted = delta["accepted"]
    ge = [drafts] + [delta["per_pos"].get(k, 0.0) for k in range(block_size - 1)]  # steps with a ≥ k
    if delta["per_pos"] and abs(sum(ge[1:]) - accepted) > 0.5:
        raise EngineComparisonError(
            f"{VLLM_ACCEPTED_PER_POS} adds up to {sum(ge[1:]):.0f}, {VLLM_ACCEPTED} to {accepted:.0f}: the "
            f"per-position counters do not belong to a block size {block_size} drafter"
        )
    hist = {str(a + 1): int(round(ge[a] - (ge[a + 1] if a + 1 < block_size else 0.0))) for a in range(block_size)}
    tau = 1.0 + accepted / drafts
    second = sum(int(j) ** 2 * c for j, c in hist.items()) / drafts
    return {
        "tau": tau,
        "per_position_acceptance": [g / drafts for g in ge[1:]],
        "histogram": hist,
        "num_steps": drafts,
        "accepted_tokens": accepted,
        "tau_sd": math.sqrt(max(0.0, second - tau * tau)),
    }


def _http_json(url: str, body: Optional[dict] = None, *, api_key: Optional[str] = None, timeout_s: float = 600) -> Any:
    import urllib.request

    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = json.dumps(body).encode("utf-8") if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if body is not None else "GET")
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        raw = resp.read().decode("utf-8")
    return json.loads(raw) if body is not None or raw.lstrip().startswith(("{", "[")) else raw
