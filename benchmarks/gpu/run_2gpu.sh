#!/usr/bin/env bash
# One device call on 2 GPUs: GPU tests (incl. the 2-GPU EP checks), dispatch benchmark, MoE-layer
# benchmark, and training throughput of the ~1B config at EP=2 vs plain data parallel.
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"; nvidia-smi topo -m | head -4
python3 -m pytest tests/test_gpu_ep.py tests/test_gpu.py tests/test_kernels.py -p no:warnings 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
torchrun --nproc_per_node 2 benchmarks/dispatch.py --out "$OUT" 2>&1 | tee "$OUT/dispatch.log" | grep -v "^{" | tail -14
[ -n "${LAYER:-}" ] && python3 benchmarks/moe_layer.py --out "$OUT" 2>&1 | tail -7
run() {  # name, extra args
  torchrun --nproc_per_node 2 recipes/pretrain.py --job.config_file train_configs/v2lite_1b_gpu.toml --training.steps 30 \
    --metrics.log_freq 10 --checkpoint.enable false --metrics.enable_tensorboard false --job.dump_folder /tmp/tp_$1 "${@:2}" \
    > "$OUT/tp_$1.log" 2>&1
  echo "== $1 rc=$? $(grep -E '^(loss|tokens|peak|ranks|dispatcher) ' $OUT/tp_$1.log | tr '\n' ';')"
  tail -1 /tmp/tp_$1/metrics.jsonl | cut -c1-200
}
run dp2 --parallelism.expert_parallel_degree 1
run ep2_padded --parallelism.expert_parallel_degree 2 --moe_echo.dispatcher padded --moe_echo.capacity_factor 2.0
run ep2_alltoall --parallelism.expert_parallel_degree 2 --moe_echo.dispatcher alltoall
