#!/usr/bin/env bash
# Prepare what bench/gpu_check.sh carries to a GPU machine without network (docs/explanation/gpu-check.md):
# bench/gpu_carry/wheels (the project's dependencies the machine lacks, as wheels) and bench/gpu_carry/models (the
# zoo families' config and template files). Run it on a machine with PyPI access, with the GPU machine's Python
# minor version (binary wheels are per version): PYTHON=python3.12 bench/gpu_prepare.sh
# The machine has torch, transformers, accelerate and triton (and their dependencies); DEVICE_HAS lists them, so
# they are not downloaded. pulp (16 MB) is left out: snakemake only imports it for its ILP scheduler, and the
# check runs --scheduler greedy. Fails when the folder exceeds the 64 MiB a device run carries.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
OUT=bench/gpu_carry
# What the checks import beyond the machine's packages. matplotlib (with pillow and fonttools ~25 MB: the zoo's and
# the workflow's plots) does not fit beside pyarrow (40 MB) in 64 MiB: WANT="... matplotlib>=3.8" adds it when the
# machine has pyarrow or the carry allows it; without it those rows say so.
WANT="${WANT:-snakemake>=9.0,<10 pyarrow==17.0.0 jsonschema>=4.20 openai>=1.50}"
DEVICE_HAS="${DEVICE_HAS:-torch transformers accelerate triton numpy pyyaml tqdm safetensors tokenizers huggingface-hub \
hf-xet requests urllib3 idna certifi charset-normalizer filelock fsspec jinja2 markupsafe networkx sympy mpmath \
typing-extensions packaging psutil regex nvidia setuptools pulp}"
LIMIT=$((64 * 1024 * 1024))

rm -rf "$OUT/wheels.all" && mkdir -p "$OUT/wheels.all" "$OUT/wheels" "$OUT/models"
# shellcheck disable=SC2086
"$PYTHON" -m pip download -q --dest "$OUT/wheels.all" $WANT
rm -f "$OUT"/wheels/*
for f in "$OUT"/wheels.all/*; do
    name=$(basename "$f" | sed -E 's/-[0-9].*//; s/_/-/g' | tr 'A-Z' 'a-z')
    skip=0
    for has in $DEVICE_HAS; do
        case "$name" in "$has" | "$has"-cu* | nvidia-*) skip=1 ;; esac
    done
    [ "$skip" = 1 ] || cp "$f" "$OUT/wheels/"
done
rm -rf "$OUT/wheels.all"
MODELS="${DFLASH_MODELS_DIR:-../shared/data/models}"
for fam in Qwen3.5-35B-A3B gpt-oss-20b Kimi-K2.5 Kimi-K2-Thinking; do
    [ -d "$MODELS/$fam" ] && cp -r "$MODELS/$fam" "$OUT/models/"
done
size=$(du -sb "$OUT" | cut -f1)
ls -S -l "$OUT/wheels" | awk 'NR > 1 && NR <= 9 {printf "  %6.1f MB  %s\n", $5 / 1e6, $9}'
printf 'bench/gpu_carry: %.1f MB (limit %.1f MB = 64 MiB)\n' "$(echo "$size / 1000000" | bc -l)" "$(echo "$LIMIT / 1000000" | bc -l)"
if [ "$size" -gt "$LIMIT" ]; then
    echo "bench/gpu_carry is over 64 MiB: set WANT to fewer packages (the biggest are listed above)" >&2
    exit 1
fi
