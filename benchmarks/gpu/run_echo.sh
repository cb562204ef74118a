#!/usr/bin/env bash
# One 2-GPU device call: dispatch benchmark, ECHO planner time (CUDA graph), simulated EP=8/16
# straggler time, and ECHO on/off training step time with hot experts on 2 GPUs.
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m pytest tests/test_kernels.py tests/test_gpu_ep.py -p no:warnings -k "planner or two_gpu" 2>&1 | tail -2
python3 benchmarks/planner.py --skip-quality --time --out "$OUT" 2>&1 | tail -8
python3 benchmarks/echo_sim.py --out "$OUT" 2>&1 | tail -11
run() {  # name, extra args
  torchrun --nproc_per_node 2 recipes/pretrain.py --job.config_file train_configs/v2lite_1b_gpu.toml --training.steps 40 \
    --metrics.log_freq 10 --checkpoint.enable false --metrics.enable_tensorboard false --job.dump_folder /tmp/e_$1 \
    --parallelism.expert_parallel_degree 2 --moe_echo.dispatcher padded --moe_echo.bias_update_rate 0 \
    --moe_echo.debug_hot_experts 8 "${@:2}" > "$OUT/e_$1.log" 2>&1
  echo "== $1 rc=$? $(grep -E '^(loss|rank load|peak) ' $OUT/e_$1.log | tr '\n' ';')"
  python3 -c "import json,sys; r=[json.loads(l) for l in open('/tmp/e_$1/metrics.jsonl')]; print('steady tok/s', [round(x['tokens_per_s']) for x in r if x['step']>=20])"
}
run off_cf2 --moe_echo.capacity_factor 2.0
run on_cf2 --moe_echo.capacity_factor 2.0 --moe_echo.echo true --moe_echo.echo_slots_per_rank 4
run on_cf1.25 --moe_echo.capacity_factor 1.25 --moe_echo.echo true --moe_echo.echo_slots_per_rank 4
run off_cf1.25 --moe_echo.capacity_factor 1.25; grep -m1 "^error" $OUT/e_off_cf1.25.log
torchrun --nproc_per_node 2 benchmarks/dispatch.py --out "$OUT" 2>&1 | grep -v "^{" | tail -12
