#!/usr/bin/env bash
# One runner for the GPU machine: `bash benchmarks/gpu/run.sh SUITE` from the repository root, with
# the pure-Python wheels in .whl/ (bash ../shared/offline-wheels.sh fills it). Logs and
# tables go to $OUT (./gpu_out elsewhere). Each suite is sized for one 10-minute run; the suites below are
# the commands that produced the tables in benchmarks/results/ (README.md in this folder: suite ->
# GPUs -> results file; results are named <benchmark>[_<label>]_<N>x<GPU>). PART picks a part where a suite has several; TMO overrides a run's limit.
# The first v2lite_6b step on a cold Triton cache compiles every kernel (minutes): give the first
# run on a fresh machine a generous limit.
#
#   quack_unpack 1+  QuACK's MLIR library (benchmarks/gpu/quack_offline.sh; build/quack present) to /tmp: later runs
#                    on the same machine (.whl present) install QuACK, so its tests and experts_gemm = "quack" run
#   tests       1-2  every GPU test + the CPU tests of the step gate, profiler and checkpoints on this torch, in two
#                    parts of under 10 minutes each: PART=a all but tests/test_gpu_train.py, PART=b its graphed ==
#                    eager cases, PART=c the rest of it
#   graph       4    two GPU pairs at once: graph == eager tests, overflow replay with re-capture (0,1);
#                    EP tests, v2lite_1b EP=2 graphed with re-capture (2,3)
#   sanitize    2    compute-sanitizer (memcheck x ECHO off/on x eager/graphed, racecheck, synccheck) on the EP=2
#                    nvlink debug step that overflows, is replayed, grows capacity (and is captured again)
#   recapture   2    v2lite_1b EP=2 nvlink graphed, 200 steps, capacity 1.0 (overflows early) vs the eager
#                    alltoall exact path: replays, re-captures, per-step losses -> recapture_2x<GPU>.md
#   copies      2    the optimizer-written expert copies' GPU tests (QuACK's after quack_unpack), ~300 s
#   layer       1    MoE layer fwd+bwd vs torchtitan, Megatron-Core (.whl/extra/mcore) and a dense SwiGLU; bf16 and FP8 experts
#                    (+ the layer/kernel tests)
#   nvlink_fp8  2-4  the fp8 wire over NVLink: PART=a its GPU tests + dispatch bytes and times, b v2lite_1b EP=2/4 bf16
#                    vs fp8 wire, c 300-step losses at EP=2 (4 GPUs: two pairs at once)
#   fp8         1    FP8 experts: their tests, v2lite_1b 300 steps bf16 vs fp8 vs bf16 compiled (loss curves), e2e bf16 vs fp8
#   configs     1    40 steps of each GPU config (RECIPES="debug_gpu ..." to pick)
#   dispatch    2/4+ dispatch + combine at EP=2 on GPUs 0,1 and what a peer copy costs the SMs (copy engines vs
#                    kernels), then EP=all GPUs (VDEV=1 adds NVSHMEM vdev)
#   deepep      2/4  DeepEP's intranode kernels built from .deepep/src (benchmarks/gpu/build_deepep.sh, where deep_ep
#                    does not import yet; kept in build/deepep), the deepep dispatcher's GPU test (== alltoall at EP=2,
#                    24 and 64 SMs), then nvlink vs deepep dispatch + combine at 24 and 64 SMs, eager, 4096/16384 tokens
#                    (PART=build | test | bench; default all, ~5 minutes) -> dispatch_ep2_deepep_2x<GPU>.md; on 4 GPUs
#                    the test runs at EP=2 and 4, and EP=4 times EP=4 (-> dispatch_ep4_deepep_4x<GPU>.md); DEEPEP_BUILD
#                    (default build/deepep) may also be an absolute path, e.g. /tmp/deepep
#   e2e         1-2  whole-run tokens/s, step ms and MFU vs torchtitan's trainer (no compile / compile), ours
#                    eager and graphed (CONFIGS="debug_gpu ...", RUNS=..., PART=1gpu (PAR=1: config i on GPU i
#                    at the same time, every run of a config on its GPU; VARIANTS as below) | ep2 | fill | variants:
#                    VARIANTS="name=recipe args;..." at EP=2 on CONFIGS (default v2lite_1b_gpu), our runs once per
#                    variant against one torchtitan baseline, e.g. "quack=--moe_echo.experts_gemm quack;torch=";
#                    "base=@/tmp/base;head=" times another revision (build/base.tgz, see lib.sh) in the same run;
#                    REPEATS=N: every run N times in turn, the median and its spread)
#                    -> e2e_<N>x<GPU>.md
#   echo_tests  2    ECHO's GPU tests: graph = eager with ECHO (torch and QuACK GEMMs; QuACK's after quack_unpack),
#                    the EP=2 layer checks (padded / nvlink x ECHO off / on), ~250 s
#   gateup      2    one gate/up GEMM: its GPU tests and gate_up_gemm.py at three shapes
#   router      1    the fused router's GPU tests, then benchmarks/router.py (fused vs torch, eager and graphed)
#                    -> router_1x<GPU>.md
#   route_layout 2   the slot-layout kernels' GPU tests; slot_ranks graphed vs torch (and the build/base.tgz tree); the
#                    dispatch parts at 4096/16384 x 7168 -> route_layout_1x<GPU>.md, dispatch_ep2_2x<GPU>.md
#   gathered    1    QuACK GEMMs gathering token rows by index vs expanded expert rows (gather_gemm.py), then
#                    gathered_experts' GPU tests (after quack_unpack) -> gather_gemm_1x<GPU>.md
#   grouped_fp8 1    the experts' grouped GEMMs at their shapes (SHAPES=EXPERTSxHIDDENxDIMxROWS ...): bf16 and FP8,
#                    torch's, kernels/fp8_gemm.py's tile configurations and DeepGEMM's 1x128 / 128x128 block-scaled
#                    GEMM (built from .deepgemm/src by build_deepgemm.sh; kept in build/deepgemm; DEEPGEMM=0: none);
#                    -> grouped_gemm_fp8_1x<GPU>.md; WGRAD=1: the weight-gradient GEMMs too (_wgrad_1x<GPU>.md)
#   fp8_ffn     1    a dense SwiGLU feed-forward in FP8: torchao's Float8Linear vs the FP8 experts' kernels as one
#                    expert, bf16 beside (SHAPES=TOKENSxDIMxHIDDEN ...) -> fp8_ffn_1x<GPU>.md
#   fp8_linear  1    the attention's projections in FP8: torchao's Float8Linear vs Fp8RowsLinear, bf16 beside
#                    (SHAPES=TOKENSxDIM ...) -> fp8_linear_1x<GPU>.md
#   fp8_requant 1    the FP8 weight gradients' transposed e4m3 operands, every requantiser tile, against a copy of
#                    the same bytes (SHAPES=EXPERTSxCOLUMNSxROWS ...) -> fp8_requant_1x<GPU>.md
#   fill_profile 2   the compiled v2lite_6b_2gpu step profiled at EP=2, graphed (GRAPH=false: eager), one profile per
#                    variant side by side (VARIANTS="echo=--moe_echo.echo true;off=--moe_echo.echo false", ARGS for all, LABEL;
#                    DETAIL="echo collectives": those categories' largest kernels by op)
#                    -> step_breakdown_v2lite_6b_2gpu_<LABEL>_graph_<GRAPH>_2x<GPU>.md
#   profile     1-2  an eager run with [profiling] traces, then rank 0's per-step GPU time by category
#                    (CONFIGS=..., LABEL=before|after, ARGS=extra recipe args, NPROC=2 with
#                    ARGS="--parallelism.expert_parallel_degree 2 ...") -> step_breakdown_<config>_<LABEL>_<N>x<GPU>.md
#   sync        1    debug_gpu: 4 eager steps under sync_debug (the traceback of a host sync, if any), then 6
#                    graphed steps (whether the capture succeeds, and its error if not)
#   dp_vs_ep    2    v2lite_1b: plain data parallel vs EP=2 (padded, alltoall)
#   planner     1    ECHO planner time in a CUDA graph; simulated EP=8/16 straggler time -> planner_time_1x<GPU>.md,
#                    echo_sim_1x<GPU>.md
#   echo        2    ECHO on/off with 8 hot experts (padded, capacity 2.0 / 1.25); echo_recompute memory
#   echo_e2e    2    sync-free EP checks; ECHO on/off, dropless replay, the `fastest` dispatcher choice
#   ep4         4    dispatch at EP=4; v2lite_1b EP=4 nvlink, 100 steps, sync_debug, ECHO off/on x routing
#   ep4_padded  4    v2lite_1b EP=4 padded, 60 steps, ECHO off/on x routing
#   ep4_6b      4    v2lite_6b EP=4 nvlink: PART=a natural routing ECHO off/on; b 8 hot experts; c graphed
#   scaling     1/2/4 v2lite_1b tokens/s per GPU at 1, 2, 4 GPUs (EP = GPUs, padded, ECHO on) -> scaling_4x<GPU>.md;
#                    PART=b compiled + graphed, nvlink, one invocation: default, fsdp_reshard_after_forward never, ECHO on, bf16 reduce
#   fp8_step    1/2  FP8 on the whole step ([model] converters = ["float8"] + FP8 experts): PART=a tests and
#                    v2lite_1b bf16 vs FP8 beside torchtitan's float8; b (2 GPUs) 500-step loss parity, eager and
#                    compiled FP8; c (2 GPUs) v2lite_6b_2gpu EP=2 (HEAD=1: head in FP8 too; BASE=1: vs
#                    build/base.tgz; WIRE=0: only that), the fp8 dispatch wire at EP=2 and across 2 emulated hosts; d (1 GPU) FP8 by part and scaling; f (1 GPU) which dense layers pay
#                    (filter_fqns); h (1 GPU) FP8 here vs FP8 on build/base.tgz's tree (HEAD=1: head in FP8); p bf16 and FP8
#                    profiled; g (2 GPUs) the FSDP FP8 all-gather tested and measured beside torchtitan's; e (2 GPUs)
#                    v2lite_6b_2gpu 500-step loss parity (RUNS= bf16 fp8 bf16_compile fp8_compile fp8_head_compile
#                    fp8_all_compile, a subset per invocation); l (1 GPU) loss parity of one FP8 variant (VARIANT=, default the output
#                    head in FP8); o (1 GPU) the FP8 output head's tests and its head + loss beside bf16's and
#                    torchao's; q (1 GPU) the FP8 head's trained weights evaluated with the head in FP8 and in bf16;
#                    s (2 GPUs) PART=l at two seeds side by side (SEEDS=); k (2 GPUs) which of the FP8 head's three
#                    GEMMs moves the loss (each in bf16 in turn, 500 steps)
#   guard       1    cost of the non-finite guard: v2lite_1b (CONFIGS=...), eager and graphed, on vs off
#   titan       2    torchtitan's own trainer with our TrainSpec (EP=2, ECHO) vs the recipe: per-step losses
#   overlap_profile 2  the graphed v2lite_1b step at EP=2 profiled: nvlink and padded, whole and in 2 chunks
#                    (overlap_chunks); communication kernels and the part no other kernel hides
#                    -> step_breakdown_v2lite_1b_gpu_overlap_ep2_2x<GPU>.md (PART=nvlink: nvlink only; EP=4 on 4 GPUs,
#                    ARGS= for every run, LABEL names the file)
#   graph_profile 2  the graphed + compiled v2lite_1b step profiled at EP=2 (nvlink) and EP=1, one table; the
#                    one-GPU e2e row ep1_ref -> step_breakdown_v2lite_1b_gpu_graph_compile_ep1_vs_ep2_2x<GPU>.md;
#                    PART=ep4 (4 GPUs): EP=4, ranks 0 and 3 -> step_breakdown_v2lite_1b_gpu_graph_compile_ep4_4x<GPU>.md
#   before_after 2   this tree against an older one checked out at PREV (git worktree add build/prev REV; copy
#                    build): dispatch at 16384x2048, v2lite_1b EP=2 nvlink graphed (capacity 2.0) with torchtitan
#                    compiled, and both trees' eager step profiles (PART=dispatch | e2e | profile; default all)
#   ep8         8    not run yet (needs an 8-GPU host): PART=a dispatch EP=2/8; b v2lite_1b EP=8; c scaling
#                    row + v2lite_6b graphed at EP=8
#   hosts       2/4  two emulated hosts (one torchrun agent per host, GPUs split between them, each its own
#                    NCCL_HOSTID): PART=a the hierarchical dispatcher's GPU tests (fp32 == alltoall, sync_debug) and
#                    the padded / layer EP tests, then dispatch_hosts.py (hierarchical vs padded vs alltoall: network
#                    bytes and time) -> dispatch_hosts_emulated_<N>x<GPU>.md; PART=b v2lite_1b graphed, hierarchical
#                    vs flat padded, ECHO off/on, natural and 8 hot experts -> e2e_<N>x<GPU>.md (label hosts2),
#                    e2e_hosts_<N>x<GPU>.md; PART=c hierarchical whole vs in 2 chunks (label overlap_hosts<L><L>).
#                    NET_THREADS=T (NET_SOCKS=S, default 4): NCCL's socket transport between the hosts on T threads
#                    x S sockets, a faster emulated network (labels end in _net<T>x<S>)
set -uo pipefail
if [ $# -gt 1 ]; then  # PART=b and the like are environment variables: as arguments they would be ignored
  echo "error: run.sh takes one suite name, got: $*; set the options before it: ${*:2} bash benchmarks/gpu/run.sh $1" >&2
  exit 2; fi
if [ "${1:-}" = quack_unpack ]; then  # step 1 of 2 for QuACK (build/quack alone: with .whl it is too large to copy at once)
  xz -dc build/quack/ir.so.xz > /tmp/quack_ir.so && ls -la /tmp/quack_ir.so; exit; fi
source benchmarks/gpu/lib.sh
suite=${1:?usage: run.sh SUITE (see the header of benchmarks/gpu/run.sh)}
case $suite in
  tests)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpus.txt"
    python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpus.txt"
    only="not run_stops and not nonfinite_weights and not fresh_run and not bad"
    case "${PART:-a}" in
      a) files="tests/test_gpu.py tests/test_gpu_ep.py tests/test_profiling.py tests/test_checkpoint_verify.py
                tests/test_reliability.py" ;;
      # tests/test_gpu_train.py, ~20 recipe runs on 2 GPUs: b the graphed == eager cases (~6 minutes), c the rest
      b) files="tests/test_gpu_train.py"; only="$only and graph_equals_eager" ;;
      *) files="tests/test_gpu_train.py"; only="$only and not graph_equals_eager" ;;
    esac
    timeout ${TMO:-580} python3 -m pytest $files -k "$only" \
      -p no:warnings -q -rfEs --durations=15 --junitxml="$OUT/gpu_tests_${PART:-a}.xml" 2>&1 | tee "$OUT/gpu_tests_${PART:-a}.log" | tail -40
    for f in /tmp/pytest-of-*/pytest-*/test_nvlink_capacity_grows*/grow/metrics.jsonl; do
      [ -f "$f" ] && python3 -c "
