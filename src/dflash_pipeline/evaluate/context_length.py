"""τ by context length: acceptance where it collapses (long contexts; vllm-ascend#15237, speculators#613).

A verify step's context length is the number of tokens before its verify block (`SpecResult`
`context_lengths`). Buckets are half-open ranges from the edges of `eval.context_length_buckets`:
`[1024, 4096, 16384]` gives `<1K`, `1K–4K`, `4K–16K` and `≥16K`. A bucket's τ is the eval stage's τ
(reference/dflash.md §7.1) over the bucket's verify steps: per response the mean a+1 of its steps there,
then the mean over the responses that have any.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Sequence

from dflash_pipeline.core.errors import ConfigError


def _tokens_label(n: int) -> str:
    """1024 → `1K`, 16384 → `16K`, 1536 → `1.5K`, 512 → `512` (a bucket edge in a label)."""
    if n >= 1024 and (n * 2) % 1024 == 0:
        k = n / 1024
        return f"{int(k)}K" if k == int(k) else f"{k:g}K"
    return str(n)


def bucket_labels(edges: Sequence[int]) -> list[str]:
    """Labels of the `len(edges) + 1` buckets: `<e0`, `e0–e1`, …, `≥e_last`.

    Raises:
        ConfigError: edges not strictly ascending positive integers (names `eval.context_length_buckets`).
    """
    edges = list(edges)
    if (
        not edges
        or any(not isinstance(e, int) or e < 1 for e in edges)
        or any(a >= b for a, b in zip(edges, edges[1:]))
    ):
        raise ConfigError(f"eval.context_length_buckets must be ascending positive token counts, got {edges}")
    names = [_tokens_label(e) for e in edges]
    return [f"<{names[0]}", *(f"{a}–{b}" for a, b in zip(names, names[1:])), f"≥{names[-1]}"]


def bucket_ranges(edges: Sequence[int]) -> list[list]:
    """`[lo, hi)` token range of each bucket (`hi` None for the last)."""
    bounds = [0, *edges]
    return [[lo, hi] for lo, hi in zip(bounds, [*edges, None])]


def tau_by_context_length(responses: Sequence[tuple[Sequence[int], Sequence[int]]], edges: Sequence[int]) -> dict:
    """τ per context-length bucket of a set's responses.

    Args:
        responses: per response `(context_lengths, accept_lengths)`: per verify step the tokens before
            the verify block and a+1 (two int sequences of equal length).
        edges: bucket edges in tokens (`bucket_labels`).

    Returns:
        label → `{tau, num_responses, num_steps, tokens_per_step, range: [lo, hi)}` for every bucket
        with at least one verify step, in bucket order (module docstring for τ).

    Raises:
        ConfigError: bad edges. ValueError: a response whose two sequences differ in length.
    """
    labels = bucket_labels(edges)
    sums = [[] for _ in labels]  # per bucket: per response (Σ a+1, steps)
    for ctx, acc in responses:
        if len(ctx) != len(acc):
            raise ValueError(f"a response has {len(ctx)} context lengths for {len(acc)} verify steps")
        per: dict[int, list[int]] = {}
        for n, a in zip(ctx, acc):
            per.setdefault(bisect_right(edges, n), []).append(a)
        for b, xs in per.items():
            sums[b].append((sum(xs), len(xs)))
    out = {}
    for label, rng, resp in zip(labels, bucket_ranges(edges), sums):
        if not resp:
            continue
        steps = sum(n for _, n in resp)
        out[label] = {
            "tau": sum(s / n for s, n in resp) / len(resp),
            "num_responses": len(resp),
            "num_steps": steps,
            "tokens_per_step": sum(s for s, _ in resp) / steps,
            "range": rng,
        }
    return out


def tau_by_prompt_length(responses: Sequence[tuple[int, float, int | None]], edges: Sequence[int]) -> dict:
    """τ per context-length bucket per request (engines report acceptance per request, not per verify step):
    a request goes to the bucket of its prompt length; a bucket's τ is the mean of its requests' a+1 means.

    Args:
        responses: per request `(prompt tokens, a+1 mean, verify steps or None)`.
        edges: bucket edges in tokens (`bucket_labels`).

    Returns:
        label → `{tau, num_responses, num_steps (or None), range: [lo, hi), basis: "prompt_tokens"}` for
        every bucket with a request, in bucket order.

    Raises:
        ConfigError: bad edges."""
    labels = bucket_labels(edges)
    per: dict[int, list[tuple[float, int | None]]] = {}
    for prompt_tokens, tau, steps in responses:
        per.setdefault(bisect_right(edges, int(prompt_tokens)), []).append((float(tau), steps))
    out = {}
    for b, (label, rng) in enumerate(zip(labels, bucket_ranges(edges))):
        if b not in per:
            continue
        taus = [t for t, _ in per[b]]
        steps = [n for _, n in per[b]]
        out[label] = {
            "tau": sum(taus) / len(taus),
            "num_responses": len(taus),
            "num_steps": sum(steps) if all(n is not None for n in steps) else None,
            "range": rng,
            "basis": "prompt_tokens",
        }
    return out


def length_buckets_of(eval_cfg: dict) -> list[int]:
    """The bucket edges of an `eval` section: `context_length_buckets`, or the schema's default where the
    section leaves it out (the eval rule's params drop it at its default)."""
    from dflash_pipeline.core.config import schema_default

    edges = eval_cfg.get("context_length_buckets")
    edges = list(edges) if edges is not None else schema_default("eval", "context_length_buckets")
    bucket_labels(edges)  # checks them
    return edges
