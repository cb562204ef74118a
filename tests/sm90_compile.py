"""Imported first by the interpreter runs (TRITON_INTERPRET=1): records every Triton kernel launch and,
at exit, compiles each distinct (kernel, argument types, constexprs) for Hopper (sm_90) with Triton's
own compiler, down to a cubin, in a fresh process (the interpreter patches ``triton.language``). The
interpreter executes kernels as Python and accepts code the compiler rejects (a tuple of dtypes, a
cast it cannot lower); this catches that on a machine without a GPU. A failure prints
``SM90-COMPILE-FAILED <kernel>: <error>`` and the run exits with status 3.

    python tests/sm90_compile.py launches.json   # compile a recorded set (what the exit hook runs)

With SM90_COMPILE_ONLY=1 set (before the first launch) launches are recorded and not executed: for
kernels the interpreter cannot run (FP8 dtypes), called through their wrappers on CPU tensors.

SM90_TRITON_PATH: a directory holding the Triton the GPUs run (``pip install --no-deps --target DIR
triton==GPU_TRITON``; .ci/run does): the launches compile with that Triton instead of this environment's, whose
compiler may accept what the GPUs' rejects (and the other way round).
"""
import atexit
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile

_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64", "int64": "i64",
          "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1", "float8_e4m3fn": "fp8e4nv",
          "float8_e5m2": "fp8e5"}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
GPU_TRITON = "3.6.0"  # the Triton of the GPU image (torch 2.11)


def _arg_type(v) -> str:
    import torch
    from triton.runtime.jit import mangle_type
    from triton.tools.tensor_descriptor import TensorDescriptor
    if isinstance(v, TensorDescriptor):  # a host-side TMA descriptor: its dtype and block shape
        return mangle_type(v)
    if isinstance(v, torch.Tensor):
        return "*" + _TYPES[str(v.dtype).removeprefix("torch.")]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2**31 <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"argument of type {type(v).__name__}")


def _divisible_by_16(v) -> bool:
    """What a GPU launch specialises on: a pointer or an integer argument that is a multiple of 16."""
    import torch
    if isinstance(v, torch.Tensor):
        return v.data_ptr() % 16 == 0
    return isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0


def _launch_key(fn, args, kwargs) -> str:
    """JSON of what the compiler needs from one launch: kernel, signature, constexprs, options, and the positions
    of the arguments a GPU launch would mark divisible by 16 (the compiler takes other paths with them)."""
    import triton.language as tl
    params = inspect.signature(fn).parameters
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTIONS}
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    sig, const, div16 = {}, {}, []
    for i, (name, v) in enumerate(bound.arguments.items()):
        if params[name].annotation is tl.constexpr or v is None:
            sig[name], const[name] = "constexpr", v
        else:
            sig[name] = _arg_type(v)
            if _divisible_by_16(v):
                div16.append(i)
    return json.dumps([fn.__module__, fn.__qualname__, sig, const, options, div16], sort_keys=True)


def compile_all(launches: list[str]) -> int:
    """Compile each recorded launch for sm_90; the number that failed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    failed = 0
    for launch in launches:
        module, name, sig, const, options, div16 = json.loads(launch)
        attrs = {(i,): [["tt.divisibility", 16]] for i in div16}
        try:
            fn = getattr(importlib.import_module(module), name)
            triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                           options=options)
        except Exception as e:  # noqa: BLE001 - every compiler error is reported the same way
            failed += 1
            print(f"SM90-COMPILE-FAILED {module}.{name}: {type(e).__name__}: {str(e)[-1500:]}", file=sys.stderr)
    names = sorted({json.loads(launch)[1] for launch in launches})
    print(f"SM90-COMPILED {len(launches) - failed} of {len(launches)} kernel variants (Triton {triton.__version__}): "
          f"{' '.join(names)}", file=sys.stderr)
    return failed


def _record_launches():
    from triton.runtime.interpreter import InterpretedFunction
    seen: set[str] = set()
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        seen.add(_launch_key(self.fn, args, dict(kwargs)))
        if os.environ.get("SM90_COMPILE_ONLY") == "1":
            return None
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def compile_at_exit():
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(sorted(seen), f)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        gpu_triton = os.environ.get("SM90_TRITON_PATH")
        if gpu_triton:  # its triton package ahead of this environment's
            env["PYTHONPATH"] = os.pathsep.join(p for p in (gpu_triton, env.get("PYTHONPATH")) if p)
        p = subprocess.run([sys.executable, __file__, f.name], env=env, capture_output=True, text=True)
        os.unlink(f.name)
        sys.stderr.write(p.stderr)
        sys.stderr.flush()
        if p.returncode:
            os._exit(3)

    InterpretedFunction.run = recording_run
    atexit.register(compile_at_exit)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        sys.exit(1 if compile_all(json.load(f)) else 0)
elif os.environ.get("TRITON_INTERPRET") == "1":
    _record_launches()
