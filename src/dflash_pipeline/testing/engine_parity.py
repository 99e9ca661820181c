"""Engine parity for every family: our drafter's logits against vLLM's own DFlash drafter code.

`family_case` exports the drafter the pipeline builds for a zoo twin (every RMSNorm weight randomised,
fp32) and runs our eval path (`DFlashDrafter.draft_block`); `.vllm_replay` loads the same export with
`DFlashQwen3ForCausalLM` and computes the same steps. `compare` checks max |Δlogit| < `ATOL` and equal
argmax. `rope_case` compares `DFlashRotaryEmbedding` with vLLM's `get_rope` on real configs.
Negative controls (`mistake`: `full_rotary`, `scaled_embedding`, `ctx_pos_off_by_one`) must miss by more
than `CONTROL_MIN_DIFF`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

#: fp32 logit agreement (tests/e2e/test_engine_parity.py's ATOL; feasibility.md §9 measured ~1e-6).
ATOL = 2e-4
#: A negative control must miss by at least this much (≫ ATOL).
CONTROL_MIN_DIFF = 1e-2
#: Block size and context lengths of the draft steps (one growing context: the cache path is exercised).
BLOCK_SIZE = 4
CONTEXT_LENGTHS = (5, 9, 14)
#: Positions of the rope comparison (long ones: where yarn / llama3 scaling and partial rotary differ).
ROPE_POSITIONS = (0, 1, 7, 100, 990, 1000, 4095, 30000)
REPLAY_SCRIPT = Path(__file__).with_name("vllm_replay.py")


def _randomise_norms(drafter, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))


def surrogate_target(out: Path, *, hidden_size: int, vocab_size: int, num_layers: int) -> Path:
    """A config-only Qwen3 target for vLLM's `ModelConfig`. Returns `out`."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": max(2, hidden_size // 4),
        "intermediate_size": 2 * hidden_size,
        "max_position_embeddings": 512,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n", encoding="utf-8")
    return out


def family_case(
    twin: Path, work: Path, *, name: str, seed: int = 0, drafter_dir: Path | None = None, mistakes: tuple[str, ...] = ()
) -> dict:
    """Export the family's drafter, compute our logits and write vLLM's inputs. Returns `{"case": spec entry, "ours":
    [logits [B, V]…], "controls": {mistake: [logits…]}, "facts": {...}}`.

    Raises whatever the probe or the target loader raise for a family the pipeline refuses.
    """
    from safetensors.torch import save_file

    from dflash_pipeline.drafter import build as DB
    from dflash_pipeline.drafter import model as M
    from dflash_pipeline.features.weights import load_embed_and_head
    from dflash_pipeline.probe import probe_target
    from dflash_pipeline.target import loading as T
    from dflash_pipeline.train.run import build_drafter

    work.mkdir(parents=True, exist_ok=True)
    target = T.load_target(twin, dtype="float32", device="cpu")
    tc = T.text_config(target.config)
    n = T.num_decoder_layers(target)
    probe = probe_target(twin, block_size=BLOCK_SIZE, num_draft_layers=1, target_layer_ids=[1, n - 2])
    if drafter_dir is None:
        drafter = build_drafter(target, probe, seed=seed)
        _randomise_norms(drafter, seed + 1)
        drafter_dir = work / "drafter"
        M.save_drafter(drafter, drafter_dir, dtype=torch.float32)
    drafter = DB.load_drafter(drafter_dir, dtype=torch.float32).eval()
    k_h = len(drafter.target_layer_ids) * drafter.config.hidden_size
    g = torch.Generator().manual_seed(seed + 2)
    feats = torch.randn(max(CONTEXT_LENGTHS), k_h, generator=g)
    bonus = torch.randint(0, 64, (len(CONTEXT_LENGTHS),), generator=g)  # ordinary text tokens
    raw_embed, raw_head = load_embed_and_head(
        twin, tie_word_embeddings=probe.get("tie_word_embeddings"), dtype=torch.float32
    )
    inputs = {"embed": raw_embed.weight.clone(), "head": raw_head.weight.clone()}
    for j, c in enumerate(CONTEXT_LENGTHS):
        block = torch.full((BLOCK_SIZE,), drafter.mask_token_id, dtype=torch.long)
        block[0] = bonus[j]
        inputs[f"s{j}.features"] = feats[:c].clone()
        inputs[f"s{j}.block_ids"] = block
    save_file(inputs, str(work / "inputs.safetensors"))
    embed, head = T.input_embeddings(target), T.lm_head(target)
    ours = _draft_steps(drafter, embed, head, feats, bonus)
    controls = {}
    for mistake in mistakes:
        controls[mistake] = _control(mistake, drafter, target, embed, head, feats, bonus)
    surrogate = surrogate_target(
        work / "surrogate-target",
        hidden_size=int(tc.hidden_size),
        vocab_size=int(drafter.config.vocab_size),
        num_layers=n,
    )
    facts = {
        "rotary_dim": int(drafter.rotary_emb.rotary_dim),
        "head_dim": int(drafter.config.head_dim),
        "rope_type": drafter.config.rope_parameters.get("rope_type"),
        "embedding_module": type(target.get_input_embeddings()).__name__,
    }
    return {
        "case": {
            "name": name,
            "drafter": str(drafter_dir),
            "target": str(surrogate),
            "inputs": str(work / "inputs.safetensors"),
        },
        "ours": ours,
        "controls": controls,
        "facts": facts,
    }


