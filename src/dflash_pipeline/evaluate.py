"""Acceptance evaluation: a real speculative-decoding loop (target verifies the drafter's blocks).

Loop: reference/dflash.md §2.5 (z-lab ``dflash_generate``). Metrics: §7.1 — per verify step the
accepted drafts plus the bonus token (a+1); a response's τ is the mean over its steps; the reported τ
is the mean over responses. The draft is always greedy; the target samples at ``temperature``
(greedy when 0), so the output distribution is the target's.

Beyond the loop: :func:`evaluate` (every drafter on every eval set → the eval record JSON, a table, plots,
and τ across the intermediate ``step_<N>/`` exports), :func:`merge_eval_records` (side-by-side comparison
that refuses records produced under different thinking modes), :func:`plot_training` (loss and EAL proxy
vs step from ``train_log.jsonl``) and engine τ (:mod:`dflash_pipeline.evaluate_engine`: τ reported by a running SGLang/vLLM).

Response = one generated assistant turn: a multi-turn conversation (MT-Bench) contributes one response
per turn, each generated against the history of the drafter's own earlier answers.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from . import model as M
from .contracts import EVAL_SCHEMA_VERSION
from .errors import PipelineError
from .shards import write_json, write_tsv


class EvalComparisonError(PipelineError):
    """Eval records that must not be compared (e.g. produced under different thinking modes)."""


@dataclass
class SpecResult:
    """One response: ``output_ids`` (generated tokens, prompt excluded, eos kept), ``accept_lengths``
    (a+1 per verify step), ``target_forwards`` (verify forwards, prefill excluded; the re-runs of the
    ``recompute`` cache policy not counted), ``cache_policy`` (:class:`TargetCache`)."""

    output_ids: list[int]
    accept_lengths: list[int] = field(default_factory=list)
    target_forwards: int = 0
    cache_policy: str = ""  # TargetCache.policy: crop | recompute


def _sample(logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator]) -> torch.Tensor:
    """logits [..., V] → token ids [...] (argmax when temperature < 1e-5)."""
    if temperature < 1e-5:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def _cache_kw(target, cache) -> dict:
    """transformers ≥5.24 names the KV cache argument ``cache`` (``past_key_values`` is deprecated)."""
    import inspect

    params = inspect.signature(target.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


class TargetCache:
    """The target's cache in the verify loop, with one rollback policy for every cache type transformers
    ships (dflash.md §2.5: after a verify step only the bonus token and the accepted drafts stay).

    The cache is ``DynamicCache(config=target.config)``, so each layer gets its own type (full attention,
    sliding window, linear attention / recurrent state), with ``activate_past_recording`` so sliding and
    conv states keep what a rollback needs. After the prefill, :attr:`policy` is

    * ``crop``: every layer can be cut back (full and sliding attention: ``cache.is_croppable``) — the
      rejected tokens are cropped;
    * ``recompute``: some layer holds a recurrent state that cannot be cut back (linear attention of
      Qwen3.5/3.6 and Qwen3-Next): those layers are snapshotted before each verify forward; on a
      rejection they are restored, the croppable layers cropped to the same point, and the target re-runs
      the accepted tokens (one extra forward of a+1 tokens per rejecting step).

    Either way the cache afterwards equals the cache of a target that only ever saw the accepted tokens.
    """

    def __init__(self, target):
        from transformers import DynamicCache

        self.target = target
        try:
            self.cache = DynamicCache(config=target.config)
        except (TypeError, ValueError, AttributeError):  # older transformers: layers appear lazily
            self.cache = DynamicCache()
        if hasattr(self.cache, "activate_past_recording"):
            self.cache.activate_past_recording()
        self.policy: Optional[str] = None
        self._snapshot: Optional[dict] = None
        self.recomputes = 0

    def forward(self, ids: torch.Tensor, layer_ids: Sequence[int]):
        """Target forward of ``ids`` [1, n] on the cache → ``(features [1, n, K·H], output)``."""
        from .train import target_features

        if self.policy == "recompute":
            import copy

            self._snapshot = {i: copy.deepcopy(layer) for i, layer in enumerate(self.cache.layers)
                              if not getattr(layer, "is_croppable", False)}
        feats, out = target_features(self.target, ids, None, layer_ids, use_cache=True, **_cache_kw(self.target, self.cache))
        if self.policy is None:  # after the prefill every layer type is known
            self.policy = "crop" if getattr(self.cache, "is_croppable", True) else "recompute"
        return feats, out

    def keep(self, ids: torch.Tensor, n_keep: int, layer_ids: Sequence[int]) -> None:
        """After verifying ``ids`` [1, n], keep only its first ``n_keep`` tokens in the cache."""
        n_drop = ids.shape[1] - n_keep
        if self.policy == "crop" or n_drop == 0:
            self.cache.crop(-n_drop)  # crop(0) restricts sliding/conv states back to their window
            return
        for i, layer in enumerate(self.cache.layers):
            if i in self._snapshot:
                self.cache.layers[i] = self._snapshot[i]
            else:
                layer.crop(-ids.shape[1])
        self._snapshot = None
        self.recomputes += 1
        from .train import target_features

        target_features(self.target, ids[:, :n_keep], None, layer_ids, use_cache=True, **_cache_kw(self.target, self.cache))
        self.cache.crop(0)  # back to the minimal sliding/conv states, as after a crop


@torch.no_grad()
def speculative_generate(
    target,
    drafter: M.DFlashDrafter,
    prompt_ids: Sequence[int],
    *,
    block_size: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_token_ids: Sequence[int] = (),
    generator: Optional[torch.Generator] = None,
    zero_target_features: bool = False,
) -> SpecResult:
    """Generate up to ``max_new_tokens`` tokens for one prompt with DFlash speculative decoding (batch 1).

    ``block_size`` ≤ the drafter's trained block size. ``zero_target_features`` feeds the drafter zeros
    instead of the target's features (for the baseline trained that way; the target still verifies).
    The target cache follows :class:`TargetCache` (any cache type); the drafter runs in its own dtype
    (eval loads it in the target's, :func:`dflash_pipeline.target.drafter_dtype`).
    Returns a :class:`SpecResult`.

    Raises:
        ValueError: ``block_size`` larger than the drafter's, or an empty prompt.
    """
    from .target import input_embeddings, lm_head

    if block_size > drafter.block_size or block_size < 2:
        raise ValueError(f"block_size {block_size} must be in [2, trained block size {drafter.block_size}]")
    if not prompt_ids:
        raise ValueError("empty prompt")
    dev = next(target.parameters()).device
    embed, head = input_embeddings(target), lm_head(target)
    layer_ids = drafter.target_layer_ids
    stops = set(int(t) for t in stop_token_ids)

    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
    tcache = TargetCache(target)
    feats, out = tcache.forward(ids, layer_ids)
    bonus = _sample(out.logits[:, -1], temperature, generator)  # [1]
    result = SpecResult(output_ids=[int(bonus)], cache_policy=tcache.policy)
    start = ids.shape[1]  # position of the bonus token
    pending = feats  # target features not yet in the draft cache, positions cache.length .. start-1
    if zero_target_features:
        pending = torch.zeros_like(pending)
    dcache = M.DraftContextCache(len(drafter.layers))
    while int(bonus) not in stops and len(result.output_ids) < max_new_tokens:
        logits = drafter.draft_block(embed, head, bonus, pending, start, dcache, block_size)
        draft = logits[:, 1:].argmax(dim=-1)  # [1, B-1], greedy
        verify = torch.cat([bonus.view(1, 1), draft], dim=1)  # [1, B]
        feats, out = tcache.forward(verify, layer_ids)
        result.target_forwards += 1
        tgt = _sample(out.logits[0], temperature, generator)  # [B]: target's token after each slot
        a = 0
        while a < block_size - 1 and int(draft[0, a]) == int(tgt[a]):
            a += 1
        new = draft[0, :a].tolist() + [int(tgt[a])]
        result.accept_lengths.append(a + 1)
        for t in new:
            result.output_ids.append(int(t))
            if int(t) in stops or len(result.output_ids) >= max_new_tokens:
                break
        pending = feats[:, : a + 1]  # features of slots 0..a (positions start..start+a)
        if zero_target_features:
            pending = torch.zeros_like(pending)
        start += a + 1
        if int(result.output_ids[-1]) in stops or len(result.output_ids) >= max_new_tokens:
            break
        tcache.keep(verify, a + 1, layer_ids)
        bonus = tgt[a : a + 1]
    return result


def acceptance_stats(accept_lengths_per_response: Sequence[Sequence[int]], block_size: int) -> dict:
    """τ and friends from per-response lists of a+1 values (dflash.md §7.1).

    Returns ``tau`` (mean over responses of the per-response mean; responses with no verify step are
    left out), ``per_position_acceptance`` (k = 1..B−1: share of steps that accepted ≥ k drafts),
    ``histogram`` (counts of a+1 = 1..B), ``num_responses``, ``num_steps``, ``tokens_per_step`` (pooled).
    """
    per_resp = [sum(r) / len(r) for r in accept_lengths_per_response if len(r)]
    steps = [x for r in accept_lengths_per_response for x in r]
    hist = [0] * block_size
    for x in steps:
        hist[x - 1] += 1
    n = len(steps)
    per_pos = [sum(1 for x in steps if x - 1 >= k) / n if n else 0.0 for k in range(1, block_size)]
    return {
        "tau": sum(per_resp) / len(per_resp) if per_resp else 0.0,
        "per_position_acceptance": per_pos,
        "histogram": {str(i + 1): c for i, c in enumerate(hist)},
        "num_responses": len(accept_lengths_per_response),
        "num_steps": n,
        "tokens_per_step": sum(steps) / n if n else 0.0,
    }


def checkpoint_info(ckpt_dir: str | Path) -> dict:
    """What a drafter checkpoint says about itself: ``train_steps``, ``zero_target_features``, ``block_size``."""
    raw = json.loads((Path(ckpt_dir) / "config.json").read_text(encoding="utf-8"))
    extra = raw.get("dflash_pipeline") or {}
    return {
        "train_steps": extra.get("train_steps"),
        "zero_target_features": bool(extra.get("zero_target_features", False)),
        "block_size": raw.get("block_size"),
    }


def step_checkpoints(run_dir: str | Path) -> dict[int, Path]:
    """The intermediate exports ``<run_dir>/step_<N>/`` written during training, by step (ascending)."""
    import re

    found = {}
    for d in Path(run_dir).glob("step_*"):
        m = re.fullmatch(r"step_(\d+)", d.name)
        if m and d.is_dir() and (d / "config.json").is_file() and (d / "model.safetensors").is_file():
            found[int(m.group(1))] = d
    return dict(sorted(found.items()))


def training_prompt_ids(manifest_path: str | Path) -> set[str]:
    """``prompt_id`` of every training prompt in the shards listed by the prompts manifest."""
    from .shards import read_json, read_parquet

    manifest_path = Path(manifest_path)
    ids: set[str] = set()
    for ds in read_json(manifest_path)["datasets"].values():
        for shard in ds["shards"]:
            ids.update(read_parquet(manifest_path.parent / shard["path"]).column("prompt_id").to_pylist())
    return ids


def load_eval_sets(eval_cfg: dict, exclude_prompt_ids: Iterable[str] = ()) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """Each eval set's prompts (``prompts.load_eval_prompts``), with prompts seen in training removed
    *before* the seeded draw of ``num_samples`` (so the count holds when enough held-out prompts exist).

    Returns ``(sets, info)``: name → records, and name → ``{path, format, num_samples, available,
    excluded_training_prompts, num_prompts, num_turns}``.

    Raises:
        ConfigError: a set left with no prompt (every one of them was also a training prompt), which would
            otherwise report τ = 0.
    """
    from .errors import ConfigError
    from .prompts import load_eval_prompts

    exclude = set(exclude_prompt_ids)
    sets, info = {}, {}
    for name, s in eval_cfg["sets"].items():
        fmt = s.get("format", "auto")
        every = load_eval_prompts(s["path"], fmt=fmt, num_samples=10**9, seed=eval_cfg["seed"])  # seeded shuffle
        held_out = [r for r in every if r["prompt_id"] not in exclude]
        chosen = held_out[: s["num_samples"]]
        if not chosen:
            raise ConfigError(
                f"eval.sets.{name}: no prompt left in {s['path']} ({len(every)} prompts, all of them also training "
                f"prompts); train on fewer of them (datasets.<name>.max_prompts) or set eval.exclude_training_prompts: false")
        sets[name] = chosen
        info[name] = {
            "path": str(s["path"]), "format": fmt, "num_samples": s["num_samples"], "available": len(every),
            "excluded_training_prompts": len(every) - len(held_out), "num_prompts": len(chosen),
            "num_turns": sum(len(r["turns"]) for r in chosen),
        }
    return sets, info


def run_eval_set(
    target, tok, drafter, prompts: Sequence[dict], *, block_size: int, max_new_tokens: int, temperature: float,
    seed: int, thinking: str, stop_token_ids: Sequence[int], zero_target_features: bool = False,
) -> dict:
    """τ and friends (:func:`acceptance_stats`) of one drafter on one eval set.

    Every user turn is answered by the speculative loop against the history of the earlier turns and
    the loop's own answers (MT-Bench multi-turn); each answer is one response. Adds ``num_conversations``,
    ``new_tokens``, ``target_forwards``, ``tokens_per_target_forward``, ``seconds``, ``tokens_per_s``.
    """
    from .chat import render

    dev = next(target.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    responses: list[list[int]] = []
    t0, new_tokens, forwards = time.time(), 0, 0
    for rec in prompts:
        history: list[dict] = [{"role": "system", "content": rec["system"]}] if rec.get("system") else []
        for turn in rec["turns"]:
            history.append({"role": "user", "content": turn})
            prompt_ids = render(tok, history, thinking=thinking, add_generation_prompt=True, tokenize=True)
            res = speculative_generate(
                target, drafter, prompt_ids, block_size=block_size, max_new_tokens=max_new_tokens,
                temperature=temperature, stop_token_ids=stop_token_ids, generator=gen,
                zero_target_features=zero_target_features,
            )
            responses.append(res.accept_lengths)
            new_tokens += len(res.output_ids)
            forwards += res.target_forwards
            history.append({"role": "assistant", "content": tok.decode(res.output_ids, skip_special_tokens=True)})
    seconds = time.time() - t0
    stats = acceptance_stats(responses, block_size)
    stats.update(
        num_conversations=len(prompts), new_tokens=new_tokens, target_forwards=forwards,
        tokens_per_target_forward=new_tokens / max(1, forwards), seconds=seconds,
        tokens_per_s=new_tokens / seconds if seconds > 0 else 0.0,
    )
    return stats


@dataclass
class EvalSession:
    """The loaded target and everything a run of the speculative loop needs (see :func:`open_session`)."""

    target: Any
    tokenizer: Any
    probe: dict
    eval_cfg: dict
    device: str
    sets: dict[str, list[dict]]
    set_info: dict[str, dict]
    settings: dict
    loop: dict


def open_session(*, target_dir, probe: dict, eval_cfg: dict, thinking: str, chat_template=None,
                 trust_remote_code: bool = False, target_dtype: str = "auto",
                 exclude_prompt_ids: Iterable[str] = ()) -> EvalSession:
    """Load the target (:func:`dflash_pipeline.target.load_target`), its tokenizer and the eval sets."""
    from .chat import load_tokenizer
    from .target import load_target, module_dtype

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    target = load_target(target_dir, dtype=target_dtype, device=dev, trust_remote_code=trust_remote_code)
    tok = load_tokenizer(target_dir, chat_template=chat_template, trust_remote_code=trust_remote_code)
    stops = list(probe.get("tokenizer", {}).get("eos_token_ids") or [tok.eos_token_id])
    trained_bs = probe["drafter"]["block_size"]
    bs = eval_cfg.get("block_size") or trained_bs
    temperature = float(eval_cfg["temperature"])
    sets, set_info = load_eval_sets(eval_cfg, exclude_prompt_ids)
    settings = {
        "block_size": bs, "trained_block_size": trained_bs, "max_new_tokens": eval_cfg["max_new_tokens"],
        "temperature": temperature, "draft_sampling": "greedy", "thinking": thinking, "seed": eval_cfg["seed"],
        "device": dev, "backend": "transformers", "batch_size": 1,
        "dtype": str(module_dtype(target)).replace("torch.", ""),
    }
    loop = dict(block_size=bs, max_new_tokens=eval_cfg["max_new_tokens"], temperature=temperature,
                seed=eval_cfg["seed"], thinking=thinking, stop_token_ids=stops)
    return EvalSession(target, tok, probe, eval_cfg, dev, sets, set_info, settings, loop)


def load_eval_drafter(session: EvalSession, label: str, ckpt: Optional[str | Path]) -> tuple[M.DFlashDrafter, dict]:
    """A drafter checkpoint (None: an untrained random init, the floor) in the target's dtype, and its
    :func:`checkpoint_info`.

    Raises:
        ValueError: ``eval.block_size`` exceeds the drafter's trained block size.
    """
    from .target import drafter_dtype
    from .train import build_drafter

    dt = drafter_dtype(session.target)
    if ckpt is None:
        drafter, info = build_drafter(session.target, session.probe, seed=session.eval_cfg["seed"]), {
            "train_steps": 0, "zero_target_features": False}
    else:
        drafter, info = M.load_drafter(ckpt, dtype=dt, device=session.device), checkpoint_info(ckpt)
    bs = session.loop["block_size"]
    if bs > drafter.block_size:
        raise ValueError(f"eval.block_size {bs} exceeds drafter {label}'s trained block size {drafter.block_size}")
    return drafter.to(device=session.device, dtype=dt).eval(), info


def run_drafters(session: EvalSession, drafters: dict[str, Optional[str | Path]], *, target_dir=None) -> dict:
    """The eval record (schema ``EVAL_SCHEMA_VERSION``): τ of every drafter on every eval set, plus
    ``tau_over_untrained`` when an ``untrained`` floor is among them."""
    probe, sets = session.probe, session.sets
    record: dict = {
        "schema_version": EVAL_SCHEMA_VERSION,
        "target": {"path": str(target_dir), "model_type": probe.get("model_type"), "architectures": probe.get("architectures")},
        "settings": session.settings,
        "sets": session.set_info,
        "drafters": {},
    }
    for label, ckpt in drafters.items():
        drafter, info = load_eval_drafter(session, label, ckpt)
        entry = {"checkpoint": str(ckpt) if ckpt else None, "train_steps": info["train_steps"],
                 "zero_target_features": info["zero_target_features"], "sets": {}}
        for set_name, prompts in sets.items():
            stats = run_eval_set(session.target, session.tokenizer, drafter, prompts,
                                 zero_target_features=info["zero_target_features"], **session.loop)
            entry["sets"][set_name] = stats
            print(f"[eval] {label:>14} {set_name:>10}: tau={stats['tau']:.3f} over {stats['num_responses']} responses "
                  f"({stats['seconds']:.1f} s)", flush=True)
        record["drafters"][label] = entry
    record["tau"] = {label: {s: e["sets"][s]["tau"] for s in sets} for label, e in record["drafters"].items()}
    if "untrained" in record["drafters"]:
        floor = record["tau"]["untrained"]
        record["tau_over_untrained"] = {
            label: {s: taus[s] / max(1e-9, floor[s]) for s in sets} for label, taus in record["tau"].items() if label != "untrained"
        }
        if "trained" in record["tau_over_untrained"]:
            record["trained_over_untrained"] = record["tau_over_untrained"]["trained"]
    return record


def run_checkpoint_series(session: EvalSession, checkpoint_series: dict[int, str | Path]) -> dict:
    """τ of each checkpoint (step → dir) on the first ``eval.checkpoint_samples`` prompts of every set."""
    n = int(session.eval_cfg.get("checkpoint_samples", 8))
    subsets = {name: prompts[:n] for name, prompts in session.sets.items()} if n > 0 else {}
    series = {"schema_version": EVAL_SCHEMA_VERSION, "settings": session.settings,
              "num_prompts": {s: len(p) for s, p in subsets.items()}, "points": []}
    for step, ckpt in (sorted(checkpoint_series.items()) if subsets else []):
        drafter, info = load_eval_drafter(session, f"step {step}", ckpt)
        point = {"step": int(step), "checkpoint": str(ckpt), "sets": {}}
        for set_name, prompts in subsets.items():
            st = run_eval_set(session.target, session.tokenizer, drafter, prompts,
                              zero_target_features=info["zero_target_features"], **session.loop)
            point["sets"][set_name] = {k: st[k] for k in ("tau", "num_responses", "num_steps", "tokens_per_target_forward")}
        series["points"].append(point)
        print(f"[eval] step {step:>6}: " + " ".join(f"{s}={v['tau']:.2f}" for s, v in point["sets"].items()), flush=True)
    return series


def write_eval_outputs(record: dict, out_json: str | Path, *, plot_png=None, table_tsv=None) -> None:
    """Write the eval record JSON (atomic), and the PNG plot / TSV table when asked."""
    write_json(out_json, record, skip_if_identical=False)
    if plot_png is not None:
        plot_acceptance(record, plot_png)
    if table_tsv is not None:
        write_eval_table(record, table_tsv)


def evaluate(
    *,
    target_dir: str | Path,
    probe: dict,
    drafters: dict[str, Optional[str | Path]],
    eval_cfg: dict,
    thinking: str,
    out_json: str | Path,
    plot_png: Optional[str | Path] = None,
    chat_template: Optional[str | Path] = None,
    trust_remote_code: bool = False,
    target_dtype: str = "auto",
    exclude_prompt_ids: Iterable[str] = (),
    table_tsv: Optional[str | Path] = None,
    checkpoint_series: Optional[dict[int, str | Path]] = None,
    series_json: Optional[str | Path] = None,
    series_png: Optional[str | Path] = None,
    train_log: Optional[str | Path] = None,
) -> dict:
    """Run the speculative loop for every drafter (label → checkpoint dir, or None for an untrained
    random-init drafter as a floor) on every eval set; write the eval record JSON (+ a PNG plot, a TSV
    table). A checkpoint trained with zeroed target features (``checkpoint_info``) is fed zeros here too.

    ``exclude_prompt_ids``: training prompts, never drawn as eval prompts (see :func:`load_eval_sets`).
    ``checkpoint_series`` (step → checkpoint, e.g. :func:`step_checkpoints` plus ``final``): τ of each on
    the first ``eval.checkpoint_samples`` prompts of every set, written to ``series_json`` and plotted to
    ``series_png`` (with the train-time EAL proxy from ``train_log`` when given).
    Running: :func:`open_session`, :func:`run_drafters`, :func:`run_checkpoint_series`; writing:
    :func:`write_eval_outputs`, :func:`plot_tau_vs_step`.
    """
    session = open_session(target_dir=target_dir, probe=probe, eval_cfg=eval_cfg, thinking=thinking,
                           chat_template=chat_template, trust_remote_code=trust_remote_code,
                           target_dtype=target_dtype, exclude_prompt_ids=exclude_prompt_ids)
    record = run_drafters(session, drafters, target_dir=target_dir)
    write_eval_outputs(record, out_json, plot_png=plot_png, table_tsv=table_tsv)
    if checkpoint_series is not None and series_json is not None:
        series = run_checkpoint_series(session, checkpoint_series)
        write_json(series_json, series, skip_if_identical=False)
        if series_png is not None:
            plot_tau_vs_step(series, series_png, train_log=train_log)
    return record


# ---------------------------------------------------------------------------------------------------
# Comparing records
# ---------------------------------------------------------------------------------------------------


def check_comparable(records: Mapping[str, dict]) -> str:
    """Return the common thinking mode of eval records (name → record).

    Raises:
        EvalComparisonError: the records were produced under different thinking modes (τ with and without
            thinking measure different text; comparing them is meaningless), or one does not say.
    """
    modes = {name: (r.get("settings") or {}).get("thinking") for name, r in records.items()}
    missing = [n for n, m in modes.items() if m is None]
    if missing:
        raise EvalComparisonError(f"eval record(s) {missing} do not record `settings.thinking`; re-run the eval stage")
    if len(set(modes.values())) > 1:
        detail = ", ".join(f"{n}: thinking={m}" for n, m in modes.items())
        raise EvalComparisonError(
            f"refusing to compare eval records produced under different thinking modes ({detail}); "
            "evaluate every drafter with the same `generation.thinking`"
        )
    return next(iter(modes.values())) if modes else "none"


def merge_eval_records(records: Mapping[str, dict]) -> dict:
    """Side-by-side record of several eval records (name → record): drafters become ``<name>/<label>``,
    each keeping the settings it was measured under. Refuses mixed thinking modes (:func:`check_comparable`).
    """
    thinking = check_comparable(records)
    merged: dict = {"schema_version": EVAL_SCHEMA_VERSION, "thinking": thinking, "drafters": {}, "settings": {}}
    for name, rec in records.items():
        merged["settings"][name] = rec["settings"]
        for label, entry in rec["drafters"].items():
            merged["drafters"][f"{name}/{label}"] = {**entry, "settings": rec["settings"]}
    return merged


TABLE_COLUMNS = (
    "drafter", "set", "tau", "tau_over_untrained", "tokens_per_target_forward", "accept_pos1", "num_responses",
    "num_steps", "thinking", "temperature", "block_size", "max_new_tokens", "train_steps", "zero_target_features",
    "checkpoint",
    "tau_pooled", "engine_tau", "engine_agrees",  # engine τ (evaluate_engine): pooled over steps, both sides
)


def eval_table_rows(record: dict) -> list[dict]:
    """One row per (drafter, set) with τ and the settings that produced it (:data:`TABLE_COLUMNS`)."""
    rows = []
    ratios = record.get("tau_over_untrained") or {}
    for label, entry in record["drafters"].items():
        st = entry.get("settings") or record["settings"]
        for set_name, s in entry["sets"].items():
            pos = s.get("per_position_acceptance") or []
            rows.append({
                "drafter": label, "set": set_name, "tau": round(s["tau"], 3),
                "tau_over_untrained": round(ratios[label][set_name], 2) if label in ratios else "",
                "tokens_per_target_forward": round(s.get("tokens_per_target_forward", 0.0), 3),
                "accept_pos1": round(pos[0], 3) if pos else "", "num_responses": s["num_responses"],
                "num_steps": s["num_steps"], "thinking": st["thinking"], "temperature": st["temperature"],
                "block_size": st["block_size"], "max_new_tokens": st["max_new_tokens"],
                "train_steps": entry.get("train_steps", ""), "zero_target_features": entry.get("zero_target_features", ""),
                "checkpoint": entry.get("checkpoint") or "(random init)",
                **_engine_columns(s),
            })
    return rows


def _engine_columns(s: dict) -> dict:
    """``tau_pooled`` (mean a+1 over verify steps), ``engine_tau`` and ``engine_agrees`` of one set's stats."""
    eng = s.get("engine") or {}
    return {"tau_pooled": round(s.get("tokens_per_step", 0.0), 3), "engine_tau": round(eng["tau"], 3) if eng else "",
            "engine_agrees": {True: "yes", False: "NO", None: "?"}[eng.get("agrees")] if eng else ""}


def write_eval_table(record: dict, path: str | Path) -> None:
    """TSV of :func:`eval_table_rows` (the report shows it as a table)."""
    write_tsv(path, TABLE_COLUMNS, eval_table_rows(record))




# ---------------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    _pyplot().close(fig)


def plot_acceptance(record: dict, path: str | Path) -> None:
    """PNG: per-position acceptance (k = 1..B−1), one panel per eval set, one line per drafter, τ in the legend."""
    plt = _pyplot()
    set_names = list(next(iter(record["drafters"].values()))["sets"]) if record["drafters"] else []
    n = max(1, len(set_names))
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.8), dpi=110, squeeze=False)
    for ax, set_name in zip(axes[0], set_names or [None]):
        for label, entry in record["drafters"].items():
            s = entry["sets"].get(set_name)
            if s is None:
                continue
            ks = list(range(1, len(s["per_position_acceptance"]) + 1))
            ax.plot(ks, s["per_position_acceptance"], marker="o", label=f"{label} (τ={s['tau']:.2f})")
        ax.set_title(set_name or "")
        ax.set_xlabel("draft position k")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("P(accepted ≥ k)")
    st = record["settings"]
    fig.suptitle(f"DFlash acceptance — block {st['block_size']}, T={st['temperature']}, thinking={st['thinking']}", fontsize=10)
    _save(fig, path)


