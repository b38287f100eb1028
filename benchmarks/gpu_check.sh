#!/usr/bin/env bash
# The GPU check: one call on a lent GPU machine (an H100 or H200, no network) that runs make test-gpu's tests and the
# benchmarks (batch-1 decode and 64 streams offline, each beside transformers on the same GPU and model), in under
# 10 minutes: the steps' limits add up to 570 s. Two steps:
#
#   benchmarks/gpu_check.sh prepare   # here, where pip and zhuzi's venv work: fills .gpu/ (git-ignored, a few MB):
#                                     # the wheels the GPU machine's image lacks, SmolLM2's tokenizer
#   benchmarks/gpu_check.sh run       # there, as the device call's command, .gpu carried; writes $OUT/gpu_check.log
#
# The machine's image has torch, transformers and pytest; zhuzi runs from the working tree (PYTHONPATH). No real
# checkpoint can travel (64 MiB a call): the decode benchmark runs a checkpoint of Qwen2.5-Coder-1.5B's shape with
# random bf16 weights (benchmarks/random_checkpoint.py), whose steps read the real model's bytes (its GGUF runs
# dequantized to bf16 there), or MODEL=PATH where a checkpoint is on the machine. The CPU side (the reference
# tokens, a split's CPU layers) runs torch's ops (ZHUZI_CPU_KERNELS=torch): building the kernels would take minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="gguf==0.19.0 llguidance==1.9.1 msgspec==0.23.0 pyzmq==27.3.0"  # what the engine imports beyond the image

prepare() {
    local exclude
    exclude=$(git rev-parse --git-path info/exclude)
    grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo /.gpu/ >> "$exclude"
    mkdir -p .gpu/whl .gpu/tokenizer
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .gpu/whl $WHEELS
    .venv/bin/python -c "from zhuzi.model.loader import default_model_path; from zhuzi.tokenizer import Tokenizer; \
Tokenizer.load(default_model_path()).hf.save_pretrained('.gpu/tokenizer')"
    du -sh .gpu
}

step() {  # a titled step of the log; a failing step is reported and the next one runs
    local title=$1 limit=$2
    shift 2
    echo "=== $title"
    local start=$SECONDS
    timeout "$limit" "$@"
    echo "=== $title: exit $?, $((SECONDS - start)) s"
}

run() {
    local out=${OUT:-/tmp/gpu_check}
    mkdir -p "$out"
    exec > >(tee "$out/gpu_check.log") 2>&1
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 ZHUZI_TEST_TOKENIZER=$PWD/.gpu/tokenizer
    export ZHUZI_CPU_KERNELS=${ZHUZI_CPU_KERNELS:-torch} ZHUZI_CACHE=/tmp/zhuzi-cache
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    git log -1 --format='zhuzi %h %s' 2>/dev/null
    step "make test-gpu (its pytest, on the image's python)" 180 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/gpu
    local model=${MODEL:-}
    if [ -z "$model" ]; then
        model=/tmp/qwen2.5-coder-1.5b-shape
        step "random checkpoint of Qwen2.5-Coder-1.5B's shape" 90 python3 benchmarks/random_checkpoint.py "$model" .gpu/tokenizer
    fi
    step "zhuzi bench decode --device cuda" 90 python3 -m zhuzi.cli --log-level WARNING bench decode --model "$model" \
        --device cuda --prompt-len 128 --max-tokens 128 --runs 3 --json-out "$out/decode.json"
    step "transformers generate, batch 1, same GPU and model; the copy bandwidth" 60 python3 benchmarks/hf_generate.py \
        "$model" --prompt-len 128 --max-tokens 128
    step "zhuzi bench offline --device cuda: 64 streams, transformers in batches of 16" 150 python3 -m zhuzi.cli \
        --log-level WARNING bench offline --model "$model" --device cuda --num-prompts 64 --hf-batch-size 16 \
        --max-input 256 --min-output 128 --max-output 256 --json-out "$out/offline.json"
}

case "${1:-}" in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: $0 prepare|run" >&2; exit 2 ;;
esac
