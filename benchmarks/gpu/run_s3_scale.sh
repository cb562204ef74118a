#!/usr/bin/env bash
# Session 3 on a 4-GPU host (issue 5 bandwidth + issue 6 scaling). PART=a: dispatch + combine at EP=2
# (GPUs 0,1) and EP=4 — nvlink (eager and graphed, CTA x tokens-per-iteration sweep) vs alltoall vs
# padded vs the peer-copy ceiling; then v2lite_6b (~6.6B, 64 experts top-6) at EP=4 with natural
# routing, ECHO off/on. PART=b: 8 hot experts, ECHO off/on; natural ECHO on graphed.
# Every training run: nvlink, capacity 1.5, 100 steps, sync_debug (a host sync inside a step raises).
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
N=4
run() {  # name, extra args
  timeout ${TMO:-150} torchrun --nproc_per_node $N recipes/pretrain.py --job.config_file train_configs/v2lite_1b_gpu.toml \
    --model.flavor v2lite_6b --training.steps 100 --metrics.log_freq 10 --checkpoint.enable false \
    --metrics.enable_tensorboard false --job.dump_folder /tmp/s_$1 --parallelism.expert_parallel_degree $N \
    --moe_echo.dispatcher nvlink --moe_echo.capacity_factor 1.5 --training.sync_debug true "${@:2}" > "$OUT/s_$1.log" 2>&1
  echo "== $1 rc=$? $(grep -E 'cuda graph|^(loss|rank load|expert load|overflow|tokens|memory|params) ' $OUT/s_$1.log | tr '\n' ';')"
  cp /tmp/s_$1/metrics.jsonl "$OUT/s_$1.jsonl" 2>/dev/null
  python3 -c "
import json; r=[json.loads(l) for l in open('/tmp/s_$1/metrics.jsonl')]; late=[x for x in r if x['step']>=50]
print('tok/s', [round(x['tokens_per_s']) for x in late], 'mfu', [round(x.get('mfu_pct',0),1) for x in late],
      'overflow', r[-1].get('moe/overflow_assignments'), 'replayed', r[-1].get('moe/replayed_steps'),
      'peak GiB', round(max(x.get('memory/peak_gib', 0) for x in r), 1))
echo=[(k.split('/')[1] + k.split('echo_load')[1], round(v,3)) for k, v in r[-1].items() if 'echo_load' in k]; print('echo', echo)"
}
if [ "${PART:-a}" = a ]; then
  CUDA_VISIBLE_DEVICES=0,1 timeout 170 torchrun --nproc_per_node 2 benchmarks/dispatch.py --no-vdev --out "$OUT" 2>&1 \
    | grep -v "^{\|^W1122\|[Ww]arn" | tail -32
  timeout 130 torchrun --nproc_per_node $N benchmarks/dispatch.py --tokens 16384 --no-vdev --sweep 32,64,132 --out "$OUT" 2>&1 \
    | grep -v "^{\|^W1122\|[Ww]arn" | tail -14
  run natural_off
  run natural_on --moe_echo.echo true
else
  run skewed_off --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8
  run skewed_on --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8 --moe_echo.echo true --moe_echo.echo_slots_per_rank 4
  run natural_on_graph --moe_echo.echo true --training.cuda_graph true
fi
