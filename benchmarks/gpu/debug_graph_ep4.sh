#!/usr/bin/env bash
# Session 4, 4-GPU host: bisect the EP=4 graphed ECHO failure (grouped GEMM offsets assert) on
# v2lite_1b (f*: v2lite_6b); CHECK=1: MOE_ECHO_CHECK reads every eager dispatch's counts back on the host.
#   e1 graphed (2 warm-up steps on side streams, then capture)   e2 side-stream warm-up only (never captures)
#   e3 graphed without ECHO                                        e4 eager with ECHO (control)
# Findings (warm-up then ran on a side stream): v2lite_1b e1-e4 pass; v2lite_6b e1/e2 assert in the
# grouped GEMM (offsets decreasing), also with a non-capturable optimizer; f1 (CUDA_LAUNCH_BLOCKING=1)
# and f4 (no ECHO) pass; warm-up on the current stream finished its 5 steps (an earlier try, the
# first run on a fresh machine, timed out compiling) -> StepGraph now warms up there; g1 (graphed
# v2lite_6b, 30 steps, sync_debug) then passed. A v2lite_6b step 1 on a cold Triton cache takes
# minutes: give the first run of a call a generous limit.
set -uo pipefail
source benchmarks/gpu/lib.sh
export MOE_ECHO_CHECK=${CHECK:-1}
d() {  # name, timeout, args
  timeout ${TMO:-$2} torchrun --nproc_per_node 4 recipes/pretrain.py --job.config_file train_configs/v2lite_1b_gpu.toml \
    --training.steps ${STEPS:-8} --metrics.log_freq 1 --checkpoint.enable false --metrics.enable_tensorboard false \
    --job.dump_folder /tmp/d_$1 --parallelism.expert_parallel_degree 4 --moe_echo.dispatcher nvlink \
    --moe_echo.capacity_factor 1.5 "${@:3}" ${EXTRA:-} > "$OUT/d_$1.log" 2>&1
  echo "== $1 rc=$? steps logged: $(wc -l < /tmp/d_$1/metrics.jsonl 2>/dev/null) | $(grep -E '^cuda graph' $OUT/d_$1.log | sort -u | tr '\n' ';')"
  grep -m3 -E "MOE_ECHO_CHECK|Assertion|Error:" "$OUT/d_$1.log" | grep -v lspci | cut -c1-300
}
for e in ${EXPS:-e1 e2 e3 e4}; do
  case $e in
    e1) d e1 120 --moe_echo.echo true --training.cuda_graph true ;;
    e2) d e2 120 --moe_echo.echo true --training.cuda_graph true --training.cuda_graph_warmup 1000 ;;
    e3) d e3 120 --training.cuda_graph true ;;
    e4) d e4 120 --moe_echo.echo true ;;
    # v2lite_6b, warm-up only (never captures)
    f1) CUDA_LAUNCH_BLOCKING=1 d f1 150 --model.flavor v2lite_6b --moe_echo.echo true --training.cuda_graph true --training.cuda_graph_warmup 1000 ;;
    f4) d f4 120 --model.flavor v2lite_6b --training.cuda_graph true --training.cuda_graph_warmup 1000 ;;
    g1) d g1 300 --model.flavor v2lite_6b --moe_echo.echo true --training.cuda_graph true --training.sync_debug true ;;
  esac
done