@torch.no_grad()
def _draft_steps(drafter, embed, head, feats, bonus, *, pos_offset: int = 0) -> list[torch.Tensor]:
    """Our logits [B, V] per step: `draft_block` with one context cache over the growing context."""
    from dflash_pipeline.drafter import model as M

    cache = M.DraftContextCache(len(drafter.layers))
    out = []
    for j, c in enumerate(CONTEXT_LENGTHS):
        if pos_offset:  # whole-context forward with shifted context positions (a negative control)
            block = torch.full((1, BLOCK_SIZE), drafter.mask_token_id, dtype=torch.long)
            block[0, 0] = bonus[j]
            hidden = drafter(
                embed(block), feats[None, :c], torch.arange(c)[None] + pos_offset, torch.arange(c, c + BLOCK_SIZE)[None]
            )
            out.append(head(hidden)[0].float())
            continue
        new = feats[cache.length : c][None]
        out.append(drafter.draft_block(embed, head, bonus[j : j + 1], new, c, cache, BLOCK_SIZE)[0].float())
    return out


def _control(mistake: str, drafter, target, embed, head, feats, bonus) -> list[torch.Tensor]:
    if mistake == "ctx_pos_off_by_one":
        return _draft_steps(drafter, embed, head, feats, bonus, pos_offset=1)
    if mistake == "scaled_embedding":
        return _draft_steps(drafter, target.get_input_embeddings(), head, feats, bonus)
    if mistake == "full_rotary":
        from dflash_pipeline.drafter.rope import DFlashRotaryEmbedding

        cfg = drafter.config.__class__.from_dict(drafter.config.to_dict())
        cfg.rope_parameters = {
            k: v for k, v in cfg.rope_parameters.items() if k not in ("partial_rotary_factor", "rope_dim")
        }
        own = drafter.rotary_emb
        drafter.rotary_emb = DFlashRotaryEmbedding(cfg)
        try:
            return _draft_steps(drafter, embed, head, feats, bonus)
        finally:
            drafter.rotary_emb = own
    raise ValueError(f"unknown negative control {mistake!r}")


def rope_case(name: str, drafter_config, work: Path, *, seed: int = 0) -> dict:
    """Our rotated q/k [N, heads·head_dim] at `ROPE_POSITIONS` (capped at the drafter's
    `max_position_embeddings` − 1) and vLLM's inputs for the same."""
    from safetensors.torch import save_file

    from dflash_pipeline.drafter.rope import DFlashRotaryEmbedding, apply_rope

    work.mkdir(parents=True, exist_ok=True)
    hd, nh, nkv = int(drafter_config.head_dim), 2, 1
    g = torch.Generator().manual_seed(seed)
    top = int(drafter_config.max_position_embeddings) - 1  # vLLM's cos/sin cache ends there
    pos = torch.tensor(sorted({min(p, top) for p in ROPE_POSITIONS}))
    q, k = torch.randn(len(pos), nh * hd, generator=g), torch.randn(len(pos), nkv * hd, generator=g)
    save_file({"positions": pos, "q": q, "k": k}, str(work / f"{name}.safetensors"))
    rope = DFlashRotaryEmbedding(drafter_config)
    cos, sin = rope(q, pos[None])

    def ours(x, heads):
        return (
            apply_rope(x.view(1, len(pos), heads, hd).transpose(1, 2), cos, sin).transpose(1, 2).reshape(len(pos), -1)
        )

    return {
        "case": {
            "name": name,
            "head_dim": hd,
            "max_position": int(drafter_config.max_position_embeddings),
            "rope_parameters": dict(drafter_config.rope_parameters),
            "inputs": str(work / f"{name}.safetensors"),
        },
        "ours": {"q": ours(q, nh), "k": ours(k, nkv)},
        "rotary_dim": rope.rotary_dim,
    }


