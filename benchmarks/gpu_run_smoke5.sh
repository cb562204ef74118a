#!/usr/bin/env bash
# Issue 5 first GPU call (2 GPUs): nvlink + graph tests, then the dispatch benchmark.
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -2
timeout 240 python3 -m pytest -x tests/test_gpu_ep.py -p no:warnings -q -s 2>&1 | tee "$OUT/gpu_ep.log" | tail -15
timeout 300 python3 -m pytest -x tests/test_gpu_train.py -p no:warnings -q -s 2>&1 | tee "$OUT/gpu_train.log" | tail -25
timeout 200 torchrun --nproc_per_node 2 benchmarks/dispatch.py --out "$OUT" --no-vdev 2>&1 | tee "$OUT/dispatch.log" | grep -v "^{" | tail -30