def read_train_log(path: str | Path) -> list[dict]:
    """Records of a ``train_log.jsonl`` (empty when the file does not exist)."""
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


def plot_tau_vs_step(series: dict, path: str | Path, *, train_log: Optional[str | Path] = None) -> None:
    """PNG: τ per eval set across the intermediate checkpoints; the train-time EAL proxy (dashed) beside it."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    pts = series["points"]
    set_names = list(pts[0]["sets"]) if pts else []
    for set_name in set_names:
        ax.plot([p["step"] for p in pts], [p["sets"][set_name]["tau"] for p in pts], marker="o",
                label=f"τ {set_name} (n={series['num_prompts'].get(set_name, '?')})")
    log = read_train_log(train_log) if train_log else []
    if log:
        ax.plot([r["step"] for r in log], [r["eal"] for r in log], ls="--", color="gray", label="train EAL proxy")
    if not pts and not log:
        ax.text(0.5, 0.5, "no intermediate checkpoints", ha="center", va="center", transform=ax.transAxes)
    st = series["settings"]
    ax.set_xlabel("training step")
    ax.set_ylabel("acceptance length τ")
    ax.set_ylim(bottom=0.9)
    ax.set_title(f"τ across checkpoints — block {st['block_size']}, T={st['temperature']}, thinking={st['thinking']}", fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    _save(fig, path)


def plot_validation(val_log: str | Path, path: str | Path, *, placeholder: bool = False) -> None:
    """PNG of held-out τ vs optimizer step from the trainer's ``val_log.jsonl``: the per-block simulator
    (:mod:`dflash_pipeline.validation`) and the product of marginal slot accuracies beside it.

    Without records nothing is written, unless ``placeholder`` (the report's figure): then a figure saying
    that the run had no held-out validation (``train.validation_fraction: 0``)."""
    val_log, path = Path(val_log), Path(path)
    recs = [json.loads(x) for x in val_log.read_text(encoding="utf-8").splitlines() if x.strip()] if val_log.is_file() else []
    if not recs and not placeholder:
        return
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if recs:
        ax.plot([r["step"] for r in recs], [r["tau"] for r in recs], marker="o", label="held-out τ (per-block simulator)")
        ax.plot([r["step"] for r in recs], [r["tau_marginal"] for r in recs], ls="--", label="product of marginal accuracies")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no held-out validation in this run\n(train.validation_fraction: 0)", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("τ (accepted tokens / block)")
    fig.tight_layout()
    _save(fig, path)


def plot_training(train_logs: Mapping[str, str | Path], path: str | Path) -> None:
    """PNG: training loss and EAL proxy vs step, one line per run (label → ``train_log.jsonl``)."""
    plt = _pyplot()
    fig, (ax_loss, ax_eal) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
    for label, log_path in train_logs.items():
        log = read_train_log(log_path)
        if not log:
            continue
        steps = [r["step"] for r in log]
        ax_loss.plot(steps, [r["loss"] for r in log], label=label)
        ax_eal.plot(steps, [r["eal"] for r in log], label=label)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("decayed CE loss")
    ax_loss.set_yscale("log")
    ax_eal.set_xlabel("step")
    ax_eal.set_ylabel("EAL proxy (from slot accuracy)")
    for ax in (ax_loss, ax_eal):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("Training curves (train_log.jsonl)", fontsize=10)
    _save(fig, path)


def main(argv=None) -> None:
    """CLI: ``python -m dflash_pipeline.evaluate --probe P --target T --eval-config JSON --out X [--drafter label=dir]…``
    (``python -m dflash_pipeline.evaluate server …`` measures τ on a running server: :func:`server_main`)."""
    import argparse
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["server"]:  # moved to evaluate_engine (engine τ)
        from .evaluate_engine import main as server_main

        server_main(argv[1:])
        return

    p = argparse.ArgumentParser(description="Measure DFlash acceptance length τ with a speculative loop.")
    p.add_argument("--probe", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--eval-config", required=True, help="JSON of the validated `eval` config")
    p.add_argument("--thinking", default="disable")
    p.add_argument("--drafter", action="append", default=[], help="label=checkpoint_dir (label=untrained for a random init)")
    p.add_argument("--out", required=True)
    p.add_argument("--plot")
    p.add_argument("--target-dtype", default="auto", help="target.dtype (auto: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--trust-remote-code", action="store_true", help="target.trust_remote_code")
    a = p.parse_args(argv)
    drafters = {}
    for item in a.drafter:
        label, _, path = item.partition("=")
        drafters[label] = None if path in ("", "untrained") else path
    evaluate(
        target_dir=a.target, probe=json.loads(Path(a.probe).read_text()), drafters=drafters,
        eval_cfg=json.loads(a.eval_config), thinking=a.thinking, out_json=a.out, plot_png=a.plot,
        target_dtype=a.target_dtype, trust_remote_code=a.trust_remote_code,
    )


if __name__ == "__main__":
    main()
