# Sourced by run.sh: the offline install of the carried wheels (.whl/), then helpers.
#   recipe NAME NPROC ARGS...  the pretrain recipe on $CFG (default the v2lite_1b GPU config; no checkpoints, no
#                              TensorBoard) into $OUT/NAME.log + $OUT/NAME.jsonl; prints the summary
#                              lines and the metrics of the logged windows from step $FROM (default 50)
#   train NAME NPROC ARGS...   recipe at EP=NPROC for 100 steps, nvlink, capacity 1.5, sync_debug
#                              (a device-to-host sync inside a step raises), metrics every 10 steps
# Later arguments override earlier ones (--training.steps 30 after train's 100 runs 30 steps).
# TMO sets the time limit of each run in seconds (default 150).
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1

ngpus() { nvidia-smi --query-gpu=name --format=csv,noheader | wc -l; }

recipe() {  # name, nproc, extra recipe args
  rm -rf "/tmp/run_$1"
  timeout ${TMO:-150} torchrun --nproc_per_node $2 recipes/pretrain.py --job.config_file ${CFG:-train_configs/v2lite_1b_gpu.toml} \
    --metrics.log_freq 10 --checkpoint.enable false --metrics.enable_tensorboard false \
    --job.dump_folder /tmp/run_$1 "${@:3}" > "$OUT/$1.log" 2>&1
  echo "== $1 rc=$? $(grep -E 'cuda graph|^(loss|rank load|expert load|overflow|tokens|memory|peak|params|dispatcher) |^dispatcher: fastest' $OUT/$1.log | tr '\n' ';')"
  cp /tmp/run_$1/metrics.jsonl "$OUT/$1.jsonl" 2>/dev/null
  python3 -c "
import json, sys
r = [json.loads(l) for l in open('/tmp/run_$1/metrics.jsonl')]
late = [x for x in r if x['step'] >= ${FROM:-50} and 'tokens_per_s' in x]
mean = sum(x['tokens_per_s'] for x in late) / max(1, len(late))
print('tok/s', [round(x['tokens_per_s']) for x in late], 'mean', round(mean), 'per GPU', round(mean / $2),
      'mfu', [round(x.get('mfu_pct', 0), 1) for x in late],
      'overflow', r[-1].get('moe/overflow_assignments'), 'replayed', r[-1].get('moe/replayed_steps'),
      'replayed at', [x['step'] for x in r if x.get('moe/replayed')],
      'peak GiB', round(max(x.get('memory/peak_gib', 0) for x in r), 1))
echo = [(k, round(v, 3)) for k, v in r[-1].items() if 'echo_load' in k]
print('echo', echo) if echo else None" 2>&1 | tail -2
}

train() {  # name, nproc (= EP), extra recipe args
  recipe "$1" "$2" --training.steps 100 --parallelism.expert_parallel_degree $2 --moe_echo.dispatcher nvlink \
    --moe_echo.capacity_factor 1.5 --training.sync_debug true "${@:3}"
}