import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]
print('grow-to-fit replayed steps', [x['step'] for x in r if x.get('moe/replayed')])" "$f" | tee -a "$OUT/gpu_tests_${PART:-a}.log"
    done ;;

  graph)  # -> benchmarks/results/gpu_tests_4xH200.md
    nvidia-smi --query-gpu=name --format=csv,noheader | head -4
    grep -c "was_allocated_during_stream_capture" $(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))")/include/ATen/core/CachingHostAllocator.h
    (
      export CUDA_VISIBLE_DEVICES=0,1 PET_MASTER_PORT=29510
      timeout 330 python3 -m pytest tests/test_gpu_train.py -p no:warnings -q -s > "$OUT/gpu_train.log" 2>&1
      echo "gpu_train rc=$?" >> "$OUT/gpu_train.log"
      timeout 150 python3 -m pytest tests/test_gpu_train.py -k "overflow and recapture" \
        -p no:warnings -q -s > "$OUT/recapture_test.log" 2>&1
      echo "recapture_test rc=$?" >> "$OUT/recapture_test.log"
    ) &
    (
      export CUDA_VISIBLE_DEVICES=2,3 PET_MASTER_PORT=29520
      timeout 240 python3 -m pytest -x tests/test_gpu_ep.py -p no:warnings -q -s > "$OUT/gpu_ep.log" 2>&1
      echo "gpu_ep rc=$?" >> "$OUT/gpu_ep.log"
      timeout 180 torchrun --nproc_per_node 2 --master_port 29530 recipes/pretrain.py \
        --job.config_file train_configs/v2lite_1b_gpu.toml --training.steps 40 --metrics.log_freq 1 \
        --metrics.enable_tensorboard false --checkpoint.enable false --parallelism.expert_parallel_degree 2 \
        --moe_echo.dispatcher nvlink --moe_echo.capacity_factor 1.5 --training.cuda_graph true \
        --training.cuda_graph_after_replay recapture --job.dump_folder /tmp/v2_recap > "$OUT/recapture_v2lite.log" 2>&1
      echo "recapture_v2lite rc=$?" >> "$OUT/recapture_v2lite.log"
      cp /tmp/v2_recap/metrics.jsonl "$OUT/recapture_v2lite_metrics.jsonl" 2>/dev/null
    ) &
    wait
    for f in gpu_train gpu_ep recapture_test; do echo "== $f"; tail -8 "$OUT/$f.log"; done
    echo "== recapture_v2lite"; grep -E "cuda graph|rc=|rror|misaligned|overflow " "$OUT/recapture_v2lite.log" | grep -v "^\[rank1\]" | head -20
    python3 -c "
import json
for l in open('$OUT/recapture_v2lite_metrics.jsonl'):
    r=json.loads(l); print(r['step'], round(r['loss'],4), r.get('moe/overflow_assignments'), r.get('moe/replayed_steps'))" 2>&1 | tail -8 ;;

  sanitize)  # the graphed EP step under compute-sanitizer, four runs at once (distinct ports) -> sanitizer_2x<GPU>.md
    # memcheck checks every kernel and reports failed CUDA API calls with their Python frames; racecheck and
    # synccheck check the kernels named *_kernel (ours and ATen's): NCCL's partial-block barriers and cuBLAS's
    # asynchronous shared-memory copies are misread by them (and synccheck aborts the run on NCCL's)
    san() {  # tool, port, echo, graph, extra sanitizer args
      timeout ${TMO:-450} compute-sanitizer --tool $1 --target-processes all --print-limit 2000 ${5:-} \
        torchrun --nproc_per_node 2 --master_port $2 recipes/pretrain.py --job.config_file train_configs/debug_gpu.toml \
        --training.steps ${STEPS:-10} --metrics.log_freq 1 --metrics.enable_tensorboard false --checkpoint.enable false \
        --parallelism.expert_parallel_degree 2 --moe_echo.dispatcher nvlink --moe_echo.echo $3 \
        --moe_echo.debug_hot_experts 1 --moe_echo.bias_update_rate 0 --moe_echo.capacity_factor 1.0 \
        --moe_echo.grow_capacity_after 1 --training.cuda_graph $4 --job.dump_folder /tmp/san_$1_$3_$4 \
        > "$OUT/san_$1_echo_$3_graph_$4.log" 2>&1
      echo "rc=$?" >> "$OUT/san_$1_echo_$3_graph_$4.log"
    }
    ours="--kernel-name kns=_kernel"
    san memcheck 29610 false false & san memcheck 29620 true false & san memcheck 29630 false true &
    san memcheck 29640 true true & san racecheck 29650 true true "$ours" & san synccheck 29660 true true "$ours" & wait
    for f in "$OUT"/san_*.log; do
      echo "== $(basename $f): $(grep -c 'captured the training step' $f) captures, $(grep -c 'overflow replayed' $f) growths, $(tail -1 $f)"
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|cuda graph: off|Error: " $f | grep -v "^=========     " | sort | uniq -c | head -6
      python3 benchmarks/sanitizer_report.py $f
    done ;;

  recapture)  # -> recapture_2x<GPU>.md
    common="--training.steps 200 --metrics.log_freq 1 --parallelism.expert_parallel_degree 2"
    for run in exact200 exact200b; do FROM=0 TMO=200 recipe $run 2 $common --moe_echo.dispatcher alltoall | head -1; done
    nvl="--moe_echo.dispatcher nvlink --moe_echo.capacity_factor 1.0"
    FROM=0 TMO=200 recipe eager200 2 $common $nvl | head -1
    FROM=0 TMO=200 recipe recap200 2 $common $nvl --training.cuda_graph true --training.sync_debug true | head -1
    grep -E "cuda graph|overflow replayed" "$OUT/recap200.log" | grep -v "^\[rank1\]" | head -12
    for pair in "exact200 exact200b" "eager200 recap200" "exact200 recap200"; do
      set -- $pair; echo "-- $1 vs $2"
      python3 -c "
