#!/usr/bin/env bash
# Builds DeepEP's intranode (NVLink) kernels from source for the `deepep` dispatcher, offline: no pip, no download,
# no NVSHMEM. From the repository root, on a machine with nvcc and the GPU's torch:
#
#   bash benchmarks/gpu/build_deepep.sh
#
#   DEEPEP_SRC    DeepEP's source tree (default .deepep/src: the v1 line, whose setup.py builds without NVSHMEM;
#                 .deepep/COMMIT names the commit). To get it: git clone https://github.com/deepseek-ai/DeepEP .deepep/src
#                 && git -C .deepep/src checkout 567632dd59810d77b3cc05553df953cc0f779799 (later commits need NVSHMEM)
#   DEEPEP_BUILD  build folder (default build/deepep): lib/ gets the package (deep_ep/ and deep_ep_cpp*.so), tmp/
#                 the objects (ninja rebuilds only what changed)
#   TORCH_CUDA_ARCH_LIST  default 9.0 (sm_90: H100, H200);  MAX_JOBS  default every core;  OUT  log folder (/tmp)
#
# DeepEP's own setup.py runs unchanged, with two things set from outside its tree: NVSHMEM reads as absent (the
# image's nvidia-nvshmem wheel would otherwise add the internode and low-latency kernels), so it compiles layout.cu
# and intranode.cu with -DDISABLE_NVSHMEM; and its -rdc=true objects get a device-link step (setup.py adds one only
# with NVSHMEM; without it the module does not load: undefined __cudaRegisterLinkedBinary_*); the three low-latency
# mask-buffer functions its deep_ep.cpp calls unguarded are defined to raise. Then `import deep_ep`
# works with PYTHONPATH=<lib> (DEEPEP_PTH=1: also without, through a .pth file in this Python's site-packages).
# Prints one line: the build time and `import deep_ep` OK, or the cause of the failure (exit 1).
set -euo pipefail
PY=${PYTHON:-python3}
SRC=${DEEPEP_SRC:-.deepep/src}
BUILD=${DEEPEP_BUILD:-build/deepep}
LOG=${OUT:-/tmp}/deepep_build.log
mkdir -p "$(dirname "$LOG")" "$BUILD/lib" "$BUILD/tmp"
[ -f "$SRC/setup.py" ] || { echo "deepep build: no DeepEP source at $SRC (setup.py missing)"; exit 1; }
SRC=$(cd "$SRC" && pwd); LIB=$(cd "$BUILD/lib" && pwd); TMP=$(cd "$BUILD/tmp" && pwd)
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)}
unset NVSHMEM_DIR
start=$(date +%s)

