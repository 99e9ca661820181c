#!/usr/bin/env bash
# One-shot GPU check (< 5 min on one H200): bf16 + FlexAttention training step of a Qwen3-8B-sized drafter
# (H=4096, 5 draft layers, B=16, 512 anchors, S=3072) with a random 36-layer-config target shrunk to its
# embedding/head cost, plus the CPU-vs-GPU agreement of the mask paths. Prints tokens/s, memory and MFU.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q tests/unit/drafter/test_model.py -k "flex or alignment or matches_inference"
python bench/bench_train.py --device cuda --bf16 --backend flex --hidden 4096 --target-layers 8 --draft-layers 5 \
    --vocab 151936 --block-size 16 --num-anchors 512 --batch 1 --seq 3072 --steps 5
python bench/bench_train.py --device cuda --bf16 --backend sdpa --hidden 4096 --target-layers 8 --draft-layers 5 \
    --vocab 151936 --block-size 16 --num-anchors 128 --batch 1 --seq 1024 --steps 5
# bf16 training (bf16 target + accelerate bf16 autocast + FlexAttention) and bf16 eval (drafter in the target's
# dtype, speculative loop on CUDA) of real-architecture twins: the story's hybrid linear-attention MoE family,
# the sliding-window + sinks family and the nested kimi_k25 family (tests/unit/testing/test_zoo.py covers the CPU side).
python -m dflash_pipeline.testing.zoo --table --device auto --models "${DFLASH_MODELS_DIR:-../shared/data/models}" \
    --family Qwen3.5-35B-A3B --family gpt-oss-20b --family Kimi-K2.5
# SGLang (README "SGLang"; it needs CUDA, so the CPU suite checks its shapes on the test server's sglang flavor):
# token ids from SGLang in each thinking mode, the streamed-chat refusal, engine τ of a DFlash drafter from
# meta_info. SGLang >= v0.5.18 must be installed in $DFLASH_SGLANG_PYTHON (default: this python); the check
# fails, saying so, when it is not.
SGLANG_PY="${DFLASH_SGLANG_PYTHON:-python}"
if ! "$SGLANG_PY" -c "import sglang" 2>/dev/null; then
    echo "SGLang is not installed for $SGLANG_PY: pip install 'sglang>=0.5.18' (or set DFLASH_SGLANG_PYTHON)" >&2
    exit 1
fi
python bench/sglang_check.py --python "$SGLANG_PY" ${DFLASH_SGLANG_DRAFTER:+--drafter "$DFLASH_SGLANG_DRAFTER"}
