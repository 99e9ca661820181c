"""Logit parity with vLLM's own DFlash2 and DSpark model code (CPU build, fp32), one engine process for both.

vLLM runs the demo target with our exported drafter (tests/e2e/vllm_family_capture.py): vLLM's model file
builds the drafter from our ``config.json`` and weights, runs the backbone (DFlash2: with its grouped
convolutions, plain-torch path) on every draft step and then its own family heads on its own hidden states.
Our drafter (``block_hidden`` with its context cache, the eval loop's path) gets the same features,
positions and block and must produce the same hidden states, logits, candidates, selector scores,
confidences and drafts to fp32 rounding. The DFlash2 walk and the DSpark left-to-right loop are GPU-runner
code (Triton); the capture reproduces them in plain torch after the kernel's arithmetic (its docstring), and
``bench/gpu_check.sh`` runs the real kernels against the same reference when a GPU is lent.

Drafters (random init, every parameter the family adds randomised, so an identity-initialised convolution
or a zero Markov head cannot hide a mistake), block size 4, target layers [1, 4]:
* DFlash2: two sliding-window layers (window 6, shorter than the prompts, non-causal), output multiplier
  1.3 and soft cap 5 (so their order matters), top-5 selector of rank 8; vLLM's context-key RMSNorm
  patched as in test_engine_parity.py (the CPU kernel's stacked-weight bug);
* DSpark: one layer, Markov rank 8, confidence head with the Markov embedding.

Negative controls (each must miss by far more than the tolerance on the same steps): DFlash2 — the
convolution's input and output kernels swapped, the soft cap before the multiplier, the selector's
predecessor taken from the same slot, sliding layers causal inside the block; DSpark — the Markov bias of
the anchor at every slot, the confidence head without the Markov embedding, DFlash's layout (drafts read
from slots 1..B−1).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]  # a demo target and one vLLM engine, two drafters

BLOCK_SIZE = 4
TARGET_LAYER_IDS = [1, 4]
ATOL = 2e-4
CONTROL_MIN_DIFF = 1e-2
DFLASH2 = {
    "conv_kernel_size": 2,
    "conv_group_size": 8,
    "selector_rank": 8,
    "selector_top_k": 5,
    "output_multiplier": 1.3,
    "final_logit_softcapping": 5.0,
}
DSPARK = {
    "markov_rank": 8,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
}


def make_drafter(target_dir: Path, out: Path, family: str, seed: int) -> Path:
    """Random-init ``family`` drafter for ``target_dir`` with every norm and family parameter randomised,
    exported fp32 to ``out``."""
    from transformers import AutoConfig, AutoTokenizer

    from dflash_pipeline.drafter import families as FA
    from dflash_pipeline.drafter import model as M

    tcfg = AutoConfig.from_pretrained(target_dir)
    tok = AutoTokenizer.from_pretrained(target_dir)
    two = family == "dflash2"
    cfg = M.drafter_config_from_target(
        tcfg,
        block_size=BLOCK_SIZE,
        num_draft_layers=2 if two else 1,
        target_layer_ids=TARGET_LAYER_IDS,
        mask_token_id=len(tok),
        layer_types=["sliding_attention"] * 2 if two else None,
        sliding_window=6 if two else None,
    )
    fam = FA.get(family)
    cfg = fam.make_config(cfg, DFLASH2 if two else DSPARK)
    torch.manual_seed(seed)
    drafter = fam.build(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
            elif any(part in name for part in ("_conv.", "markov_head.", "confidence_head.", "candidate_selector.")):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    M.save_drafter(drafter, out, dtype=torch.float32)
    return out


@pytest.fixture(scope="session")
def family_captures(demo_target, vllm_python, tmp_path_factory):
    """One vLLM engine process: both families' draft steps on three prompts."""
    from transformers import AutoTokenizer

    work = tmp_path_factory.mktemp("family_parity")
    drafters = {
        "dspark": make_drafter(demo_target, work / "dspark", "dspark", seed=3),
        "dflash2": make_drafter(demo_target, work / "dflash2", "dflash2", seed=4),
    }
    tok = AutoTokenizer.from_pretrained(demo_target)
    questions = [
        "Natalia sold clips to 48 of her friends. How many clips?",
        "Write a function that adds two numbers.",
        "What is the capital of France?",
    ]
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True, enable_thinking=False
        )
        for q in questions
    ]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    spec = {
        "target": str(demo_target),
        "out": str(work / "captures"),
        "prompts": prompts,
        "max_tokens": 12,
        "runs": [
            {"name": "dspark", "family": "dspark", "drafter": str(drafters["dspark"]), "block_size": BLOCK_SIZE},
            {
                "name": "dflash2",
                "family": "dflash2",
                "drafter": str(drafters["dflash2"]),
                "block_size": BLOCK_SIZE,
                "patch_k_norm": True,
            },
        ],
    }
    (work / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(
        [vllm_python, str(REPO / "tests" / "e2e" / "vllm_family_capture.py"), str(work / "spec.json")],
        capture_output=True,
        text=True,
        timeout=1500,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return {"target": demo_target, "dir": work / "captures", "drafters": drafters}


@pytest.fixture(scope="session")
def target_model(family_captures):
    from dflash_pipeline.target import load_target

    return load_target(family_captures["target"], dtype="float32", device="cpu")


def load_capture(caps: dict, name: str) -> tuple[dict, list[dict]]:
    from safetensors.torch import load_file

    meta = json.loads((caps["dir"] / f"{name}.json").read_text())
    tensors = load_file(str(caps["dir"] / f"{name}.safetensors"))
    steps = [
        {**s, **{k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"s{j}.")}}
        for j, s in enumerate(meta["steps"])
    ]
    return meta, steps


def our_hidden(drafter, target, steps: list[dict]):
    """Per step ``(our hidden [B, H], step)``: ``block_hidden`` with the context cache on vLLM's recorded
    features (kept by position: vLLM re-sends rejected positions, the cache holds the accepted ones)."""
    from dflash_pipeline.drafter import model as M

    embed = target.get_input_embeddings()
    prompt, cache, feats = None, None, {}
    for s in steps:
        if s["prompt"] != prompt:
            prompt, cache, feats = s["prompt"], M.DraftContextCache(len(drafter.layers)), {}
        for p, f in zip(s["ctx_positions"].tolist(), s["ctx_features"]):
            feats[p] = f
        start = int(s["block_positions"][0])
        assert s["block_positions"].tolist() == list(range(start, start + BLOCK_SIZE))
        assert s["block_ids"][1:].tolist() == [drafter.mask_token_id] * (BLOCK_SIZE - 1)
        new = torch.stack([feats[p] for p in range(cache.length, start)]).unsqueeze(0)
        with torch.no_grad():
            yield drafter.block_hidden(embed, s["block_ids"][:1], new, start, cache, BLOCK_SIZE)[0], s


def dflash2_outputs(drafter, lm_head, hidden, anchor, mistake=None) -> dict:
    """Our DFlash2 heads on our hidden [B, H] (``mistake``: ``softcap_first`` or ``predecessor_same_slot``)."""
    from dflash_pipeline.drafter import dflash2_model as D2

    h = hidden[1:]
    logits = lm_head(h)
    cand, unary = D2.unary_top_k(logits, drafter.top_k, drafter.output_multiplier, drafter.softcap)
    if mistake == "softcap_first":
        unary = torch.tanh(logits.gather(-1, cand) / drafter.softcap) * drafter.softcap * drafter.output_multiplier
    sel = drafter.candidate_selector
    if mistake == "predecessor_same_slot":
        scores = unary.unsqueeze(1) + sel.edge(h, cand, cand)
        scores = scores.unsqueeze(0)
    else:
        scores = sel.scores(h.unsqueeze(0), cand.unsqueeze(0), unary.unsqueeze(0), anchor)
    return {
        "base_logits": lm_head(hidden),
        "candidates": cand,
        "unary": unary,
        "scores": scores[0],
        "drafts": D2.walk(scores, cand.unsqueeze(0))[0],
    }


def dspark_outputs(drafter, lm_head, hidden, anchor, mistake=None) -> dict:
    """Our DSpark heads on our hidden [B, H], greedy left to right (``mistake``: ``anchor_bias``,
    ``confidence_without_markov`` or ``dflash_layout``)."""
    h = hidden
    if mistake == "dflash_layout":  # DFlash reads the drafts from the mask slots, one slot later
        h = torch.cat([hidden[1:], hidden[-1:]], dim=0)
    base = lm_head(h)
    prev, logits, drafts, embeds = anchor, [], [], []
    for i in range(h.shape[0]):
        step, e = drafter.step_logits(base[i : i + 1], anchor if mistake == "anchor_bias" else prev)
        prev = step.argmax(-1)
        logits.append(step[0])
        drafts.append(prev[0])
        embeds.append(e[0])
    e = torch.stack(embeds)
    if mistake == "confidence_without_markov":
        e = torch.zeros_like(e)
    conf = torch.sigmoid(drafter.confidence_head(h, e))
    return {"logits": torch.stack(logits), "drafts": torch.stack(drafts), "confidence": conf}


FIELDS = {"dflash2": ("base_logits", "unary", "scores"), "dspark": ("logits", "confidence")}


def compare(family: str, caps, target, mistake=None, swap_conv=False, causal_block=False) -> tuple[float, bool]:
    """(max |Δ| over every float output and step, whether every integer output matched)."""
    from dflash_pipeline.drafter import build as DB

    drafter = DB.load_drafter(caps["drafters"][family], dtype=torch.float32)
    if swap_conv:
        with torch.no_grad():
            for layer in drafter.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel.copy_(conv.base_kernel.flip(0))
    if causal_block:
        drafter.sliding_block_causal = True
    lm_head = target.get_output_embeddings()
    outputs = dflash2_outputs if family == "dflash2" else dspark_outputs
    worst, same = 0.0, True
    _, steps = load_capture(caps, family)
    for hidden, s in our_hidden(drafter, target, steps):
        ours = outputs(drafter, lm_head, hidden, s["block_ids"][:1], mistake)
        for key in FIELDS[family]:
            worst = max(worst, float((ours[key] - s[key]).abs().max()))
        same &= torch.equal(ours["drafts"], s["drafts"])
        if family == "dflash2":
            same &= torch.equal(ours["candidates"], s["candidates"])
    return worst, same


@pytest.mark.parametrize("family", ["dflash2", "dspark"])
def test_family_outputs_match_vllm(family_captures, target_model, family):
    from dflash_pipeline.drafter import build as DB

    meta, steps = load_capture(family_captures, family)
    assert len(steps) >= 10 and len({s["prompt"] for s in steps}) == 3, meta
    assert any(len(s["ctx_positions"]) > 1 and s["ctx_positions"][0] > 0 for s in steps)  # decode steps too
    assert any(int(s["block_positions"][0]) > 6 for s in steps)  # contexts longer than the DFlash2 window
    drafter = DB.load_drafter(family_captures["drafters"][family], dtype=torch.float32)
    hid = max(float((ours - s["hidden"]).abs().max()) for ours, s in our_hidden(drafter, target_model, steps))
    worst, same = compare(family, family_captures, target_model)
    print(
        f"{family}: {len(steps)} draft steps, max |Δhidden| {hid:.2e}, max |Δ| of the heads {worst:.2e}, "
        f"integer outputs equal: {same}"
    )
    assert hid < ATOL and worst < ATOL, (hid, worst)
    assert same


@pytest.mark.parametrize(
    "family,control",
    [
        ("dflash2", "swap_conv"),
        ("dflash2", "softcap_first"),
        ("dflash2", "predecessor_same_slot"),
        ("dflash2", "causal_block"),
        ("dspark", "anchor_bias"),
        ("dspark", "confidence_without_markov"),
        ("dspark", "dflash_layout"),
    ],
)
def test_family_parity_catches_a_deliberate_mistake(family_captures, target_model, family, control):
    kw = {"swap_conv": control == "swap_conv", "causal_block": control == "causal_block"}
    mistake = None if control in kw else control
    miss, _ = compare(family, family_captures, target_model, mistake=mistake, **kw)
    print(f"{family} {control}: max |Δ| {miss:.2e}")
    assert miss > CONTROL_MIN_DIFF
