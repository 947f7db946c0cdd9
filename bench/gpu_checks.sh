#!/usr/bin/env bash
# The GPU checks, as one prepared run for a session lent a CUDA machine (see README, Benchmarks):
# the CUDA kernel tests, the 1-prefill/1-decode cluster on CUDA against Engine, and the kernel
# benchmark (decode attention bytes/s against the card's copy bandwidth). Results go to $OUT
# (or runs/gpu) as logs and the benchmark's PNG; the last lines printed are its JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-runs/gpu}"
mkdir -p "$out"
py=.venv/bin/python
[ -x "$py" ] || { make setup >"$out/setup.log" 2>&1 || { tail -20 "$out/setup.log"; exit 1; }; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
"$py" -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_serving_gpu.py \
    tests/test_kernels_attention.py tests/test_kernels_kivi.py 2>&1 | tee "$out/tests.log" | tail -15
"$py" bench/kernels.py --plot "$out/kernels.png" 2>&1 | tee "$out/kernels.log" | tail -8
