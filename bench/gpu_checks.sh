#!/usr/bin/env bash
# The GPU checks, as one prepared run for a machine with a CUDA GPU (see README, Benchmarks):
# the CUDA kernel tests, the decode step's CUDA graphs, the 1-prefill/1-decode cluster on CUDA
# against Engine, the decode step eager against graphs against the card's floor (SmolLM2's shape
# and Llama-3.2-1B's), the Triton decode attention's launch settings swept, and the kernel
# benchmark (decode attention bytes/s against the card's copy bandwidth). Logs, the JSON lines and the PNG go to $OUT (or runs/gpu); the last lines
# printed are the benchmarks' JSON.
#
# Python: .venv's where `make setup` made one, else $PYTHON or python3 (a machine with its own
# torch and Triton, and no registry to install from): wheels of the other dependencies in .whl/
# (built for that Python; bench/gpu_wheels.txt lists them and says how to fetch them) are
# installed into a scratch directory first.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-runs/gpu}"
mkdir -p "$out"
py=.venv/bin/python
if [ ! -x "$py" ]; then
    py="${PYTHON:-python3}"
    if [ -d .whl ]; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/hm-site .whl/*.whl >"$out/wheels.log" 2>&1 || { tail "$out/wheels.log"; exit 1; }
        export PYTHONPATH="/tmp/hm-site${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$out/gpu.txt"
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
"$py" -m pytest -q -p no:cacheprovider --timeout 300 \
    tests/test_cuda_graphs.py tests/test_kernels_rows_triton.py tests/test_kernels_gpu.py \
    tests/test_serving_gpu.py \
    "tests/test_kernels_mla.py::test_triton_at_deepseek_v2_sizes_on_gpu" 2>&1 | tee "$out/tests.log" | tail -25
timeout 200 "$py" bench/decode_cuda.py 2>&1 | tee "$out/decode_cuda.log" | tail -5
timeout 200 "$py" bench/decode_cuda.py --shape llama-1b --batches 1,16 --repeats 3 2>&1 \
    | tee "$out/decode_cuda_llama1b.log" | tail -4
timeout 200 "$py" bench/decode_attn_sweep.py 2>&1 | tee "$out/decode_attn_sweep.log" | tail -3
timeout 200 "$py" bench/kernels.py --plot "$out/kernels.png" 2>&1 | tee "$out/kernels.log" | tail -4
