#!/usr/bin/env bash
# Issue 6 on 4 GPUs: dispatch at EP=4 (nvlink vs alltoall vs padded vs peer copy), then v2lite_1b at
# EP=4 for 100 steps on the nvlink backend under sync_debug (any host sync inside a step raises):
# ECHO off/on with natural routing and with 8 hot experts.
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l); echo "GPUs: $N"
timeout 150 torchrun --nproc_per_node $N benchmarks/dispatch.py --tokens 16384 --hidden 2048,7168 --sweep 32 --no-vdev \
  --out "$OUT" 2>&1 | grep -v "^{\|^W1122\|[Ww]arn" | tail -9
run() {  # name, extra args
  timeout 110 torchrun --nproc_per_node $N recipes/pretrain.py --job.config_file train_configs/v2lite_1b_gpu.toml \
    --training.steps 100 --metrics.log_freq 10 --checkpoint.enable false --metrics.enable_tensorboard false \
    --job.dump_folder /tmp/q_$1 --parallelism.expert_parallel_degree $N --moe_echo.dispatcher nvlink \
    --moe_echo.capacity_factor 1.5 --training.sync_debug true "${@:2}" > "$OUT/q_$1.log" 2>&1
  echo "== $1 rc=$? $(grep -E '^(loss|rank load|expert load|overflow|tokens) ' $OUT/q_$1.log | tr '\n' ';')"
  python3 -c "
import json; r=[json.loads(l) for l in open('/tmp/q_$1/metrics.jsonl')]; late=[x for x in r if x['step']>=50]
print('tok/s', [round(x['tokens_per_s']) for x in late], 'mfu', [round(x.get('mfu_pct',0),1) for x in late],
      'overflow', r[-1].get('moe/overflow_assignments'), 'replayed', r[-1].get('moe/replayed_steps'))
echo=[(k, round(v,3)) for k, v in r[-1].items() if 'echo_load' in k]; print('echo', echo)"
}
run natural_off
run natural_on --moe_echo.echo true
run skewed_off --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8
run skewed_on --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8 --moe_echo.echo true --moe_echo.echo_slots_per_rank 4
