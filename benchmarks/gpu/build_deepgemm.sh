#!/usr/bin/env bash
# Builds DeepGEMM (FP8 grouped GEMMs with 1x128 / 128x128 block scaling) from source for benchmarks/grouped_gemm_fp8.py,
# offline. From the repository root, on a machine with nvcc and the GPU's torch:
#
#   bash benchmarks/gpu/build_deepgemm.sh
#
#   DEEPGEMM_SRC    DeepGEMM's source tree with its two submodules' headers (default .deepgemm/src; .deepgemm/COMMIT
#                   names the commit). To get it: git clone --recursive https://github.com/deepseek-ai/DeepGEMM .deepgemm/src
#                   (third-party/cutlass/include and third-party/fmt/include are all the build reads of the submodules)
#   DEEPGEMM_BUILD  build folder (default build/deepgemm): lib/ gets the package (deep_gemm/ with _C*.so and the headers
#                   its kernels compile against at run time), tmp/ the objects;  OUT  log folder (/tmp)
#
# DeepGEMM's setup.py runs unchanged (build_py + build_ext: one C++ file; its kernels are compiled by nvcc when first
# called, cached in ~/.deep_gemm). Where the `wheel` package is absent, setuptools' own bdist_wheel stands in for the
# import setup.py makes. Then `import deep_gemm` works with PYTHONPATH=<lib>.
# Its JIT kernels want the system's libstdc++ loaded first (LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6)): on
# an image with torch 2.11 and g++ 13 they otherwise stop in std::regex with SIGSEGV (run.sh grouped_fp8 sets it).
# Prints one line: the build time and `import deep_gemm` OK, or the cause of the failure (exit 1).
set -euo pipefail
PY=${PYTHON:-python3}
SRC=${DEEPGEMM_SRC:-.deepgemm/src}
BUILD=${DEEPGEMM_BUILD:-build/deepgemm}
LOG=${OUT:-/tmp}/deepgemm_build.log
mkdir -p "$(dirname "$LOG")" "$BUILD/lib" "$BUILD/tmp"
[ -f "$SRC/setup.py" ] || { echo "deepgemm build: no DeepGEMM source at $SRC (setup.py missing)"; exit 1; }
[ -d "$SRC/third-party/cutlass/include/cute" ] || { echo "deepgemm build: no CUTLASS headers at $SRC/third-party/cutlass/include"; exit 1; }
SRC=$(cd "$SRC" && pwd); LIB=$(cd "$BUILD/lib" && pwd); TMP=$(cd "$BUILD/tmp" && pwd)
start=$(date +%s)

if ! (cd "$SRC" && "$PY" - "$LIB" "$TMP" > "$LOG" 2>&1 <<'EOF'
import runpy
import sys
import types

lib, tmp = sys.argv[1:3]
try:
    import wheel.bdist_wheel  # noqa: F401
except ImportError:
    from setuptools.command import bdist_wheel
    sys.modules["wheel"] = types.ModuleType("wheel")
    sys.modules["wheel.bdist_wheel"] = bdist_wheel
sys.path.insert(0, ".")  # setup.py imports scripts.generate_pyi from its own tree
sys.argv = ["setup.py", "build_py", "--build-lib", lib, "build_ext", "--build-lib", lib, "--build-temp", tmp]
runpy.run_path("setup.py", run_name="__main__")
EOF
); then
  cause=$(grep -E "error|Error|undefined|FAILED|No such file|cannot find" "$LOG" | tail -3 | tr -s ' \n' ' ' | cut -c1-500)
  echo "deepgemm build failed after $(( $(date +%s) - start )) s: ${cause:-$(tail -3 "$LOG" | tr -s ' \n' ' ')} (log: $LOG)"
  exit 1
fi
secs=$(( $(date +%s) - start ))
if where=$(cd / && PYTHONPATH="$LIB${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c 'import deep_gemm; print(deep_gemm.__file__)' 2>>"$LOG"); then
  echo "deepgemm build: ${secs} s; import deep_gemm OK ($where; with PYTHONPATH=$LIB)"
else
  echo "deepgemm build: ${secs} s, but import deep_gemm fails: $(grep -E "Error|undefined" "$LOG" | tail -1 | cut -c1-400) (log: $LOG)"
  exit 1
fi