# torch's CUDA headers include cuSPARSE's, cuBLAS's and cuSOLVER's: where the toolkit lacks them, the pip wheels' folders
inc=$("$PY" -c "import glob, os, nvidia
print(':'.join(d for p in nvidia.__path__ for d in sorted(glob.glob(os.path.join(p, '*', 'include')))))" 2>/dev/null) || inc=""
[ -n "$inc" ] && export CPATH="${CPATH:+$CPATH:}$inc"
# -lcuda: the driver's libcuda.so, else a link to its libcuda.so.1, else the toolkit's stub
ldcache=$( (ldconfig -p || /sbin/ldconfig -p) 2>/dev/null || true)
if ! grep -q "libcuda\.so " <<< "$ldcache"; then
  so1=$(awk '/libcuda\.so\.1 /{print $NF; exit}' <<< "$ldcache")
  cuda_home=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")}
  stub=$(ls "$cuda_home"/lib64/stubs/libcuda.so "$cuda_home"/targets/*/lib/stubs/libcuda.so 2>/dev/null | head -1 || true)
  if [ -n "$so1" ]; then
    mkdir -p "$BUILD/libcuda" && ln -sf "$so1" "$BUILD/libcuda/libcuda.so" && stub=$(cd "$BUILD/libcuda" && pwd)/libcuda.so
  fi
  [ -n "$stub" ] && export LIBRARY_PATH="$(dirname "$stub")${LIBRARY_PATH:+:$LIBRARY_PATH}"
fi
echo "CPATH=${CPATH:-} LIBRARY_PATH=${LIBRARY_PATH:-} TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS" > "$LOG"

if ! (cd "$SRC" && "$PY" - "$LIB" "$TMP" >> "$LOG" 2>&1 <<'EOF'
import importlib.util
import os
import runpy
import sys

import torch.utils.cpp_extension as cpp

lib, tmp = sys.argv[1:3]
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: None if name.startswith("nvidia.nvshmem") else find_spec(name, *a, **k)
make_extension = cpp.CUDAExtension


def device_linked_extension(name, sources, *args, **kwargs):
    flags = kwargs.setdefault("extra_compile_args", {})
    if "-rdc=true" in flags.get("nvcc", []) and "nvcc_dlink" not in flags:
        flags["nvcc_dlink"] = ["-dlink"]
    if "-DDISABLE_NVSHMEM" in flags.get("nvcc", []) + flags.get("cxx", []):
        sources = [*sources, absent_nvshmem_source()]
    cccl = os.path.join(cpp.CUDA_HOME or "/usr/local/cuda", "include", "cccl")  # CUDA 13 keeps CCCL's headers here
    if os.path.isdir(cccl):
        kwargs["include_dirs"] = [*kwargs.get("include_dirs", []), cccl]
    return make_extension(name, sources, *args, **kwargs)


def absent_nvshmem_source():
    """The low-latency mask-buffer entry points deep_ep.cpp calls outside its DISABLE_NVSHMEM guards, defined to
    raise (they need NVSHMEM's shrink mode): without them the module does not load (undefined symbols)."""
    path = os.path.join(tmp, "absent_nvshmem.cpp")
    fail = '{ throw std::runtime_error("DeepEP was built without NVSHMEM: no low-latency mask buffer"); }'
    with open(path, "w") as f:
        f.write("#include <cuda_runtime.h>\n#include <stdexcept>\nnamespace deep_ep { namespace internode_ll {\n"
                f"void update_mask_buffer(int*, int, bool, cudaStream_t) {fail}\n"
                f"void query_mask_buffer(int*, int, int*, cudaStream_t) {fail}\n"
                f"void clean_mask_buffer(int*, int, cudaStream_t) {fail}\n}} }}\n")
    return path


cpp.CUDAExtension = device_linked_extension
sys.argv = ["setup.py", "build_py", "--build-lib", lib, "build_ext", "--build-lib", lib, "--build-temp", tmp]
runpy.run_path("setup.py", run_name="__main__")
EOF
); then
  cause=$(grep -E "error|Error|undefined|FAILED|Assertion|No such file|cannot find" "$LOG" | grep -v "^ninja: build stopped" | tail -3 \
          | tr -s ' \n' ' ' | cut -c1-500)
  echo "deepep build failed after $(( $(date +%s) - start )) s: ${cause:-$(tail -3 "$LOG" | tr -s ' \n' ' ')} (log: $LOG)"
  exit 1
fi
secs=$(( $(date +%s) - start ))
grep -q "DISABLE_NVSHMEM" "$LOG" || { echo "deepep build: NVSHMEM was not disabled (see $LOG)"; exit 1; }

# `import deep_ep` with PYTHONPATH=<lib>, or (DEEPEP_PTH=1) without: a .pth in the first writable site-packages (else
# the user's). Not by default: every later program of that Python would see deep_ep (the `fastest` dispatcher's
# candidates include deepep wherever it imports).
pth=""
if [ "${DEEPEP_PTH:-0}" = 1 ]; then
  pth=$("$PY" - "$LIB" <<'EOF'
import os
import site
import sys

dirs = [d for d in site.getsitepackages() if os.path.isdir(d) and os.access(d, os.W_OK)]
if not dirs and site.ENABLE_USER_SITE:
    os.makedirs(site.getusersitepackages(), exist_ok=True)
    dirs = [site.getusersitepackages()]
if dirs:
    path = os.path.join(dirs[0], "deep_ep_local.pth")
    with open(path, "w") as f:
        f.write(sys.argv[1] + "\n")
    print(path)
EOF
  ) || pth=""
fi
path=${PYTHONPATH:-}; how="via $pth"
[ -n "$pth" ] || { path="$LIB${PYTHONPATH:+:$PYTHONPATH}"; how="with PYTHONPATH=$LIB"; }
check='import deep_ep; assert deep_ep.Buffer.is_sm90_compiled() or "'"$TORCH_CUDA_ARCH_LIST"'" != "9.0"; print(deep_ep.__file__)'
if where=$(cd / && PYTHONPATH="$path" "$PY" -c "$check" 2>>"$LOG"); then
  echo "deepep build: ${secs} s (sm ${TORCH_CUDA_ARCH_LIST}, ${MAX_JOBS} jobs, no NVSHMEM); import deep_ep OK ($where;" \
    "$how)"
else
  echo "deepep build: ${secs} s, but import deep_ep fails: $(grep -E "Error|undefined" "$LOG" | tail -1 | cut -c1-400) (log: $LOG)"
  exit 1
fi
