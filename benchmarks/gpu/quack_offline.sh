#!/usr/bin/env bash
# Prepare QuACK (`[moe_echo] experts_gemm = "quack"`) for an offline GPU machine that receives at most
# 64 MiB: run here (network) from the repository root. Downloads quack-kernels and nvidia-cutlass-dsl (CUDA 13,
# Python 3.12) with their dependencies, takes the two large shared libraries out of their wheels and xz-packs
# them, so the install travels in two steps:
#   .whl/extra/quack/  the wheels (without those two libraries) + rt.so.xz     (~31 MB, copied with .whl)
#   build/quack/       ir.so.xz, cutlass-dsl's 193 MB MLIR library             (~48 MB, copied alone)
# On the GPU machine: `bash benchmarks/gpu/run.sh quack_unpack` (with build/quack present) unpacks the MLIR library to
# /tmp; every later run on the same machine that sources lib.sh (with .whl present) then installs QuACK.
set -euo pipefail
q=.whl/extra/quack ir=build/quack
rm -rf "$q" "$ir" && mkdir -p "$q" "$ir"
for p in quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
         nvidia-cutlass-dsl-libs-cu13==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 cuda-bindings==13.5.0 \
         cuda-pathfinder==1.9.1 protobuf==7.36.2 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$q" "$p"
done
take() {  # member, xz output: move one library out of the wheel holding it (lib.sh puts it back)
  python3 - "$q" "$1" "$2" <<'EOF'
import glob, lzma, os, shutil, sys, zipfile
folder, member, out = sys.argv[1:]
wheel = next(w for w in glob.glob(os.path.join(folder, "*.whl")) if member in zipfile.ZipFile(w).namelist())
with zipfile.ZipFile(wheel) as z, lzma.open(out, "wb", preset=6) as f:
    shutil.copyfileobj(z.open(member), f)
    kept = [(i, z.read(i)) for i in z.infolist() if i.filename != member]
with zipfile.ZipFile(wheel + ".tmp", "w", zipfile.ZIP_DEFLATED) as z:
    for info, data in kept:  # RECORD still lists the member: pip installs without checking it
        z.writestr(info, data)
os.replace(wheel + ".tmp", wheel)
print(f"{member}: out of {os.path.basename(wheel)} into {out}")
EOF
}
take nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so "$ir/ir.so.xz"
take nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so "$q/rt.so.xz"
du -sh "$q" "$ir"
