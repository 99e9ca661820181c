#!/usr/bin/env bash
# The GPU check for a machine as we can borrow it (docs/explanation/gpu-check.md): one GPU with torch, transformers,
# accelerate and triton, no vLLM, no SGLang, no Snakemake, no network. Under 8 minutes in one go:
#   bench/gpu_check.sh                 # --device auto: the GPU when one is visible
#   bench/gpu_check.sh --device cpu    # the same parts end to end at tiny sizes (the suite runs it)
# Missing packages (snakemake, pyarrow, ...) are installed offline from bench/gpu_carry/wheels, which
# bench/gpu_prepare.sh fills on a networked machine (<= 64 MiB; carry bench/gpu_carry with the run).
# It prints one table, the parts in this order, each under its own time limit (460 s together): timed Qwen3-8B-sized
# and Kimi-K2.6-width drafter steps (tokens/s, MFU, peak memory against the memory plan), the demo target through
# the workflow under Snakemake with train.device auto (bench/gpu_check_workflow.yaml; its τ), the zoo's families
# (bf16 train + eval), training fed by an hf feature server, and one FSDP2 rank. Other arguments go to
# bench/gpu_check.py (--skip PART, --family NAME, --models DIR, --workflow-workdir DIR, --json FILE, --logs DIR).
# Checks that need vLLM or SGLang: bench/gpu_check_engines.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
echo "[gpu-check] $("$PY" -V 2>&1); $("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())')"
missing=$("$PY" - <<'PY'
import importlib.util
need = {"snakemake": "snakemake", "pyarrow": "pyarrow", "jsonschema": "jsonschema", "openai": "openai", "matplotlib": "matplotlib"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PY
)
if [ -n "$missing" ]; then
    if [ -d bench/gpu_carry/wheels ]; then
        echo "[gpu-check] installing offline from bench/gpu_carry/wheels: $missing"
        for pkg in $missing; do  # one at a time: a package not carried (matplotlib by default) is reported, not fatal
            "$PY" -m pip install -q --no-index --find-links bench/gpu_carry/wheels "$pkg" \
                || echo "[gpu-check] $pkg is not installed and not carried: the parts that import it fail, naming it"
        done
    else
        echo "[gpu-check] missing $missing and no bench/gpu_carry/wheels (bench/gpu_prepare.sh): the parts that need them fail"
    fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" bench/gpu_check.py "$@"