import json, sys
a, b = ({r['step']: r['loss'] for r in map(json.loads, open(f))} for f in sys.argv[1:])
rel = [(abs(b[s] - a[s]) / abs(a[s]), s) for s in sorted(set(a) & set(b))]
print('largest step difference over steps 1-20: %.2e at step %d' % max(rel[:20]))" "$OUT/$1.jsonl" "$OUT/$2.jsonl"
      python3 benchmarks/loss_match.py "$OUT/$1.jsonl" "$OUT/$2.jsonl" --max-rel 2e-2 --tail-rel 1e-2 | tail -1
    done ;;

  layer)  # -> moe_layer_1x<GPU>.md
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
    megatron_setup
    python3 -m pytest tests/test_gpu.py tests/test_kernels.py tests/test_layer.py tests/test_models.py \
      tests/test_megatron_layer.py tests/test_fp8_experts.py -p no:warnings 2>&1 \
      | tee "$OUT/layer_tests.log" | tail -15
    CUDA_VISIBLE_DEVICES=0 python3 benchmarks/moe_layer.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/moe_layer.log" | tail -40 ;;

  fp8_step)  # -> e2e_<N>x<GPU>.md (labels fp8_*, titan_fp8*), loss curves, dispatch_hosts_fp8_wire_*.md
    # RECIPE: the dense layers' scaling (tensorwise, torchao's default; the rows labelled fp8_step ran RECIPE=rowwise)
    F8="--model.converters float8 --quantize.linear.float8.recipe_name ${RECIPE:-tensorwise} --moe_echo.expert_precision fp8"
    T8="--model.converters quantize.linear.float8 --quantize.linear.float8.recipe_name ${RECIPE:-tensorwise}"
    case "${PART:-a}" in
      a)  # one GPU: the FP8 tests, then v2lite_1b bf16 vs FP8 (dense + experts), and torchtitan's float8 beside
        export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
        python3 -m pytest tests/test_float8.py tests/test_fp8_wire.py tests/test_fp8_experts.py -p no:warnings -q \
          -rfEs 2>&1 | tail -4
        python3 -m pytest tests/test_gpu_train.py -k float8 -p no:warnings -q -rfEs 2>&1 | tail -3
        python3 benchmarks/e2e.py --configs v2lite_1b_gpu --runs ours_compile_graph --steps 30 --label fp8_step \
          --variants "bf16=;fp8=$F8" --out "$OUT" 2>&1 | noise | grep -E "^\| v2lite" | tail -4
        python3 benchmarks/e2e.py --configs v2lite_1b_gpu --runs torchtitan_compile,torchtitan --steps 30 --label titan_fp8 \
          --titan "$T8" --out "$OUT" 2>&1 | noise | grep -E "^\| v2lite" | tail -2 ;;
      b)  # loss parity, 500 steps, two GPUs side by side: bf16 then bf16 compiled (two equivalent bf16 runs: the
          # noise floor) on one, FP8 then FP8 compiled on the other -> docs/img/fp8_loss.png
        G="--training.steps 500 --training.cuda_graph true"
        (export CUDA_VISIBLE_DEVICES=0 PET_MASTER_PORT=29511; TMO=280 recipe f8_loss_bf16 1 $G
         TMO=280 recipe f8_loss_bf16_compile 1 $G --compile.enable true) &
        (export CUDA_VISIBLE_DEVICES=1 PET_MASTER_PORT=29522; TMO=280 recipe f8_loss_fp8 1 $G $F8
         TMO=280 recipe f8_loss_fp8_compile 1 $G $F8 --compile.enable true) &
        wait
        for r in f8_loss_fp8 f8_loss_fp8_compile; do
          python3 benchmarks/loss_match.py "$OUT/f8_loss_bf16.jsonl" "$OUT/$r.jsonl" --floor "$OUT/f8_loss_bf16_compile.jsonl" \
            --plot "$OUT/$r.png" --names "bf16,$r,bf16 compiled" | tail -2
        done ;;
      l)  # one GPU, loss parity of one FP8 variant, one run after another (STEPS, default 500, graphed): bf16, bf16
          # compiled (with bf16: the noise floor), FP8 compiled with VARIANT's extra arguments (default: the output
          # head in FP8 too) -> <NAME>.png; SEED= another [training] seed for all three (names end in _s<SEED>)
        export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
        G="--training.steps ${STEPS:-500} --training.cuda_graph true --training.seed ${SEED:-0}"
        s=${SEED:+_s$SEED}
        name=${NAME:-f8_loss_fp8_head}$s
        TMO=280 recipe f8_loss_bf16$s 1 $G
        TMO=280 recipe f8_loss_bf16_compile$s 1 $G --compile.enable true
        TMO=280 recipe $name 1 $G $F8 --compile.enable true ${VARIANT:---quantize.linear.float8.filter_fqns router.gate}
        python3 benchmarks/loss_match.py "$OUT/f8_loss_bf16$s.jsonl" "$OUT/$name.jsonl" --floor \
          "$OUT/f8_loss_bf16_compile$s.jsonl" --plot "$OUT/$name.png" --names "bf16,$name,bf16 compiled" | tail -2 ;;
      s)  # two GPUs: PART=l (VARIANT, NAME as there) at two seeds at once, GPU i running the i-th of SEEDS (default
          # "0 1"); each FP8 run also against bf16 compiled (both compiled), then all seeds by loss_seeds.py ->
          # seed<SEED>.txt, <NAME>_s<SEED>.png, and the runs' logs and metrics in loss_runs.tgz (what comes back of
          # $OUT is a few files)
        i=0
        for seed in ${SEEDS:-0 1}; do
          (export CUDA_VISIBLE_DEVICES=$i PET_MASTER_PORT=$((29511 + 11 * i)); SEED=$seed PART=l bash "$0" fp8_step \
            > "$OUT/seed$seed.txt" 2>&1) &
          i=$((i + 1))
        done
        wait
        for seed in ${SEEDS:-0 1}; do
          echo "== seed $seed"; grep -E "^(==|loss curves|noise floor)" "$OUT/seed$seed.txt" | cut -c1-250
          python3 benchmarks/loss_match.py "$OUT/f8_loss_bf16_compile_s$seed.jsonl" \
            "$OUT/${NAME:-f8_loss_fp8_head}_s$seed.jsonl" | tail -1
        done
        python3 benchmarks/loss_seeds.py "$OUT" --other "${NAME:-f8_loss_fp8_head}" --seeds ${SEEDS:-0 1}
        (cd "$OUT" && tar czf loss_runs.tgz ./*.jsonl ./*.log && rm -f ./*.jsonl ./*.log) ;;
      c)  # two GPUs: v2lite_6b_2gpu at EP=2 (with torchtitan's float8, compiled), the fp8 wire at EP=2 (padded, bf16
          # vs fp8 rows), then across 2 emulated hosts. HEAD=1: a third variant, the output head in FP8 too (label
          # ..._head); WGRAD=1: another, the experts' weight gradients in FP8 too (with HEAD=1: bf16, the FP8 head,
          # the FP8 head + FP8 weight gradients); FFN=1 with HEAD=1: bf16, the FP8 head, the FP8 head with the dense
          # feed-forwards on the FP8 experts' kernels (LIN=1: and a fourth, the attention projections too); ECHO=1:
          # bf16 and the last FP8 variant, each with ECHO on, beside the others; EXTRA="SUFFIX=ARGS": the last FP8
          # variant with ARGS added (named <it>_SUFFIX; EXTRA="wire=--moe_echo.dispatch_precision fp8" its rows FP8 on
          # the wire); PICK="NAME ...": only those variants;
          # TITAN=0: no torchtitan run; BASE=1: FP8 here vs FP8 on
          # build/base.tgz's tree (as PART=h; HEAD=1 puts both heads in FP8, ARGS="..." adds arguments to both),
          # no torchtitan run; REPEATS=N: our runs N times in turn; WIRE=0: the step only; LABEL= names the rows
        label=$([ "${RECIPE:-tensorwise}" = rowwise ] && echo fp8_step || echo fp8_${RECIPE:-tensorwise})${HEAD:+_head}
        H8=${HEAD:+ --quantize.linear.float8.filter_fqns router.gate}
        V="bf16=;fp8=$F8${HEAD:+;fp8_head=$F8$H8}${WGRAD:+;fp8_wgrad8=$F8 --moe_echo.expert_wgrad_precision fp8}"
        [ -n "${HEAD:-}" ] && [ -n "${WGRAD:-}" ] &&  # both: the FP8 head without and with the FP8 weight gradients
          V="bf16=;fp8_head=$F8$H8;fp8_head_wgrad8=$F8$H8 --moe_echo.expert_wgrad_precision fp8"
        [ -n "${HEAD:-}" ] && [ -n "${FFN:-}" ] &&  # the FP8 head without and with the feed-forwards on the experts'
          { V="bf16=;fp8_head=$F8$H8;fp8_head_ffn_experts=$F8$H8 --moe_echo.dense_ffn_kernels experts"  # kernels
            label=fp8_ffn_experts_ep2; }
        [ -n "${HEAD:-}" ] && [ -n "${FFN:-}" ] && [ -n "${LIN:-}" ] &&  # LIN=1: the attention projections too
          { V="$V;fp8_head_all_experts=$F8$H8 --moe_echo.dense_ffn_kernels experts --moe_echo.dense_linear_kernels experts"
            label=fp8_all_experts_ep2; }
        [ -n "${ECHO:-}" ] &&  # ECHO=1: bf16 and the last FP8 variant above with ECHO leveling the two ranks too
          { last=${V##*;}; V="$V;bf16_echo=--moe_echo.echo true;${last%%=*}_echo=${last#*=} --moe_echo.echo true"
            label=${label}_echo; }
        [ -n "${EXTRA:-}" ] &&  # EXTRA="SUFFIX=ARGS": the last FP8 variant with ARGS too, named <it>_SUFFIX
          { last=$(IFS=';'; for x in $V; do case $x in fp8*) y=$x;; esac; done; printf '%s' "$y")
            V="$V;${last%%=*}_${EXTRA%%=*}=${last#*=} ${EXTRA#*=}"; }
        V=$(pick_variants "$V")  # PICK="NAME ...": only those
        if [ -n "${BASE:-}" ]; then
          [ -d /tmp/base/recipes ] || { echo "fp8_step PART=c BASE=1: no build/base.tgz to compare with"; exit 1; }
          H8="$H8${ARGS:+ $ARGS}"; V="bf16=;fp8_base=@/tmp/base $F8$H8;fp8=$F8$H8"; label=${label}_base; fi
        python3 benchmarks/e2e.py --configs v2lite_6b_2gpu --nproc 2 --runs ours_compile_graph --steps 20 \
          --repeats ${REPEATS:-1} --label ${LABEL:-$label} --variants "$V" \
          --out "$OUT" 2>&1 | noise | grep -E "^\| v2lite" | tail -4
        [ -z "${BASE:-}" ] && [ "${TITAN:-1}" = 1 ] && python3 benchmarks/e2e.py --configs v2lite_6b_2gpu --nproc 2 --runs torchtitan_compile \
          --steps 20 --label titan_fp8 --titan "$T8" --out "$OUT" 2>&1 | noise | grep -E "^\| v2lite" | tail -1
        [ "${WIRE:-1}" = 0 ] && exit 0
        python3 benchmarks/e2e.py --configs v2lite_1b_gpu --nproc 2 --runs ours_graph --steps 20 --label fp8_wire \
          --ours "--parallelism.expert_parallel_degree 2 --moe_echo.dispatcher padded --moe_echo.capacity_factor 2.0" \
          --variants "bf16_wire=;fp8_wire=--moe_echo.dispatch_precision fp8" --out "$OUT" 2>&1 | noise | grep -E "^\| v2lite"
        timeout 240 python3 benchmarks/dispatch_hosts.py --hosts 2 --gpus-per-host 1 --label fp8_wire --out "$OUT" \
          2>&1 | noise | tail -12 ;;
      d)  # one GPU, v2lite_1b compiled + graphed: which part of FP8 pays (dense only, experts only, both; tensorwise and
          # rowwise, whose experts scale their weights per channel; both_rowwise_expert_scales: per expert instead;
          # both_tensorwise_head: the output head in FP8 too, filter_fqns naming only what is always kept;
          # both_tensorwise_wgrad8: the experts' weight gradients in FP8 too; both_tensorwise_head_wgrad8: both;
          # both_tensorwise_head_ffn_experts: the head converted, the dense feed-forwards on the FP8 experts' kernels;
          # both_tensorwise_head_all_experts: the attention projections on them too)
        D8="--model.converters float8 --moe_echo.expert_precision bf16 --quantize.linear.float8.recipe_name"
        # PICK="NAME ..." runs only those variants (label fp8_head: PICK="both_tensorwise both_tensorwise_head")
        one_gpu_variants ${LABEL:-fp8_parts} "bf16=;experts=--moe_echo.expert_precision fp8;dense_rowwise=$D8 rowwise;dense_tensorwise=$D8 tensorwise;both_rowwise=$F8 --quantize.linear.float8.recipe_name rowwise;both_rowwise_expert_scales=$F8 --quantize.linear.float8.recipe_name rowwise --moe_echo.expert_fp8_scaling expert;both_tensorwise=$F8 --quantize.linear.float8.recipe_name tensorwise;both_tensorwise_head=$F8 --quantize.linear.float8.recipe_name tensorwise --quantize.linear.float8.filter_fqns router.gate;both_tensorwise_wgrad8=$F8 --quantize.linear.float8.recipe_name tensorwise --moe_echo.expert_wgrad_precision fp8;both_tensorwise_head_wgrad8=$F8 --quantize.linear.float8.recipe_name tensorwise --quantize.linear.float8.filter_fqns router.gate --moe_echo.expert_wgrad_precision fp8;both_tensorwise_head_ffn_experts=$F8 --quantize.linear.float8.recipe_name tensorwise --quantize.linear.float8.filter_fqns router.gate --moe_echo.dense_ffn_kernels experts;both_tensorwise_head_all_experts=$F8 --quantize.linear.float8.recipe_name tensorwise --quantize.linear.float8.filter_fqns router.gate --moe_echo.dense_ffn_kernels experts --moe_echo.dense_linear_kernels experts" ;;
      f)  # one GPU, v2lite_1b compiled + graphed: which dense layers pay in FP8 (filter_fqns; auto_filter_small_kn:
          # torchao's size thresholds, torchtitan's flag), the experts in FP8 throughout
        K="--quantize.linear.float8.filter_fqns"
        one_gpu_variants ${LABEL:-fp8_filter} "bf16=;fp8=$F8;fp8_auto=$F8 $K output,auto_filter_small_kn;fp8_kv_bf16=$F8 $K output,wkv_a,wkv_b;fp8_attention_bf16=$F8 $K output,attention;fp8_shared_bf16=$F8 $K output,shared_experts;fp8_rowwise_auto=$F8 $K output,auto_filter_small_kn --quantize.linear.float8.recipe_name rowwise" ;;
      h)  # one GPU, v2lite_1b compiled + graphed: FP8 (dense tensorwise + experts) on this tree beside the same on the
          # tree in build/base.tgz (git archive REV recipes components kernels train_configs | gzip > build/base.tgz),
          # e.g. the experts' FP8 GEMM before a change to it; bf16 as the reference of both; HEAD=1: the output head
          # in FP8 too (both trees); ARGS="...": more arguments for both FP8 runs
        [ -d /tmp/base/recipes ] || { echo "fp8_step PART=h: no build/base.tgz to compare with"; exit 1; }
        H8="${HEAD:+ --quantize.linear.float8.filter_fqns router.gate}${ARGS:+ $ARGS}"
        one_gpu_variants ${LABEL:-fp8_base} "bf16=;fp8_base=@/tmp/base $F8$H8;fp8=$F8$H8" ;;
      k)  # two GPUs: which of the FP8 output head's GEMMs moves the loss (benchmarks/fp8_head_gemms.py). The FP8 step
          # (compiled, graphed, STEPS default 500, SEED) with the head in bf16 ("ref", the reference) and as an
          # Fp8Head with the GEMMs named in FP8 ("all": the three; "none": an Fp8Head all in bf16, the reference's
          # math in other kernels, the noise floor). v2lite_1b (default): six runs, three a GPU, GPU 0: ref, all,
          # grad_input,grad_weight; GPU 1: none, output,grad_weight, output,grad_input. NPROC=2: v2lite_6b_2gpu at
          # EP=2 on both GPUs, the runs of HEADS (default "ref all") in turn, each ~3.5 min -> head_<GEMMS>.png, the
          # losses and logs in loss_runs.tgz
        G="--training.steps ${STEPS:-500} --training.cuda_graph true --training.seed ${SEED:-0} --compile.enable true"
        H8="--quantize.linear.float8.filter_fqns router.gate"
        head_runs() {  # nproc, then each run: ref, all, none or a --head-fp8 value
          local n=$1 g; shift
          for g in "$@"; do
            if [ "$g" = ref ]; then TMO=${TMO:-200} recipe head_ref $n $G $F8; continue; fi
            [ "$g" = all ] && g=output,grad_input,grad_weight
            TMO=${TMO:-200} SCRIPT="benchmarks/fp8_head_gemms.py --head-fp8 $g" recipe head_${g//,/-} $n $G $F8 $H8
          done
        }
        if [ "${NPROC:-1}" = 2 ]; then
          CFG=train_configs/v2lite_6b_2gpu.toml TMO=${TMO:-290} head_runs 2 ${HEADS:-ref all} 2>&1 | cut -c1-300
        else
          (export CUDA_VISIBLE_DEVICES=0 PET_MASTER_PORT=29511; head_runs 1 ref all grad_input,grad_weight > "$OUT/gpu0.txt" 2>&1) &
          (export CUDA_VISIBLE_DEVICES=1 PET_MASTER_PORT=29522; head_runs 1 none output,grad_weight output,grad_input \
            > "$OUT/gpu1.txt" 2>&1) &
          wait
          cat "$OUT/gpu0.txt" "$OUT/gpu1.txt" | grep -E "^(==|tok/s)" | cut -c1-300
        fi
        for f in "$OUT"/head_*.jsonl; do
          r=$(basename "$f" .jsonl)
          case $r in head_ref|head_none) continue;; esac
          [ -f "$OUT/head_ref.jsonl" ] || continue
          floor=$([ -f "$OUT/head_none.jsonl" ] && echo "--floor $OUT/head_none.jsonl")
          echo "== ${r#head_} in FP8"
          python3 benchmarks/loss_match.py "$OUT/head_ref.jsonl" "$f" $floor --plot "$OUT/$r.png" \
            --names "head bf16,head FP8: ${r#head_},head bf16 (Fp8Head)" | tail -2
        done
        (cd "$OUT" && tar czf loss_runs.tgz ./*.jsonl ./*.log && rm -f ./*.jsonl ./*.log) ;;
      q)  # one GPU: whose is the FP8 output head's higher loss, the model's or the loss's own rounding? v2lite_1b
          # with the head in FP8 trained 500 steps (compiled, graphed, a DCP checkpoint at the end); then those
          # weights' loss on the first EVAL (default 20) batches, lr 1e-12 (recipes/finetune.py): the head in FP8 as
          # trained, the head in bf16 (the rest as trained), everything bf16 -> f8_eval_*.jsonl and a summary line
        export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
        H8="--quantize.linear.float8.filter_fqns router.gate"
        TMO=300 recipe f8_eval_train 1 --training.steps 500 --training.cuda_graph true --compile.enable true $F8 $H8 \
          --checkpoint.enable true --checkpoint.interval 500 | cut -c1-300
        ck=/tmp/run_f8_eval_train/checkpoint/step-500
        [ -f $ck/COMPLETE ] || { echo "fp8_step PART=q: no checkpoint at $ck"; exit 1; }
        for v in "head_fp8=$F8 $H8" "head_bf16=$F8" "bf16="; do
          name=${v%%=*}; rm -rf /tmp/run_eval_$name
          timeout 240 torchrun --nproc_per_node 1 recipes/finetune.py --job.config_file train_configs/v2lite_1b_gpu.toml \
            --job.dump_folder /tmp/run_eval_$name --metrics.enable_tensorboard false --checkpoint.enable false \
            --checkpoint.initial_load_path $ck --training.steps ${EVAL:-20} --optimizer.lr 1e-12 --metrics.log_freq 1 \
            --training.cuda_graph true ${v#*=} > "$OUT/f8_eval_$name.log" 2>&1
          echo "== eval $name rc=$?"; cp /tmp/run_eval_$name/metrics.jsonl "$OUT/f8_eval_$name.jsonl"
        done
        python3 -c "
import json
m = {n: [r['loss'] for r in map(json.loads, open('$OUT/f8_eval_%s.jsonl' % n)) if 'loss' in r] for n in ('head_fp8', 'head_bf16', 'bf16')}
b = sum(m['head_bf16']) / len(m['head_bf16'])
print('; '.join('%s %.4f (%+.2f%% vs the head in bf16, %d batches)' % (n, sum(v) / len(v), 100 * (sum(v) / len(v) / b - 1), len(v)) for n, v in m.items()))" ;;
      o)  # one GPU: the FP8 output head's tests, the loss's backward in the forms the head reads, then head + loss
          # against bf16's and torchao's (v2lite_1b's shape) -> cross_entropy_fp8_1x<GPU>.md, fp8_head_1x<GPU>.md
        export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
        python3 -m pytest tests/test_fp8_head.py tests/test_cross_entropy.py -p no:warnings -rfEs 2>&1 | tail -4
        python3 benchmarks/cross_entropy_fp8.py --out "$OUT" 2>&1 | noise | tail -9
        python3 benchmarks/fp8_head.py --out "$OUT" 2>&1 | noise | tail -9 ;;
      p)  # one GPU, v2lite_1b compiled + graphed: bf16 and FP8 profiled -> step_breakdown_v2lite_1b_gpu_fp8_vs_bf16_1x<GPU>.md
          # (RECIPE=rowwise made that file), ..._fp8_vs_bf16_<RECIPE>_1x<GPU>.md for another RECIPE; HEAD=1 profiles
          # the output head in FP8 as a third column (..._<RECIPE>_head_1x<GPU>.md)
        export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
        PROF="--training.steps 14 --metrics.log_freq 2 --profiling.enable_profiling true --profiling.profile_freq 12
              --profiling.profiler_warmup 8 --profiling.profiler_active 4 --training.cuda_graph true --compile.enable true"
        # FFN=1: bf16, the FP8 head, and the FP8 head with the dense feed-forwards on the experts' kernels (..._head_ffn)
        H8="--quantize.linear.float8.filter_fqns router.gate"
        # LIN=1 with FFN=1: a fourth column, the attention projections on those kernels too (..._head_ffn_lin)
        cols="bf16 fp8 ${HEAD:+fp8_head}"; [ -n "${FFN:-}" ] && cols="bf16 fp8_head fp8_head_ffn${LIN:+ fp8_head_all}"
        for n in $cols; do
          X="--moe_echo.dense_ffn_kernels experts"
          case $n in bf16) a=;; fp8) a=$F8;; fp8_head) a="$F8 $H8";; fp8_head_ffn) a="$F8 $H8 $X";;
            fp8_head_all) a="$F8 $H8 $X --moe_echo.dense_linear_kernels experts";; esac
          TMO=200 FROM=6 recipe prof_$n 1 $PROF $a | tail -1
        done
        python3 benchmarks/step_breakdown.py $(for n in $cols; do
          echo "$n=$(ls /tmp/run_prof_$n/profile_traces/iteration_*/rank0_trace.json | tail -1)"; done) \
          --name v2lite_1b_gpu_fp8_vs_bf16$([ "${RECIPE:-tensorwise}" = rowwise ] || echo "_${RECIPE:-tensorwise}")${HEAD:+_head}${FFN:+_ffn}${LIN:+_lin} \
          --gpus 1 --out "$OUT" | head -${LINES_OUT:-40} ;;
      g)  # two GPUs, tensorwise: the FSDP FP8 all-gather tested, then v2lite_6b_2gpu at EP=2 without and with it, and
          # torchtitan's float8 with the same keys (compiled; it takes them only with recipe_name unset, which is
          # tensorwise); torchtitan's tensorwise float8 on v2lite_1b (one GPU)
        G8="--quantize.linear.float8.enable_fsdp_float8_all_gather --quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"
        python3 -m pytest tests/test_float8.py -p no:warnings -q -rfEs 2>&1 | tail -2
        python3 -m pytest tests/test_gpu_train.py -k float8_all_gather -p no:warnings -q -rfEs -s 2>&1 | grep -E \
          "float8 all-gather|passed|failed|Error" | tail -4
        python3 benchmarks/e2e.py --configs v2lite_6b_2gpu --nproc 2 --runs ours_compile_graph --steps 20 --label fp8_gather \
          --variants "fp8=$F8;fp8_gather=$F8 $G8" --out "$OUT" 2>&1 | noise | grep -E "^\| v2lite" | tail -2
        python3 benchmarks/e2e.py --configs v2lite_6b_2gpu --nproc 2 --runs torchtitan_compile --steps 20 \
          --label titan_fp8_gather --titan "--model.converters quantize.linear.float8 $G8" --out "$OUT" 2>&1 | noise | grep -E "^\| v2lite" | tail -1
        CUDA_VISIBLE_DEVICES=0 timeout ${TMO:-150} python3 benchmarks/e2e.py --configs v2lite_1b_gpu --runs torchtitan_compile \
          --steps 30 --label titan_fp8_tensorwise --titan "$T8" --out "$OUT" 2>&1 | noise | grep -E "^\| v2lite" \
          | tail -1 ;;
      e)  # two GPUs: v2lite_6b_2gpu at EP=2, 500 steps (graphed), RUNS= any of bf16, fp8, bf16_compile,
          # fp8_compile, fp8_head_compile (the output head in FP8 too), fp8_all_compile (every FP8 key: the head, the
          # dense feed-forwards and attention projections on the experts' kernels); default the first three; each
          # run ~3.5 min.
          # With both bf16 runs in the same invocation, each FP8 run is compared with bf16, the floor being bf16 vs
          # bf16 compiled (benchmarks/loss_match.py) -> fp8_loss_v2lite_6b[_<run>].png
        G="--training.steps 500 --training.cuda_graph true"
        for r in ${RUNS:-bf16 fp8 bf16_compile}; do
          case $r in bf16) a="";; fp8) a="$F8";; bf16_compile) a="--compile.enable true";;
            fp8_compile) a="$F8 --compile.enable true";;
            fp8_head_compile) a="$F8 --compile.enable true --quantize.linear.float8.filter_fqns router.gate";;
            fp8_all_compile) a="$F8 --compile.enable true --quantize.linear.float8.filter_fqns router.gate
              --moe_echo.dense_ffn_kernels experts --moe_echo.dense_linear_kernels experts";;
            *) echo "fp8_step PART=e: unknown run $r"; exit 1;; esac
          CFG=train_configs/v2lite_6b_2gpu.toml TMO=290 recipe "f8_6b_$r" 2 $G $a | cut -c1-300
        done
        for r in fp8 fp8_compile fp8_head_compile fp8_all_compile; do
          [ -f "$OUT/f8_6b_bf16.jsonl" ] && [ -f "$OUT/f8_6b_bf16_compile.jsonl" ] && [ -f "$OUT/f8_6b_$r.jsonl" ] || continue
          python3 benchmarks/loss_match.py "$OUT/f8_6b_bf16.jsonl" "$OUT/f8_6b_$r.jsonl" --floor \
            "$OUT/f8_6b_bf16_compile.jsonl" --plot "$OUT/fp8_loss_v2lite_6b${r#fp8}.png" --names "bf16,$r,bf16 compiled" \
            | tail -2
        done ;;
    esac ;;

  nvlink_fp8)  # the fp8 wire over NVLink (dispatch_precision = "fp8" with the nvlink dispatcher)
    case "${PART:-a}" in
      a)  # its GPU tests (2 GPUs; the wire's and the row kernels' on one), then dispatch at EP = all GPUs -> dispatch_ep<N>_nvlink_fp8_<N>x<GPU>.md
        timeout 300 python3 -m pytest -q -rA -p no:warnings tests/test_gpu_ep.py -k two_gpu 2>&1 | grep -E "^(PASSED|FAILED|ERROR)"
        timeout 200 python3 -m pytest -q -rA -p no:warnings tests/test_fp8_wire.py tests/test_kernels.py 2>&1 \
          | grep -E "^(PASSED|FAILED|ERROR)" | awk '{print $1}' | sort | uniq -c
        timeout 200 torchrun --nproc_per_node $(ngpus) benchmarks/dispatch.py --tokens 16384 --no-vdev --sweep 64 \
          --block-t 4 --label nvlink_fp8 --out "$OUT" 2>&1 | noise | grep -A8 "fp8 wire" ;;
      b)  # v2lite_1b compiled + graphed at EP=2 and 4, bf16 vs the fp8 wire -> e2e_<N>x<GPU>.md, label nvlink_fp8
        PART=b P=${P:-2,4} STEPS=${STEPS:-90} LABEL=nvlink_fp8 VARIANTS="bf16=;wire=--moe_echo.dispatch_precision fp8" \
          bash "$0" scaling ;;
      c)  # loss, v2lite_1b at EP=2 graphed, 300 steps: bf16, the fp8 wire, and bf16 compiled (the drift of two
          # equivalent bf16 runs) -> docs/img/nvlink_fp8_loss.png
        G="--training.steps 300 --training.cuda_graph true --parallelism.expert_parallel_degree 2"
        (export CUDA_VISIBLE_DEVICES=0,1 PET_MASTER_PORT=29511; TMO=200 recipe w_loss_bf16 2 $G
         TMO=240 recipe w_loss_bf16_compile 2 $G --compile.enable true) &
        (export CUDA_VISIBLE_DEVICES=2,3 PET_MASTER_PORT=29522; TMO=200 recipe w_loss_wire 2 $G \
           --moe_echo.dispatch_precision fp8) &
        wait
        python3 benchmarks/loss_match.py "$OUT/w_loss_bf16.jsonl" "$OUT/w_loss_wire.jsonl" \
          --floor "$OUT/w_loss_bf16_compile.jsonl" --plot "$OUT/nvlink_fp8_loss.png" --names "bf16,fp8 wire,bf16 compiled" \
          | tail -2 ;;
    esac ;;

  fp8)  # -> fp8_experts_1x<GPU>.md: FP8 experts tested, 300 steps of v2lite_1b bf16 vs fp8 (loss curves), e2e rows
    python3 -m pytest tests/test_fp8_experts.py -p no:warnings -q -rfEs 2>&1 | tee "$OUT/fp8_tests.log" | tail -5
    TMO=240 recipe loss_bf16 1 --training.steps 300 --training.cuda_graph true
    TMO=240 recipe loss_fp8 1 --training.steps 300 --training.cuda_graph true --moe_echo.expert_precision fp8
    # the control: the same bf16 math with other rounding (compiled dense parts) shows how far two equivalent runs drift
    TMO=300 recipe loss_bf16_compile 1 --training.steps 300 --training.cuda_graph true --compile.enable true
    for r in loss_fp8 loss_bf16_compile; do
      echo "-- bf16 vs $r"; python3 benchmarks/loss_match.py "$OUT/loss_bf16.jsonl" "$OUT/$r.jsonl" | tail -1
    done
    python3 benchmarks/e2e.py --configs v2lite_1b_gpu --runs ours_graph --label bf16_ref --out "$OUT/e2e" | tail -3
    python3 benchmarks/e2e.py --configs v2lite_1b_gpu --runs ours_graph --ours "--moe_echo.expert_precision fp8" \
      --label fp8 --out "$OUT/e2e" | tail -4 ;;

  configs)
    for cfg in ${RECIPES-debug_gpu v2lite_1b_gpu qwen3_30b_a3b_small_gpu}; do
      CUDA_VISIBLE_DEVICES=0 python3 recipes/pretrain.py --job.config_file train_configs/$cfg.toml --training.steps 40 \
        --metrics.log_freq 10 --checkpoint.enable false --job.dump_folder /tmp/run_$cfg > "$OUT/recipe_$cfg.log" 2>&1
      echo "== $cfg rc=$?"; grep -v "step/s\]$" "$OUT/recipe_$cfg.log" | tail -14
      tail -3 /tmp/run_$cfg/metrics.jsonl | cut -c1-400
    done ;;

  dispatch)  # -> dispatch_ep2_2x<GPU>.md, copy_engine_2x<GPU>.md, dispatch_ep<N>_<N>x<GPU>.md
    N=$(ngpus); vdev=--no-vdev; [ -n "${VDEV:-}" ] && vdev=
    CUDA_VISIBLE_DEVICES=0,1 timeout 230 torchrun --nproc_per_node 2 benchmarks/dispatch.py $vdev --out "$OUT" 2>&1 \
      | tee "$OUT/dispatch_ep2.log" | noise | tail -32
    CUDA_VISIBLE_DEVICES=0,1 timeout 120 torchrun --nproc_per_node 2 benchmarks/copy_engine.py --out "$OUT" 2>&1 \
      | tee "$OUT/copy_engine.log" | noise | grep -E "^\| "
    if [ "$N" -ge 4 ]; then
      timeout 130 torchrun --nproc_per_node $N benchmarks/dispatch.py --tokens 16384 $vdev --sweep 32,64,132 --out "$OUT" 2>&1 \
        | tee "$OUT/dispatch_ep$N.log" | noise | tail -14
    fi ;;

  deepep)  # -> dispatch_ep2_deepep_2x<GPU>.md: DeepEP built (once per machine), its dispatcher tested, then timed
    build=${DEEPEP_BUILD:-build/deepep}; [[ $build = /* ]] || build=$PWD/$build  # relative to the repository or absolute
    export PYTHONPATH="$build/lib:$PYTHONPATH"
    if [ -z "${PART:-}" ] || [ "$PART" = build ]; then
      if python3 -c "import deep_ep" 2> /dev/null; then
        echo "deepep: deep_ep imports ($(python3 -c 'import deep_ep; print(deep_ep.__file__)'))"
      else
        OUT="$OUT" timeout ${TMO:-240} bash benchmarks/gpu/build_deepep.sh || exit 1
      fi
    fi
    if [ -z "${PART:-}" ] || [ "$PART" = test ]; then
      timeout 300 python3 -m pytest tests/test_gpu_ep.py -k deepep -p no:warnings -q -rfEs -s -o addopts= 2>&1 \
        | tee "$OUT/deepep_tests.log" | grep -E "deepep|passed|failed|skipped|rror" | tail -8
    fi
    if [ -z "${PART:-}" ] || [ "$PART" = bench ]; then
      # EP=2 on GPUs 0,1; EP=4 with EP=4 on a 4-GPU machine -> dispatch_ep4_deepep_4x<GPU>.md
      N=${EP:-2}; CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((N - 1))) timeout 170 torchrun --nproc_per_node $N benchmarks/dispatch.py \
        --only-sms --sms 24,64 --tokens 4096,16384 --hidden 2048,7168 --label deepep --out "$OUT" 2>&1 \
        | tee "$OUT/dispatch_deepep.log" | noise | tail -26
    fi ;;

  e2e)  # -> e2e_<N>x<GPU>.md (rows merged into one table per GPU kind and count)
    nvidia-smi --query-gpu=name --format=csv,noheader | head -4
    runs=${RUNS:-torchtitan,torchtitan_compile,ours_eager,ours_graph,ours_compile_graph}
    if [ "${PART:-1gpu}" = 1gpu ] && [ -n "${PAR:-}" ]; then  # PAR=1: config i on GPU i at once (each its own table)
      i=0
      for cfg in ${CONFIGS:-debug_gpu v2lite_1b_gpu}; do
        mkdir -p "$OUT/gpu$i"
        CUDA_VISIBLE_DEVICES=$i timeout ${TMO:-560} python3 benchmarks/e2e.py ${REPEATS:+--repeats $REPEATS} --configs $cfg --nproc 1 --runs $runs \
          --steps ${STEPS:-40} --out "$OUT/gpu$i" --work /tmp/e2e/gpu$i ${ARGS:+--ours "$ARGS"} \
          ${LABEL:+--label "$LABEL"} ${VARIANTS:+--variants "$VARIANTS"} > "$OUT/gpu$i/log.txt" 2>&1 &
        i=$((i + 1))
      done
      wait; for f in "$OUT"/gpu*/log.txt; do grep -v '^{' "$f" | tail -12; done
    elif [ "${PART:-1gpu}" = 1gpu ]; then
      for cfg in ${CONFIGS:-debug_gpu v2lite_1b_gpu qwen3_30b_a3b_small_gpu}; do
        CUDA_VISIBLE_DEVICES=0 timeout ${TMO:-560} python3 benchmarks/e2e.py ${REPEATS:+--repeats $REPEATS} --configs $cfg --nproc 1 --runs $runs \
          --steps ${STEPS:-40} --out "$OUT" --work /tmp/e2e ${ARGS:+--ours "$ARGS"} ${LABEL:+--label "$LABEL"} \
          ${VARIANTS:+--variants "$VARIANTS"} 2>&1 | grep -v '^{' | tail -12
      done
    elif [ "$PART" = variants ]; then  # VARIANTS="name=recipe args;..." at EP=${EP:-2} GPUs: one run, one torchtitan baseline
      ep=${EP:-2}
      timeout ${TMO:-560} python3 benchmarks/e2e.py ${REPEATS:+--repeats $REPEATS} --configs ${CONFIGS:-v2lite_1b_gpu} --nproc $ep \
        --runs ${RUNS:-ours_compile_graph,torchtitan_compile} --label ${LABEL:-variants} --steps ${STEPS:-40} --out "$OUT" \
        --work /tmp/e2e --titan "--parallelism.expert_parallel_degree $ep" --variants "${VARIANTS:?VARIANTS=\"name=args;...\"}" \
        --ours "--parallelism.expert_parallel_degree $ep --moe_echo.dispatcher nvlink ${ARGS:-}" 2>&1 | grep -v '^{' | tail -12
    elif [ "$PART" = fill ]; then  # the 2-GPU config sized to fill the GPUs (EP=2 set in the config)
      timeout ${TMO:-560} python3 benchmarks/e2e.py ${REPEATS:+--repeats $REPEATS} --configs v2lite_6b_2gpu --nproc 2 --runs $runs --label ${LABEL:-fill} \
        --steps ${STEPS:-40} --out "$OUT" --work /tmp/e2e --titan "--parallelism.expert_parallel_degree 2" \
        ${ARGS:+--ours "$ARGS"} 2>&1 | grep -v '^{' | tail -12
    else
      timeout ${TMO:-560} python3 benchmarks/e2e.py ${REPEATS:+--repeats $REPEATS} --configs v2lite_1b_gpu --nproc 2 --runs $runs --label ${LABEL:-ep2} \
        --steps ${STEPS:-40} --out "$OUT" --work /tmp/e2e --titan "--parallelism.expert_parallel_degree 2" \
        --ours "--parallelism.expert_parallel_degree 2 --moe_echo.dispatcher nvlink --moe_echo.capacity_factor 1.5 ${ARGS:-}" \
        2>&1 | grep -v '^{' | tail -12
    fi
    tar czf "$OUT/e2e_logs.tgz" --exclude assets -C /tmp/e2e . 2>/dev/null ;;

  echo_tests)  # ECHO's GPU tests on this torch (no benchmark): its route kernels, then the steps
    P="python3 -m pytest -p no:warnings -q -rfEs -o addopts="
    timeout 60 $P tests/test_echo_routes.py 2>&1 | tail -2
    timeout 400 $P tests/test_gpu_train.py tests/test_gpu_ep.py -k "echo or two_gpu_expert_parallel" 2>&1 | tail -6 ;;

  router)  # -> router_1x<GPU>.md: the fused router kernels' GPU tests, then their time against the torch path (~60 s)
    P="python3 -m pytest -p no:warnings -q -rfEs -o addopts="
    timeout 200 $P tests/test_router.py 2>&1 | tail -4
    timeout 200 python3 benchmarks/router.py --out "$OUT" 2>&1 | grep -E "^\| |rror" ;;

  route_layout)  # -> route_layout_1x<GPU>.md, dispatch_ep2_2x<GPU>.md: the slot-layout kernels' GPU tests, then slot_ranks graphed vs torch (and
    # vs build/base.tgz's tree where present), then dispatch at 16384x7168 (the routing phase in the parts table)
    P="python3 -m pytest -p no:warnings -q -rfEs -o addopts="
    timeout 200 $P tests/test_route_layout.py 2>&1 | tail -3
    base=; [ -d /tmp/base/kernels ] && base="--base /tmp/base"
    timeout 200 python3 benchmarks/route_layout.py $base --out "$OUT" 2>&1 | grep -E "^\| |rror"
    CUDA_VISIBLE_DEVICES=0,1 timeout 150 torchrun --nproc_per_node 2 benchmarks/dispatch.py --no-vdev --tokens 4096,16384 \
      --hidden 7168 --sweep 64 --block-t 0 --out "$OUT" > "$OUT/dispatch_ep2.log" 2>&1; grep -A8 "in parts" "$OUT"/dispatch_ep2_*.md ;;

  gathered)  # -> gather_gemm_1x<GPU>.md: the experts reading token rows through QuACK's GEMMs (A_idx, the
    # dSwiGLU epilogue's per-row scale and reduction) vs expanded expert-major copies, then gathered_experts'
    # GPU tests (after quack_unpack; ~250 s)
    timeout 300 python3 benchmarks/gather_gemm.py --shapes 64x1408x2048x16384x6 128x768x2048x16384x8 \
      --out "$OUT" 2>&1 | tail -30
    P="python3 -m pytest -p no:warnings -q -rfEs -o addopts="
    timeout 200 $P tests/test_gathered_experts.py 2>&1 | tail -8
    timeout 200 $P tests/test_gpu_train.py -k gathered 2>&1 | tail -6
    [ -n "${LAYER:-}" ] && timeout 240 python3 benchmarks/moe_layer.py --no-fp8 --routing balanced --out "$OUT" 2>&1 \
      | grep -E "^\| " | tail -8 ;;  # LAYER=1: the layer table with its quack and quack_gathered rows

  gateup)  # -> gate_up_gemm_1x<GPU>.md: the one gate/up GEMM's GPU tests, then two GEMMs vs one at three expert
    # shapes (~300 s). The whole step against the base tree is a second run: PART=variants e2e with
    # VARIANTS="base=@/tmp/base;gateup=" (with build/base.tgz present)
    P="python3 -m pytest -p no:warnings -q -rfE -o addopts="
    timeout 120 $P tests/test_gpu.py tests/test_kernels.py -k "gpu or swiglu" 2>&1 | tail -4
    timeout 150 $P tests/test_gpu_train.py -k "local_1gpu or padded_2gpu or resumes" 2>&1 | tail -4
    timeout 180 python3 benchmarks/gate_up_gemm.py --shapes 64x1408x2048x98304 32x1408x2048x196608 \
      64x768x2048x98304 --out "$OUT" 2>&1 | grep -E "^\| (bf16|fp32)" ;;

  grouped_fp8)  # -> grouped_gemm_fp8_1x<GPU>.md: the experts' grouped GEMMs, bf16 and FP8, torch's beside DeepGEMM's
    # (WGRAD=1: the weight gradients' too, grouped_gemm_fp8_wgrad_1x<GPU>.md; WGRAD_ONLY=1: only those,
    # grouped_wgrad_fp8_1x<GPU>.md)
    # (built once per machine from .deepgemm/src by build_deepgemm.sh; its kernels compile on first use, ~minutes)
    build=${DEEPGEMM_BUILD:-build/deepgemm}; [[ $build = /* ]] || build=$PWD/$build
    export PYTHONPATH="$build/lib:$PYTHONPATH"
    [[ ${DEEPGEMM:-1} = 0 ]] || python3 -c "import deep_gemm" 2> /dev/null \
      || OUT="$OUT" timeout ${TMO:-300} bash benchmarks/gpu/build_deepgemm.sh
    # DeepGEMM's kernels run with the system's libstdc++ loaded first: without it each stops in the std::regex of its
    # JIT's include scanner (SIGSEGV) on this image
    LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6) timeout ${TMO:-420} python3 benchmarks/grouped_gemm_fp8.py \
      --shapes ${SHAPES:-64x768x2048x98304} ${WGRAD:+--wgrad} ${WGRAD_ONLY:+--wgrad-only} --out "$OUT" 2>&1 \
      | tee "$OUT/grouped_gemm_fp8.log" | grep -E "^\| |rror|grouped_gemm_fp8" ;;

  fp8_linear)  # -> fp8_linear_1x<GPU>.md: the attention's projections in FP8, torchao's Float8Linear vs Fp8RowsLinear
    timeout ${TMO:-300} python3 benchmarks/fp8_linear.py ${SHAPES:+--shapes $SHAPES} --out "$OUT" 2>&1 \
      | tee "$OUT/fp8_linear.log" | grep -E "^\| |rror|fp8_linear" ;;

  fp8_ffn)  # -> fp8_ffn_1x<GPU>.md: a dense SwiGLU feed-forward (shared experts, dense FFN shapes) in FP8, torchao's
    # Float8Linear against the FP8 experts' kernels as one expert, bf16 beside (SHAPES=TOKENSxDIMxHIDDEN ...)
    timeout ${TMO:-400} python3 benchmarks/fp8_ffn.py ${SHAPES:+--shapes $SHAPES} --out "$OUT" 2>&1 \
      | tee "$OUT/fp8_ffn.log" | grep -E "^\| |rror|fp8_ffn" ;;

  fp8_requant)  # -> fp8_requant_1x<GPU>.md: the FP8 weight gradients' transposed operands per requantiser tile,
    # against a copy of the same bytes (the ceiling) and plain transposes
    timeout ${TMO:-300} python3 benchmarks/fp8_requant.py ${SHAPES:+--shapes $SHAPES} --out "$OUT" 2>&1 \
      | tee "$OUT/fp8_requant.log" | grep -E "^\| |rror|fp8_requant" ;;

  fill_profile)  # -> step_breakdown_v2lite_6b_2gpu_<LABEL>_graph_<GRAPH>_2x<GPU>.md: the compiled step at EP=2 on the
    # config that fills two GPUs (12 steps, 2 profiled: early routing, still imbalanced), graphed unless GRAPH=false
    # (eager kernels carry the ops that launched them; a graph replay's have none); one profile per variant, side by
    # side: VARIANTS="name=recipe args;..." (default one, "fill"), ARGS added to every variant's
    PROF="--training.steps 12 --metrics.log_freq 2 --profiling.enable_profiling true --profiling.profile_freq 10
          --profiling.profiler_warmup 6 --profiling.profiler_active 2 --training.cuda_graph ${GRAPH:-true}
          --compile.enable true"
    traces=()
    IFS=';' read -ra vs <<< "${VARIANTS:-fill=}"
    for v in "${vs[@]}"; do
      name=${v%%=*}; args=${v#*=}
      CFG=train_configs/v2lite_6b_2gpu.toml TMO=${TMO:-220} FROM=6 recipe "prof_$name" 2 $PROF ${ARGS:-} $args | tail -2
      traces+=("$name=$(ls /tmp/run_prof_$name/profile_traces/iteration_*/rank0_trace.json | tail -1)")
    done
    timeout 120 python3 benchmarks/step_breakdown.py "${traces[@]}" \
      --name "v2lite_6b_2gpu_${LABEL:-ep2}_graph_${GRAPH:-true}" --gpus 2 --out "$OUT" \
      $(for c in ${DETAIL:-}; do printf -- '--detail %s ' "$c"; done) | head -${LINES_OUT:-120} ;;

  copies)  # the expert copies' tests on this torch: kernels, layer (torch and QuACK GEMMs), EP=2 graphed vs cast + resume
    P="python3 -m pytest -p no:warnings -q -rfEs -o addopts="
    timeout 150 $P tests/test_compute_copies.py tests/test_master_adamw.py tests/test_quack_experts.py tests/test_gpu.py 2>&1 | tail -6
    timeout 240 $P tests/test_gpu_train.py -k "copies or masters or resumes" 2>&1 | tail -6 ;;

  profile)  # -> step_breakdown_<config>_<LABEL>_<N>x<GPU>.md: the eager step's GPU time by category
    for cfg in ${CONFIGS:-v2lite_1b_gpu}; do
      CFG=train_configs/$cfg.toml FROM=0 recipe "prof_${cfg}_${LABEL:-now}" ${NPROC:-1} --training.steps 14 --metrics.log_freq 2 \
        --profiling.enable_profiling true --profiling.profile_freq 12 --profiling.profiler_warmup 8 \
        --profiling.profiler_active 4 ${ARGS:-} | tail -2
      trace=$(ls /tmp/run_prof_${cfg}_${LABEL:-now}/profile_traces/iteration_*/rank0_trace.json | tail -1)
      python3 benchmarks/step_breakdown.py "${LABEL:-now}=$trace" --name "${cfg}_${LABEL:-now}" --gpus ${NPROC:-1} --out "$OUT"
    done ;;

  graph_profile)  # -> step_breakdown_v2lite_1b_gpu_graph_compile_ep1_vs_ep2_2x<GPU>.md: the graphed + compiled step's
    # GPU time by category at EP=2 (nvlink, capacity 2.0) against EP=1 on one GPU of the same host, and the
    # one-GPU e2e row (label ep1_ref) beside the EP=2 rows of `e2e`
    PROF="--training.steps 14 --metrics.log_freq 2 --profiling.enable_profiling true --profiling.profile_freq 12
          --profiling.profiler_warmup 8 --profiling.profiler_active 4 --training.cuda_graph true --compile.enable true"
    if [ "${PART:-}" = ep4 ]; then  # 4 GPUs: the EP=4 step alone, ranks 0 and 3 (the one-GPU columns are those of the EP=2
      # table); ARGS="--moe_echo.echo true" LABEL=echo: with those recipe arguments, into ..._ep4_<LABEL>_4x<GPU>.md
      TMO=120 FROM=6 recipe prof_ep4 4 $PROF --parallelism.expert_parallel_degree 4 --moe_echo.capacity_factor 2 ${ARGS:-} | tail -2
      python3 benchmarks/step_breakdown.py "ep4=$(ls /tmp/run_prof_ep4/profile_traces/iteration_*/rank0_trace.json | tail -1)" \
        "ep4_r3=$(ls /tmp/run_prof_ep4/profile_traces/iteration_*/rank3_trace.json | tail -1)" \
        --name v2lite_1b_gpu_graph_compile_ep4${LABEL:+_$LABEL} --gpus 4 --out "$OUT" | head -48
      exit; fi
    if [ "${PART:-}" = echo ]; then  # EP=${EP:-2} GPUs: ECHO off and on, ranks 0 and EP-1 of each ->
      # step_breakdown_v2lite_1b_gpu_graph_compile_ep<EP>_echo_vs_off_<EP>x<GPU>.md: what ECHO adds and what it levels
      EP=${EP:-2}; last=$((EP - 1)); cols=()
      for v in "off:--moe_echo.echo false" "echo:--moe_echo.echo true"; do
        TMO=150 FROM=6 recipe "prof_${v%%:*}" $EP $PROF --parallelism.expert_parallel_degree $EP --moe_echo.capacity_factor 2 \
          ${v#*:} | tail -2
        for r in 0 $last; do
          cols+=("${v%%:*}_r$r=$(ls /tmp/run_prof_${v%%:*}/profile_traces/iteration_*/rank${r}_trace.json | tail -1)"); done
      done
      python3 benchmarks/step_breakdown.py "${cols[@]}" --name v2lite_1b_gpu_graph_compile_ep${EP}_echo_vs_off --gpus $EP \
        --out "$OUT" | head -48
      exit; fi
    TMO=170 FROM=6 recipe prof_ep2 2 $PROF --parallelism.expert_parallel_degree 2 --moe_echo.dispatcher nvlink \
      --moe_echo.capacity_factor 2 | tail -2
    CUDA_VISIBLE_DEVICES=0 TMO=150 FROM=6 recipe prof_ep1 1 $PROF | tail -2
    python3 benchmarks/step_breakdown.py "ep1=$(ls /tmp/run_prof_ep1/profile_traces/iteration_*/rank0_trace.json | tail -1)" \
      "ep2=$(ls /tmp/run_prof_ep2/profile_traces/iteration_*/rank0_trace.json | tail -1)" \
      --name "v2lite_1b_gpu_graph_compile_ep1_vs_ep2" --gpus 2 --out "$OUT" | head -60
    CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/e2e.py --configs v2lite_1b_gpu --nproc 1 --runs ours_compile_graph \
      --label ep1_ref --steps 40 --out "$OUT" --work /tmp/e2e 2>&1 | grep -E "^\| v2lite" ;;

  overlap_profile)  # -> step_breakdown_v2lite_1b_gpu_overlap_ep2_2x<GPU>.md: the compiled + graphed EP=2 step's communication,
    # how much of it no other kernel hides: nvlink, padded, padded in 2 pipelined chunks (overlap_chunks).
    # EP=4 (4 GPUs) and ARGS (recipe arguments for every run, e.g. "--moe_echo.echo true") with LABEL name another
    # file: EP=4 PART=nvlink LABEL=echo ARGS=... -> step_breakdown_v2lite_1b_gpu_overlap_nvlink_ep4_echo_4x<GPU>.md
    EP=${EP:-2}
    PROF="--training.steps 14 --metrics.log_freq 2 --profiling.enable_profiling true --profiling.profile_freq 12
          --profiling.profiler_warmup 8 --profiling.profiler_active 4 --training.cuda_graph true --compile.enable true
          --parallelism.expert_parallel_degree $EP --moe_echo.capacity_factor 2 ${ARGS:-}"
    # PART=nvlink: nvlink unsplit and in 2 chunks only -> step_breakdown_v2lite_1b_gpu_overlap_nvlink_ep2_2x<GPU>.md
    # RUNS= picks the runs (nvlink nvlink_c2 nvlink_c4 padded padded_c2 ce ce_c2), in the named file
    # PART=ce: nvlink's copies by the copy engines (no SM taken from the experts' GEMMs), unsplit and in 2 chunks,
    # beside the kernel copies -> step_breakdown_v2lite_1b_gpu_overlap_ce_ep2_2x<GPU>.md
    runs="nvlink nvlink_c2 padded padded_c2"; name=v2lite_1b_gpu_overlap_ep$EP
    [ "${PART:-}" = nvlink ] && { runs="nvlink nvlink_c2"; name=v2lite_1b_gpu_overlap_nvlink_ep$EP; }
    [ "${PART:-}" = ce ] && { runs="nvlink ce ce_c2"; name=v2lite_1b_gpu_overlap_ce_ep$EP; }
    runs=${RUNS:-$runs}  # e.g. RUNS="nvlink nvlink_c2 nvlink_c4"
    name=$name${LABEL:+_$LABEL}
    for v in "nvlink:nvlink 1" "nvlink_c2:nvlink 2" "nvlink_c4:nvlink 4" "padded:padded 1" "padded_c2:padded 2" "ce:nvlink 1 copy_engine" \
             "ce_c2:nvlink 2 copy_engine"; do
      [[ " $runs " == *" ${v%%:*} "* ]] || continue
      r=${v%%:*}; set -- ${v#*:}
      TMO=170 FROM=6 recipe "ov_$r" $EP $PROF --moe_echo.dispatcher $1 --moe_echo.overlap_chunks $2 \
        ${3:+--moe_echo.nvlink_copy $3} | tail -2
    done
    python3 benchmarks/step_breakdown.py $(for n in $runs; do
      echo "$n=$(ls /tmp/run_ov_$n/profile_traces/iteration_*/rank0_trace.json | tail -1)"; done) \
      --name "$name" --gpus $EP --out "$OUT" | head -20 ;;

  sync)
    python3 recipes/pretrain.py --job.config_file train_configs/debug_gpu.toml --training.steps 4 --training.sync_debug true \
      --metrics.log_freq 1 --job.dump_folder /tmp/sync_eager ${ARGS:-} > "$OUT/sync_eager.log" 2>&1
    echo "== eager under sync_debug rc=$?"; grep -v "[Ww]arn" "$OUT/sync_eager.log" | grep -A14 "Traceback" | tail -30
    python3 recipes/pretrain.py --job.config_file train_configs/debug_gpu.toml --training.steps 6 --training.cuda_graph true \
      --metrics.log_freq 1 --job.dump_folder /tmp/sync_graph ${ARGS:-} > "$OUT/sync_graph.log" 2>&1
    echo "== graphed rc=$?"; grep -i "cuda graph\|capture\|error" "$OUT/sync_graph.log" | head -8 ;;

  dp_vs_ep)  # -> docs/performance.md (plain data parallel vs EP=2)
    export FROM=30
    recipe dp2 2 --training.steps 30 --parallelism.expert_parallel_degree 1
    recipe ep2_padded 2 --training.steps 30 --parallelism.expert_parallel_degree 2 --moe_echo.dispatcher padded --moe_echo.capacity_factor 2.0
    recipe ep2_alltoall 2 --training.steps 30 --parallelism.expert_parallel_degree 2 --moe_echo.dispatcher alltoall ;;

  planner)  # -> planner_time_1x<GPU>.md, echo_sim_1x<GPU>.md
    python3 -m pytest tests/test_kernels.py -p no:warnings -k planner 2>&1 | tail -2
    python3 benchmarks/planner.py --skip-quality --time --out "$OUT" 2>&1 | tail -8
    python3 benchmarks/echo_sim.py --out "$OUT" 2>&1 | tail -11 ;;

  echo)  # -> echo_e2e_2xH200.md (first table), echo_recompute_2x<GPU>.md
    python3 -m pytest tests/test_gpu_ep.py -p no:warnings -k two_gpu 2>&1 | tail -2
    export FROM=20
    hot() { recipe "$1" 2 --training.steps 40 --parallelism.expert_parallel_degree 2 --moe_echo.dispatcher padded \
      --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8 "${@:2}"; }
    hot off_cf2 --moe_echo.capacity_factor 2.0
    hot on_cf2 --moe_echo.capacity_factor 2.0 --moe_echo.echo true --moe_echo.echo_slots_per_rank 4
    hot on_cf1.25 --moe_echo.capacity_factor 1.25 --moe_echo.echo true --moe_echo.echo_slots_per_rank 4
    hot off_cf1.25 --moe_echo.capacity_factor 1.25 --moe_echo.on_overflow stop; grep -m1 "^error" "$OUT/off_cf1.25.log"
    timeout 150 torchrun --nproc_per_node 2 benchmarks/echo_recompute.py --out "$OUT" 2>&1 | noise | tail -6 ;;

  echo_e2e)  # -> echo_e2e_2xH200.md (second table)
    python3 -m pytest tests/test_gpu_ep.py -p no:warnings -s 2>&1 | grep -E "echo=|passed|failed|Error" | head
    export FROM=20
    hot() { recipe "$1" 2 --training.steps 40 --parallelism.expert_parallel_degree 2 \
      --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8 "${@:2}"; }
    hot off_padded_cf2 --moe_echo.dispatcher padded --moe_echo.capacity_factor 2.0
    hot on_padded_cf1.25 --moe_echo.dispatcher padded --moe_echo.capacity_factor 1.25 --moe_echo.echo true --moe_echo.echo_slots_per_rank 4
    hot off_replay_cf1 --moe_echo.dispatcher padded --moe_echo.capacity_factor 1.0 --moe_echo.grow_capacity_after 1
    hot off_alltoall --moe_echo.dispatcher alltoall
    hot on_fastest --moe_echo.dispatcher fastest --moe_echo.capacity_factor 1.25 --moe_echo.echo true --moe_echo.echo_slots_per_rank 4 ;;

  ep4)  # -> ep4_nvlink_training_4xH200.md
    N=$(ngpus); echo "GPUs: $N"; export TMO=${TMO:-110}
    timeout 150 torchrun --nproc_per_node $N benchmarks/dispatch.py --tokens 16384 --hidden 2048,7168 --sweep 32 --no-vdev \
      --out "$OUT" 2>&1 | noise | tail -9
    train natural_off $N --moe_echo.echo false
    train natural_on $N --moe_echo.echo true
    train skewed_off $N --moe_echo.echo false --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8
    train skewed_on $N --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8 --moe_echo.echo true --moe_echo.echo_slots_per_rank 4 ;;

  ep4_padded)  # -> ep4_training_4xH200.md
    export FROM=30 TMO=${TMO:-100}
    pad() { recipe "$1" 4 --training.steps 60 --parallelism.expert_parallel_degree 4 --moe_echo.dispatcher padded \
      --moe_echo.capacity_factor 1.5 "${@:2}"; }
    pad natural_off
    pad natural_on --moe_echo.echo true
    pad skewed_off --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8
    pad skewed_on --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8 --moe_echo.echo true --moe_echo.echo_slots_per_rank 4 ;;

  ep4_6b)  # -> ep4_v2lite_6b_4xH200.md
    case ${PART:-a} in
      a) train v6_natural_off 4 --model.flavor v2lite_6b --moe_echo.echo false
         train v6_natural_on 4 --model.flavor v2lite_6b --moe_echo.echo true ;;
      b) train v6_skewed_off 4 --model.flavor v2lite_6b --moe_echo.echo false --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8
         train v6_skewed_on 4 --model.flavor v2lite_6b --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8 \
           --moe_echo.echo true --moe_echo.echo_slots_per_rank 4 ;;
      c) # the graphed row: 30 steps, every step logged; the published run had MOE_ECHO_CHECK=1 (CHECK=0 turns it off)
         MOE_ECHO_CHECK=${CHECK:-1} FROM=4 TMO=${TMO:-300} train v6_natural_on_graph 4 --model.flavor v2lite_6b \
           --moe_echo.echo true --training.cuda_graph true --training.steps 30 --metrics.log_freq 1 ;;
    esac ;;

  scaling)  # PART=a -> scaling_4xH200.md (padded was then the EP>1 default; it is named here)
    case ${PART:-a} in
      a)
        export FROM=60 TMO=${TMO:-80}
        recipe g1 1 --training.steps 100 --metrics.log_freq 20
        recipe g2_ep2_echo 2 --training.steps 100 --metrics.log_freq 20 --parallelism.expert_parallel_degree 2 \
          --moe_echo.dispatcher padded --moe_echo.echo true --moe_echo.capacity_factor 1.5
        recipe g4_ep4_echo 4 --training.steps 100 --metrics.log_freq 20 --parallelism.expert_parallel_degree 4 \
          --moe_echo.dispatcher padded --moe_echo.echo true --moe_echo.capacity_factor 1.5 ;;
      b)  # v2lite_1b compiled + graphed at 1, 2 (and 4) GPUs in one invocation, EP = GPUs: per-GPU scaling of the
          # default and of options that cut communication or waiting (dense weights kept gathered from forward to
          # backward; ECHO levelling the ranks' expert load) -> e2e_<N>x<GPU>.md label scaling_opts
        # (P=1,4 LABEL=scaling_ep4 VARIANTS="default=;noreshard=..." made the published EP=4 rows; ECHO on: P=4;
        # ECHO's rows, which have no 1-GPU run, are set against the first variant's 1-GPU row)
        P=${P:-$([ "$(ngpus)" -ge 4 ] && echo 1,2,4 || echo 1,2)}
        python3 benchmarks/e2e.py --configs v2lite_1b_gpu --nproc $P --runs ours_compile_graph --steps ${STEPS:-60} \
          --label ${LABEL:-scaling_opts} --ours "--parallelism.expert_parallel_degree {nproc}" --out "$OUT" --timeout 170 \
          --variants "${VARIANTS:-default=;noreshard=--parallelism.fsdp_reshard_after_forward never;echo=--moe_echo.echo true;bf16_reduce=--training.mixed_precision_reduce bfloat16}" \
          2>&1 | noise | grep -E "^\| v2lite" ;;
    esac ;;

  ep8)  # not run yet (needs an 8-GPU host)
    N=$(ngpus); echo "GPUs: $N"
    case ${PART:-a} in
      a) CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 -m pytest -x tests/test_gpu_ep.py -p no:warnings -q -s 2>&1 | tail -9
         CUDA_VISIBLE_DEVICES=0,1 timeout 170 torchrun --nproc_per_node 2 benchmarks/dispatch.py --no-vdev --sweep 64 \
           --block-t 1 --out "$OUT" 2>&1 | noise | tail -14
         timeout 170 torchrun --nproc_per_node $N benchmarks/dispatch.py --tokens 16384 --no-vdev --sweep 64 --block-t 1 \
           --out "$OUT" 2>&1 | noise | tail -10 ;;
      b) train e8_natural_off $N --moe_echo.echo false
         train e8_natural_on $N --moe_echo.echo true
         TMO=300 train e8_skewed_off $N --moe_echo.echo false --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8
         train e8_skewed_on $N --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8 --moe_echo.echo true \
           --moe_echo.echo_slots_per_rank 4 ;;
      c) # the 8-GPU row of the scaling table (padded, ECHO on), then v2lite_6b at EP=8, ECHO on, graphed, 30 steps
         train g8_ep8_echo $N --moe_echo.echo true --moe_echo.dispatcher padded --metrics.log_freq 20
         FROM=4 TMO=240 train e8_v6_graph $N --model.flavor v2lite_6b --moe_echo.echo true --training.cuda_graph true \
           --training.steps 30 --metrics.log_freq 1 ;;
    esac ;;

  guard)  # -> docs/performance.md: cost of the non-finite guard (on by default) on 1 GPU, eager and graphed,
          # guard on (max_nonfinite_steps 3) and off (0) interleaved, each run in a fresh folder
    for cfg in ${CONFIGS:-v2lite_1b_gpu}; do for graph in false true; do for g in 3 0 3 0; do
      CFG=train_configs/$cfg.toml FROM=${FROM:-30} recipe "guard_${cfg}_graph${graph}_n${g}_$RANDOM" 1 \
        --training.steps ${STEPS:-60} --training.max_nonfinite_steps $g --training.cuda_graph $graph | grep -E "^tok/s|rc=[^0]"
    done; done; done ;;

  before_after)  # -> dispatch_ep2_before_after_2x<GPU>.md, e2e_2x<GPU>.md (labels ep2_cf2, ep2_cf2_perslot),
    # step_breakdown_v2lite_1b_gpu_ep2_nvlink_2x<GPU>.md (columns per_choice = PREV, per_token = this tree)
    PREV=${PREV:-build/prev}; NEW=$PWD; ABS_PREV=$(cd "$PREV" && pwd)
    CF=${CF:-2}  # the ep2_cf1.5* rows: CF=1.5 PART=e2e
    OURS="--parallelism.expert_parallel_degree 2 --moe_echo.dispatcher nvlink --moe_echo.capacity_factor $CF"
    if [ -z "${PART:-}" ] || [ "$PART" = dispatch ]; then
      for tree in "$ABS_PREV" "$NEW"; do
        CUDA_VISIBLE_DEVICES=0,1 PYTHONPATH=/tmp/site:$tree timeout 90 torchrun --nproc_per_node 2 $tree/benchmarks/dispatch.py \
          --no-vdev --tokens 16384 --hidden 2048 --sweep 64 --block-t 1 --out "$OUT/$(basename $tree)" 2>&1 | grep -E '^\| 16384'
      done
    fi
    if [ -z "${PART:-}" ] || [ "$PART" = e2e ]; then
      timeout 120 python3 benchmarks/e2e.py --configs v2lite_1b_gpu --nproc 2 --runs ours_graph --label ep2_cf$CF \
        --steps 40 --out "$OUT" --work /tmp/e2e --ours "$OURS" 2>&1 | grep -v '^{' | tail -2
      (cd "$ABS_PREV" && PYTHONPATH=/tmp/site:$ABS_PREV timeout 120 python3 benchmarks/e2e.py --configs v2lite_1b_gpu --nproc 2 \
        --runs ours_graph --label ep2_cf${CF}_perslot --steps 40 --out "$OUT/prev" --work /tmp/e2e --ours "$OURS" 2>&1 | grep -v '^{' | tail -2)
      timeout 200 python3 benchmarks/e2e.py --configs v2lite_1b_gpu --nproc 2 --runs torchtitan_compile --label ep2_cf$CF \
        --steps 40 --out "$OUT" --work /tmp/e2e --titan "--parallelism.expert_parallel_degree 2" 2>&1 | grep -v '^{' | tail -3
    fi
    if [ -z "${PART:-}" ] || [ "$PART" = profile ]; then
      PROF="--training.steps 14 --metrics.log_freq 2 --profiling.enable_profiling true --profiling.profile_freq 12
            --profiling.profiler_warmup 8 --profiling.profiler_active 4 $OURS"
      TMO=100 FROM=0 recipe prof_new 2 $PROF | tail -1
      (cd "$ABS_PREV" && export PYTHONPATH=/tmp/site:$ABS_PREV && TMO=100 FROM=0 recipe prof_prev 2 $PROF | tail -1)
      python3 benchmarks/step_breakdown.py "per_choice=$(ls /tmp/run_prof_prev/profile_traces/iteration_*/rank0_trace.json | tail -1)" \
        "per_token=$(ls /tmp/run_prof_new/profile_traces/iteration_*/rank0_trace.json | tail -1)" \
        --name "v2lite_1b_gpu_ep2_nvlink" --gpus 2 --out "$OUT" | head -20
    fi ;;

  titan)  # 2 GPUs: torchtitan's own trainer with our TrainSpec (EP=2, ECHO, alltoall) vs recipes/pretrain.py
    common=(--job.config_file train_configs/debug_gpu.toml --training.steps ${STEPS:-20} --metrics.log_freq 1
            --lr_scheduler.warmup_steps 10 --parallelism.expert_parallel_degree 2 --moe_echo.dispatcher alltoall
            --debug.seed 0)
    rm -rf /tmp/run_titan /tmp/run_titan_ours
    timeout ${TMO:-300} torchrun --nproc_per_node 2 -m torchtitan.train "${common[@]}" --job.dump_folder /tmp/run_titan \
      --job.custom_config_module components.train.job_config \
      --experimental.custom_import components.train.torchtitan_spec \
      --model.name moe_echo_deepseek_v3 --moe_echo.echo True --metrics.disable_color_printing > "$OUT/titan.log" 2>&1
    echo "== torchtitan rc=$? $(grep -m1 '^moe_echo parallelize_fn' "$OUT/titan.log")"
    timeout ${TMO:-300} torchrun --nproc_per_node 2 recipes/pretrain.py "${common[@]}" --job.dump_folder /tmp/run_titan_ours \
      --moe_echo.echo true > "$OUT/titan_ours.log" 2>&1
    echo "== ours rc=$? $(grep -E '^dispatcher ' "$OUT/titan_ours.log")"
    cp /tmp/run_titan_ours/metrics.jsonl "$OUT/titan_ours.jsonl" 2>/dev/null
    python3 - "$OUT/titan.log" /tmp/run_titan_ours/metrics.jsonl <<'EOF'