def run_vllm(vllm_python: str, out: Path, *, cases: list[dict], ropes: list[dict], timeout: int = 1800) -> dict:
    """Run every case in one vLLM-environment process; returns `{name: meta}` (`ok`, `error` …).

    Raises:
        RuntimeError: the process failed as a whole (its output tail in the message).
    """
    out.mkdir(parents=True, exist_ok=True)
    spec = {"out": str(out / "results"), "cases": cases, "ropes": ropes}
    (out / "spec.json").write_text(json.dumps(spec, indent=1), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # vLLM's env imports nothing of ours
    proc = subprocess.run(
        [vllm_python, str(REPLAY_SCRIPT), str(out / "spec.json")],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{REPLAY_SCRIPT.name} exited {proc.returncode}: {(proc.stdout + proc.stderr)[-4000:]}")
    res = {}
    for c in cases + ropes:
        p = out / "results" / f"{c['name']}.json"
        res[c["name"]] = json.loads(p.read_text()) if p.is_file() else {"ok": False, "error": "no result written"}
    return res


def vllm_tensors(out: Path, name: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "results" / f"{name}.safetensors"))


def max_logit_diff(ours: list[torch.Tensor], theirs: dict) -> float:
    """max over steps of max |ours − vLLM| (logits of every block slot)."""
    return max(float((o - theirs[f"s{j}.logits"]).abs().max()) for j, o in enumerate(ours))


def compare(ours: list[torch.Tensor], theirs: dict) -> tuple[bool, str]:
    """`(ok, summary)`: within `ATOL` and the same argmax on every mask slot."""
    diff = max_logit_diff(ours, theirs)
    same = all(torch.equal(o[1:].argmax(-1), theirs[f"s{j}.logits"][1:].argmax(-1)) for j, o in enumerate(ours))
    scale = max(float(theirs[f"s{j}.logits"].abs().max()) for j in range(len(ours)))
    return diff < ATOL and same, f"max |Δlogit| {diff:.2e} (scale {scale:.1f}), argmax equal: {same}"


if __name__ == "__main__":  # pragma: no cover - the zoo table drives this module
    sys.exit("use python -m dflash_pipeline.testing.zoo --table")


def engine_parity_column(families: dict[str, Path], work: Path, vllm_python: str | None) -> dict[str, str]:
    """The zoo table's `engine_parity` cell per family: `families` maps a family to its run directory. One vLLM
    process for all. Cells: `ok (max |Δlogit| …)`, `failed: …`, `skipped: …` (no export / no vLLM environment)."""
    if vllm_python is None:
        return {f: "skipped: no vLLM environment (DFLASH_VLLM_PYTHON)" for f in families}
    out, cases = {}, {}
    for fam, run in families.items():
        final = run / "train_float32" / "final"
        if not (final / "config.json").is_file():
            out[fam] = "skipped: no trained export"
            continue
        try:
            cases[fam] = family_case(run / "target", work / fam, name=f"family-{fam}", drafter_dir=final)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            out[fam] = f"failed: {type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
    if cases:
        res = run_vllm(vllm_python, work / "vllm", cases=[c["case"] for c in cases.values()], ropes=[])
        for fam, c in cases.items():
            meta = res[c["case"]["name"]]
            if not meta["ok"]:
                out[fam] = f"failed: {meta['error'][:160]}"
                continue
            ok, summary = compare(c["ours"], vllm_tensors(work / "vllm", c["case"]["name"]))
            out[fam] = ("ok" if ok else "failed") + f" ({summary.split(',')[0]})"
    return out
