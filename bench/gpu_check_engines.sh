#!/usr/bin/env bash
# GPU checks that need a serving engine, apart from bench/gpu_check.sh (which needs neither):
# - vLLM with CUDA in $DFLASH_VLLM_PYTHON (default .venv-vllm/bin/python): DFlash2's Triton kernels (grouped
#   convolution, candidate walk) against our plain-torch versions (tests/e2e/test_drafter_family_parity.py checks
#   the CPU parity of their arithmetic; this runs them);
# - SGLang >= v0.5.18 in $DFLASH_SGLANG_PYTHON (default: this python): token ids in each thinking mode, the
#   streamed-chat refusal, engine τ of a DFlash drafter from meta_info ($DFLASH_SGLANG_DRAFTER: a trained
#   final/ directory).
# Each check says what is missing and exits 1 when its engine is not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
VLLM_PY="${DFLASH_VLLM_PYTHON:-.venv-vllm/bin/python}"
if ! "$VLLM_PY" -c "import vllm, torch; assert torch.cuda.is_available()" 2>/dev/null; then
    echo "vLLM with CUDA is not installed for $VLLM_PY: a CUDA build of vllm (set DFLASH_VLLM_PYTHON)" >&2
    exit 1
fi
"$VLLM_PY" bench/gpu_family_kernels.py
SGLANG_PY="${DFLASH_SGLANG_PYTHON:-python}"
if ! "$SGLANG_PY" -c "import sglang" 2>/dev/null; then
    echo "SGLang is not installed for $SGLANG_PY: pip install 'sglang>=0.5.18' (or set DFLASH_SGLANG_PYTHON)" >&2
    exit 1
fi
python bench/sglang_check.py --python "$SGLANG_PY" ${DFLASH_SGLANG_DRAFTER:+--drafter "$DFLASH_SGLANG_DRAFTER"}
