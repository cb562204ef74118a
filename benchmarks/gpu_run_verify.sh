#!/usr/bin/env bash
# One 2-GPU call that re-verifies what changed after the last GPU run of session 2: ECHO's clone-weight
# multicast over peer memory (gpu_ep_check: nvlink+ECHO vs alltoall in fp32, sync-free), the nvlink
# layer's bf16 error vs EP=1 now that combine returns the caller's dtype, the graphed/eager training
# tests and the nvlink overflow-replay test, then ECHO+nvlink throughput (graphed and eager).
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -x tests/test_gpu_ep.py -p no:warnings -q -s 2>&1 | tee "$OUT/gpu_ep.log" | tail -12
timeout 420 python3 -m pytest tests/test_gpu_train.py tests/test_kernels.py -p no:warnings -q -s 2>&1 | tee "$OUT/gpu_train.log" | tail -12
timeout 200 python3 benchmarks/trainer_throughput.py --out "$OUT" --nproc 2 --config train_configs/v2lite_1b_gpu.toml \
  --steps 40 --label _ep2_echo_nvmc --runs ours_eager,ours_graph \
  --ours "--parallelism.expert_parallel_degree 2 --moe_echo.dispatcher nvlink --moe_echo.capacity_factor 1.25 --moe_echo.echo true" 2>&1 | tail -5
