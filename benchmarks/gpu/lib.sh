# Sourced by run.sh: the offline install of the wheels in .whl/, then helpers.
#   recipe NAME NPROC ARGS...  the pretrain recipe on $CFG (default the v2lite_1b GPU config; no checkpoints, no
#                              TensorBoard) into $OUT/NAME.log + $OUT/NAME.jsonl; prints the summary
#                              lines and the metrics of the logged windows from step $FROM (default 50)
#   train NAME NPROC ARGS...   recipe at EP=NPROC for 100 steps, nvlink, capacity 1.5, sync_debug
#                              (a device-to-host sync inside a step raises), metrics every 10 steps
#   ... | noise                drops benchmark scripts' JSON rows and torch's warnings from their output
#   one_gpu_variants LABEL "NAME=ARGS;..."   v2lite_1b compiled + graphed on one GPU, 30 steps, a row per variant
#                              (PICK="NAME ..." runs only those)
#   pick_variants "NAME=ARGS;..."   only the variants PICK names (all when PICK is unset)
# Later arguments override earlier ones (--training.steps 30 after train's 100 runs 30 steps).
# TMO sets the time limit of each run in seconds (default 150).
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
# one install at a time: suites that start suites beside them (PART=s) source this file at once
site_install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; }
if command -v flock > /dev/null; then (flock 9 && site_install) 9> /tmp/site.lock || exit 1; else site_install || exit 1; fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# another revision's source tree for e2e's "@/tmp/base" variants: made here with
#   git archive REV recipes components kernels train_configs | gzip > build/base.tgz   (copy build/base.tgz to the GPU machine)
if [ -f build/base.tgz ]; then rm -rf /tmp/base && mkdir -p /tmp/base && tar xzf build/base.tgz -C /tmp/base; fi

# QuACK (`experts_gemm = "quack"`; benchmarks/gpu/quack_offline.sh prepares it): installed once this machine
# holds cutlass-dsl's MLIR library (`run.sh quack_unpack`, run before on the same machine) and .whl/extra/quack is present.
# The target path contains /site-packages/: QuACK 0.6.5 keys its compile cache by source for code outside
# site-packages and fails on cutlass-dsl's objects otherwise.
quack_setup() {
  local sp=/tmp/quack/site-packages lib=nvidia_cutlass_dsl
  [ -f /tmp/quack_ir.so ] && ls .whl/extra/quack/*.whl > /dev/null 2>&1 || return 0
  if [ ! -f /tmp/quack/installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $sp .whl/extra/quack/*.whl || return 1
    cp /tmp/quack_ir.so $sp/$lib/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so
    xz -dc .whl/extra/quack/rt.so.xz > $sp/$lib/cu13/lib/libcute_dsl_runtime.so && touch /tmp/quack/installed
  fi
  echo "import site; site.addsitedir('$sp')" > /tmp/site/sitecustomize.py  # after the image's own packages
  python3 -c "import quack; print('quack', quack.__version__, 'installed')" || return 1
}
quack_setup || echo "quack: install failed (experts_gemm = 'quack' runs will exit with its one-line error)"

ngpus() { nvidia-smi --query-gpu=name --format=csv,noheader | wc -l; }

# megatron-core 0.16.1 and its grouped_gemm CUDA extension (nv_grouped_gemm, built for sm_90 against torch
# 2.11+cu130) from .whl/extra/mcore into /tmp/site, for moe_layer.py's megatron_ms column. If the copied
# extension fails a small grouped GEMM here, it is built from .whl/extra/mcore/src into build/mcore (minutes;
# kept there for later runs). Without .whl/extra/mcore the column stays empty.
megatron_setup() {
  ls .whl/extra/mcore/*.whl > /dev/null 2>&1 || { echo "megatron: .whl/extra/mcore not present"; return 0; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/extra/mcore/*.whl || return 1
  gg_check() { python3 -c "
import torch; from grouped_gemm import ops
a = torch.randn(8, 16, device='cuda', dtype=torch.bfloat16); b = torch.randn(2, 16, 4, device='cuda', dtype=torch.bfloat16)
ref = torch.cat([a[:3] @ b[0], a[3:] @ b[1]]).float()
torch.testing.assert_close(ops.gmm(a, b, torch.tensor([3, 5])).float(), ref, rtol=2e-2, atol=2e-2)"; }
  gg_check 2> "$OUT/grouped_gemm_check.log" && { echo "grouped_gemm: prebuilt extension ok"; return 0; }
  echo "grouped_gemm: prebuilt extension failed ($(tail -1 "$OUT/grouped_gemm_check.log")); building from source"
  if ! ls build/mcore/nv_grouped_gemm-*.whl > /dev/null 2>&1; then
    CPATH=$(python3 -c "import nvidia, os; print(':'.join(os.path.join(p, 'cu13', 'include') for p in nvidia.__path__))") \
    TORCH_CUDA_ARCH_LIST=9.0 GROUPED_GEMM_FORCE_BUILD=TRUE MAX_JOBS=16 python3 -m pip wheel -q --no-index --no-deps \
      --no-build-isolation -w build/mcore .whl/extra/mcore/src/nv_grouped_gemm-*.tar.gz > "$OUT/grouped_gemm_build.log" 2>&1 \
      || { tail -20 "$OUT/grouped_gemm_build.log"; return 1; }
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    build/mcore/nv_grouped_gemm-*.whl && gg_check && echo "grouped_gemm: built here, ok"
}

noise() { grep -Ev '^\{|^W[0-9]{4} |[Ww]arn'; }   # drop the JSON rows and torch warnings from benchmark output

recipe() {  # name, nproc, extra recipe args (SCRIPT: another entry point taking pretrain.py's arguments)
  rm -rf "/tmp/run_$1"
  timeout ${TMO:-150} torchrun --nproc_per_node $2 ${SCRIPT:-recipes/pretrain.py} --job.config_file ${CFG:-train_configs/v2lite_1b_gpu.toml} \
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

pick_variants() {  # "name=args;..." -> only the names in PICK (all when PICK is unset)
  local v=$1
  [ -n "${PICK:-}" ] && v=$(IFS=';'; for x in $v; do [[ " $PICK " == *" ${x%%=*} "* ]] && printf '%s;' "$x"; done)
  printf '%s' "${v%;}"
}

one_gpu_variants() {
  local label=$1 v
  v=$(pick_variants "$2")
  CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} python3 benchmarks/e2e.py --configs v2lite_1b_gpu \
    --runs ours_compile_graph --steps 30 --label "$label" --variants "$v" --out "$OUT" 2>&1 | noise |
    grep -E "^\| v2lite" | tail -8
}