import json, re, sys
titan = {int(m[1]): float(m[2]) for m in re.finditer(r"step:\s+(\d+)\s+loss:\s+([-\d.naif]+)", open(sys.argv[1]).read())}
ours = {r["step"]: r["loss"] for r in map(json.loads, open(sys.argv[2]))}
steps = sorted(set(titan) & set(ours))
print("torchtitan", [round(titan[s], 5) for s in steps])
print("ours      ", [round(ours[s], 5) for s in steps])
print("max |diff|", max((abs(titan[s] - ours[s]) for s in steps), default=None), "over", len(steps), "steps")
EOF
    ;;

  hosts)
    n=$(ngpus); L=$((n / 2)); net=""
    if [ -n "${NET_THREADS:-}" ]; then  # a faster emulated network: NCCL's socket transport with more threads and
      # sockets between the hosts (product at most 64); labels end in _net<T>x<S>
      export NCCL_SOCKET_NTHREADS=$NET_THREADS NCCL_NSOCKS_PERTHREAD=${NET_SOCKS:-4}
      net=_net${NET_THREADS}x${NCCL_NSOCKS_PERTHREAD}
    fi
    if [ "${PART:-a}" = a ]; then
      timeout ${TMO:-420} python3 -m pytest tests/test_hierarchical.py tests/test_gpu_ep.py -p no:warnings -q -rfEs \
        --durations=10 2>&1 | tee "$OUT/hosts_tests.log" | tail -25
      timeout 240 python3 benchmarks/dispatch_hosts.py --hosts 2 --gpus-per-host $L --label emulated$net --out "$OUT" \
        2>&1 | noise | tail -30
    elif [ "$PART" = c ]; then  # the layer whole and in 2 pipelined chunks across the emulated hosts (label overlap_hosts22 at 2 x 2)
      timeout 560 python3 benchmarks/e2e.py --configs v2lite_1b_gpu --nproc $n --hosts 2 --runs ours_graph --steps 40 \
        --label overlap_hosts$((n / 2))$((n / 2))$net --out "$OUT" --timeout 200 --ours "--parallelism.expert_parallel_degree $n \
        --moe_echo.dispatcher hierarchical --moe_echo.capacity_factor 2.0 --moe_echo.grow_capacity_after 1" \
        --variants "c1=--moe_echo.overlap_chunks 1;c2=--moe_echo.overlap_chunks 2" 2>&1 | noise | tail -6
    else
      a="--parallelism.expert_parallel_degree $n --moe_echo.capacity_factor 1.25 --moe_echo.grow_capacity_after 1"
      hot="--moe_echo.debug_hot_experts 8 --moe_echo.bias_update_rate 0"
      timeout 560 python3 benchmarks/e2e.py --configs v2lite_1b_gpu --nproc $n --hosts 2 --runs ours_graph \
        --steps ${STEPS:-30} --label hosts2$net --out "$OUT" --timeout 200 --ours "$a" --variants \
        "${VARIANTS:-padded=--moe_echo.dispatcher padded --moe_echo.capacity_factor 2.0;hier=--moe_echo.dispatcher hierarchical;hier_hot=--moe_echo.dispatcher hierarchical $hot;hier_hot_echo=--moe_echo.dispatcher hierarchical --moe_echo.echo true $hot}" \
        2>&1 | noise | tail -30
    fi ;;

  *) echo "unknown suite $suite (see the header of benchmarks/gpu/run.sh)" >&2; exit 2 ;;
esac
