"""vLLM's own DFlash drafter code on recorded inputs, many drafters in one process, no engine.

Run in vLLM's environment as a file (`.venv-vllm/bin/python …/vllm_replay.py SPEC.json`): it imports
only the standard library, torch, safetensors and vLLM. Used by `testing.engine_parity`.

Each drafter case builds vLLM's `DFlashQwen3ForCausalLM` as the engine does (`EngineArgs` with
`speculative_config={"method": "dflash", ...}`, `load_weights` + `process_weights_after_loading`), shares
the target's embedding and LM head as `llm_base_proposer._maybe_share_embeddings` does, and runs one draft
step per recorded step as `DFlashProposer` does. Only the paged-attention kernel is replaced: the block's
queries attend non-causally to [context ‖ block] with SDPA (the kernel is compared through the full engine
in `tests/e2e/test_engine_parity.py`). Rope cases run `get_rope(head_dim, max_position, True,
rope_parameters)` on given positions / q / k.

SPEC.json: `{"out": DIR, "target": DIR (config only), "cases": [{"name", "drafter": DIR, "target": DIR
(optional), "inputs": FILE}], "ropes": [{"name", "head_dim", "max_position", "rope_parameters", "inputs":
FILE}]}`. Case inputs: `embed` [V, H], `head` [V, H], per step j `s{j}.features` [C, K·H] and
`s{j}.block_ids` [B]. Writes `OUT/<name>.safetensors` with `s{j}.logits` [B, V] float32 (or `q`/`k`) and
`OUT/<name>.json` with `ok` and, on failure, `error` (one failing case does not stop the others).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dflash_pipeline.core.procs import free_port


class ContextKV:
    """Stands in for a layer's attention impl: keeps the context K/V vLLM writes to the cache."""

    def __init__(self):
        self.k = None
        self.v = None

    def do_kv_cache_update(self, attn, key, value, kv_cache, slot_mapping):
        self.k, self.v = key.clone(), value.clone()


class BlockAttention(torch.nn.Module):
    """Non-causal attention of the block's queries over [context ‖ block] (DFlash, dflash.md §2.2)."""

    def __init__(self, ctx: ContextKV, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.ctx, self.nh, self.nkv, self.hd, self.scale = ctx, num_heads, num_kv_heads, head_dim, scale

    def forward(self, q, k, v):
        t = q.shape[0]
        q = q.view(t, self.nh, self.hd).transpose(0, 1)
        kk = torch.cat([self.ctx.k.view(-1, self.nkv, self.hd), k.view(t, self.nkv, self.hd)]).transpose(0, 1)
        vv = torch.cat([self.ctx.v.view(-1, self.nkv, self.hd), v.view(t, self.nkv, self.hd)]).transpose(0, 1)
        out = F.scaled_dot_product_attention(q[None], kk[None], vv[None], scale=self.scale, enable_gqa=True)[0]
        return out.transpose(0, 1).reshape(t, -1)


_DIST = {"done": False}


def _engine_config(target: str, drafter: str, block_size: int):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=target,
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        skip_tokenizer_init=True,
        seed=0,
        speculative_config={"method": "dflash", "model": drafter, "num_speculative_tokens": int(block_size) - 1},
    )
    return args.create_engine_config()


def _init_dist(vc) -> None:
    if _DIST["done"]:
        return
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"tcp://127.0.0.1:{free_port()}"
    )
    initialize_model_parallel(1, 1)
    _DIST["done"] = True


def run_case(case: dict, default_target: str, out_dir: str) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.registry import ModelRegistry

    with open(os.path.join(case["drafter"], "config.json")) as fh:
        drafter_cfg = json.load(fh)
    vc = _engine_config(case.get("target", default_target), case["drafter"], drafter_cfg["block_size"])
    inputs = load_file(case["inputs"])
    with set_current_vllm_config(vc):
        _init_dist(vc)
        dmc = vc.speculative_config.draft_model_config
        cls, arch = ModelRegistry.resolve_model_cls(dmc.architectures, model_config=dmc)
        model = cls(vllm_config=vc)
        model.load_weights(load_file(os.path.join(case["drafter"], "model.safetensors")).items())
        # the target's embedding and LM head, shared as _maybe_share_embeddings / the lm_head sharing do
        model.model.embed_tokens.weight.data.copy_(inputs["embed"])
        model.lm_head.weight.data.copy_(inputs["head"])
        process_weights_after_loading(model, dmc, torch.device("cpu"))
        layers = model.model._attn_layers
        ctxs = []
        for attn_layer in layers:
            c = ContextKV()
            attn_layer.impl = c
            ctxs.append(c)
        for layer, c in zip(model.model.layers, ctxs):
            sa = layer.self_attn
            sa.attn = BlockAttention(c, sa.num_heads, sa.num_kv_heads, sa.head_dim, sa.scaling)
        out = {}
        j = 0
        with torch.inference_mode():
            while f"s{j}.features" in inputs:
                feats = inputs[f"s{j}.features"].float()
                ids = inputs[f"s{j}.block_ids"].long()
                n = feats.shape[0]
                ctx = model.combine_hidden_states(feats)
                model.precompute_and_store_context_kv(
                    ctx, torch.arange(n), [torch.zeros(n, dtype=torch.long)] * len(layers)
                )
                hidden = model(ids, torch.arange(n, n + ids.shape[0]))
                out[f"s{j}.logits"] = model.compute_logits(hidden).float().contiguous()
                j += 1
    save_file(out, os.path.join(out_dir, f"{case['name']}.safetensors"))
    return {
        "ok": True,
        "steps": j,
        "class": cls.__name__,
        "architecture": arch,
        "rope": type(model.model.layers[0].self_attn.rotary_emb).__name__,
        "rotary_dim": int(model.model.layers[0].self_attn.rotary_emb.rotary_dim),
    }


def run_rope(case: dict, out_dir: str) -> dict:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    inputs = load_file(case["inputs"])
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            int(case["head_dim"]),
            max_position=int(case["max_position"]),
            is_neox_style=True,
            rope_parameters=case["rope_parameters"],
            dtype=torch.float32,
        )
        pos = inputs["positions"].long()
        q, k = rope(pos, inputs["q"].float().clone(), inputs["k"].float().clone())
    save_file({"q": q.contiguous(), "k": k.contiguous()}, os.path.join(out_dir, f"{case['name']}.safetensors"))
    return {"ok": True, "class": type(rope).__name__, "rotary_dim": int(rope.rotary_dim)}


def main() -> None:
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    os.makedirs(spec["out"], exist_ok=True)
    jobs = [("rope", c) for c in spec.get("ropes", [])] + [("case", c) for c in spec.get("cases", [])]
    for kind, case in jobs:
        try:
            meta = run_rope(case, spec["out"]) if kind == "rope" else run_case(case, spec.get("target"), spec["out"])
        except Exception as exc:  # noqa: BLE001 - reported per case, the others still run
            meta = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        with open(os.path.join(spec["out"], f"{case['name']}.json"), "w") as fh:
            json.dump(meta, fh)
        print(f"[vllm-replay] {kind} {case['name']}: {'ok' if meta['ok'] else meta['error'][:200]}", flush=True)


if __name__ == "__main__":
    main()
