"""GPU check of the DFlash2 kernels our CPU parity cannot run: vLLM's Triton grouped convolution and
candidate walk against our plain-torch versions (run with a CUDA vLLM environment's python, from the repo
root: ``$DFLASH_VLLM_PYTHON bench/gpu_family_kernels.py``; bench/gpu_check.sh calls it).

* ``qwen3_dflash2.dflash2_grouped_conv_impl`` (Triton, ``qwen3_dflash2.py:25-113``) vs
  :func:`dflash_pipeline.drafter.dflash2.grouped_conv`, on many blocks of B rows with a strided ``delta``
  (the kernel reads ``kernel_projection``'s output through a view, as ``DFlashGroupedConv.prepare`` does);
* ``dflash2/speculator.CandidateSampler.sample`` at temperature 0 (Triton ``_selector_walk_kernel``) vs
  :func:`dflash_pipeline.drafter.dflash2.walk`.

Prints the max |Δ| and exits 1 when either misses (fp32 tolerance 1e-5; the walk must match exactly).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main() -> int:
    from vllm.model_executor.models.qwen3_dflash2 import dflash2_grouped_conv_impl
    from vllm.v1.worker.gpu.spec_decode.dflash2.speculator import CandidateSampler

    from dflash_pipeline.drafter.dflash2_model import grouped_conv, walk

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    ok = True
    for block_size, hidden, group, taps, blocks in ((16, 4096, 16, 2, 8), (8, 2560, 16, 2, 33), (5, 1024, 8, 3, 7)):
        rows = block_size * blocks
        x = torch.randn(rows, hidden, device=dev, generator=g)
        coef = torch.randn(rows, 2, taps, hidden // group, device=dev, generator=g)
        base = torch.randn(taps, hidden, device=dev, generator=g)
        theirs = dflash2_grouped_conv_impl(x, coef[:, 0], base, block_size, group)
        ours = grouped_conv(x.unsqueeze(0), coef[:, 0].unsqueeze(0), base, block_size, group)[0]
        diff = float((theirs - ours).abs().max())
        print(f"grouped conv B={block_size} H={hidden} group={group} taps={taps}: max |Δ| {diff:.2e}")
        ok &= diff < 1e-5
    n, steps, k = 6, 7, 16
    scores = torch.randn(n, steps, k, k, device=dev, generator=g)
    cand = torch.randint(0, 151936, (n, steps, k), device=dev, generator=g)
    sampler = CandidateSampler(n, steps, k, dev)
    tokens = torch.zeros(n, steps, dtype=torch.int64, device=dev)
    sampler.sample(
        cand,
        scores,
        n,
        torch.arange(1, n * steps + 1, device=dev, dtype=torch.int64),
        torch.arange(n, device=dev, dtype=torch.int32).repeat_interleave(steps),
        torch.zeros(n, device=dev),
        torch.zeros(n, dtype=torch.int64, device=dev),
        tokens,
        None,
        False,
    )
    same = torch.equal(tokens, walk(scores, cand))
    print(f"candidate walk (greedy, {n} requests × {steps} steps, top-{k}): equal {same}")
    return 0 if ok and same else 1


if __name__ == "__main__":
    sys.exit(main())
