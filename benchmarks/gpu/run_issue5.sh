#!/usr/bin/env bash
# Issue 5 benchmarks. PART=a (2 GPUs): dispatch GB/s + 2-GPU training throughput (ours vs torchtitan,
# graphed vs eager). PART=b (1 GPU): 1-GPU throughput on the small and ~1B configs + MoE layer.
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -4
tp() { timeout "$1" python3 benchmarks/trainer_throughput.py --out "$OUT" "${@:2}" 2>&1 | tail -7; }
if [ "${PART:-a}" = a ]; then
  timeout 200 torchrun --nproc_per_node 2 benchmarks/dispatch.py --out "$OUT" --no-vdev 2>&1 | tee "$OUT/dispatch.log" | grep -v "^{" | tail -24
  tp 300 --nproc 2 --config train_configs/v2lite_1b_gpu.toml --steps 40 --label _ep2 \
     --ours "--parallelism.expert_parallel_degree 2 --moe_echo.dispatcher nvlink --moe_echo.capacity_factor 1.5" \
     --titan "--parallelism.expert_parallel_degree 2"
  tp 150 --nproc 2 --config train_configs/v2lite_1b_gpu.toml --steps 40 --label _ep2_echo --runs ours_eager,ours_graph \
     --ours "--parallelism.expert_parallel_degree 2 --moe_echo.dispatcher nvlink --moe_echo.capacity_factor 1.25 --moe_echo.echo true"
else
  CUDA_VISIBLE_DEVICES=0 tp 150 --nproc 1 --config train_configs/debug_gpu.toml --steps 60
  CUDA_VISIBLE_DEVICES=0 tp 150 --nproc 1 --config train_configs/v2lite_1b_gpu.toml --steps 40
  tp 200 --nproc 2 --config train_configs/v2lite_1b_gpu.toml --steps 40 --label _ep2 \
     --ours "--parallelism.expert_parallel_degree 2 --moe_echo.dispatcher nvlink --moe_echo.capacity_factor 1.5" \
     --titan "--parallelism.expert_parallel_degree 2"
  CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/moe_layer.py --out "$OUT" 2>&1 | tail -7
fi
tar czf "$OUT/logs.tgz" -C /tmp/moe_echo_throughput --exclude assets . 2>/dev/null
