"""2-GPU expert-parallel checks, run under torchrun by tests/test_gpu_ep.py (NCCL):
1. padded and nvlink dispatchers fwd+bwd, with and without ECHO (nvlink: token rows moved by kernels and by the
   copy engines), raise nothing under
   torch.cuda.set_sync_debug_mode("error");
2. the alltoall baseline does raise there (so the check is real);
3. the bf16 EP=2 layer matches the same layer at EP=1 (every backend);
4. in fp32, nvlink's outputs and input/weight gradients (either copy path, and with the layer's tokens in 3
   pipelined chunks, or in 2 with the shared experts at the pipeline's ends) equal alltoall's (exact path) to
   1e-5; with the fp8 wire (dispatch_precision = "fp8") the outputs equal alltoall's over its fp8 wire (the same
   token rows quantised the same way) to 1e-5, and outputs and gradients agree across the copy paths and chunk
   counts to 1e-5 (alltoall's backward quantises weighted gradient rows, nvlink's the unweighted ones: their
   gradients differ at the fp8 level);
5. FP8 experts behind nvlink (bf16 and fp8 wire, and the layer in 2 pipelined chunks): the rows the dispatcher's
   kernels quantise as they write them (its local expand, its combine backward) give bitwise the output and
   gradients of quantising in the experts, which then quantise no [N, D] rows themselves, both with the bf16 rows
   written beside them and without (``fp8_plain`` False, what FP8 weight gradients build); sync-free;
6. FP8 experts behind nvlink with ECHO on (whole and in 2 pipelined chunks): the clones read from the FP8 weight
   copies (their bytes written into the copies' slot rows over peer memory) give bitwise the output and gradients
   of casting the extended weights per call; sync-free."""

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torchtitan.models.moe import MoEArgs

from components.moe_echo.config import MoEEchoConfig
from components.moe_echo.layer import MoELayer
from components.parallel.parallelize import apply_expert_parallel


def make(dev, cfg: MoEEchoConfig | None = None):
    torch.manual_seed(0)
    args = MoEArgs(num_experts=16, num_shared_experts=1, top_k=4, score_func="softmax", score_before_experts=False)
    layer = MoELayer(args, 512, 256, cfg or MoEEchoConfig()).to(dev)
    layer.init_weights(0.02, dev)
    return layer


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("ep",))
    ref = make(dev)
    x_all = torch.randn(world, 1024, 512, device=dev, generator=torch.Generator(device=dev).manual_seed(1))
    for backend, echo, copies, chunks, shared, wire in (
            ("padded", False, "kernel", 1, "auto", "bf16"), ("padded", True, "kernel", 1, "auto", "bf16"),
            ("nvlink", False, "kernel", 1, "auto", "bf16"), ("nvlink", True, "kernel", 1, "auto", "bf16"),
            ("nvlink", True, "copy_engine", 1, "auto", "bf16"), ("nvlink", True, "kernel", 2, "auto", "bf16"),
            ("nvlink", True, "kernel", 2, "ends", "bf16"), ("nvlink", True, "copy_engine", 2, "auto", "bf16"),
            ("nvlink", True, "kernel", 1, "auto", "fp8"), ("nvlink", True, "kernel", 2, "auto", "fp8"),
            ("alltoall", False, "kernel", 1, "auto", "bf16")):
        base = copy.deepcopy(ref)
        if echo:  # two hot experts on rank 0, so ECHO really clones
            base.expert_bias[:2] = 0.5
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y_ref = base(x_all)
        layer = copy.deepcopy(base)
        apply_expert_parallel(layer, mesh, MoEEchoConfig(dispatcher=backend, capacity_factor=float(world), echo=echo,
                                                         nvlink_copy=copies, overlap_chunks=chunks,
                                                         shared_experts_stream=shared, dispatch_precision=wire))
        x = x_all[rank:rank + 1].clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.float().pow(2).mean().backward()  # warm-up
        rel = float((y.float() - y_ref[rank:rank + 1].float()).norm() / y_ref[rank:rank + 1].float().norm())
        assert rel < (2e-2 if wire == "bf16" else 0.1), (backend, echo, wire, rel)  # fp8: e4m3 tokens, 3 bits
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        synced = None
        try:
            for _ in range(3):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = layer(x)
                y.float().pow(2).mean().backward()
        except RuntimeError as err:
            synced = str(err).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        if backend != "alltoall":
            assert synced is None, f"{backend} (echo={echo}) synced: {synced}"
            assert int(layer.overflow_count) == 0
            if echo:
                assert float(layer.echo_stats[2]) >= 1, "ECHO made no clone"
        else:
            assert synced is not None, "alltoall did not sync: the check is not real"
        if rank == 0:
            print(f"{backend} echo={echo} copies={copies} chunks={chunks} shared={shared} wire={wire}: rel err vs EP=1 {rel:.2e}; host sync: {synced or 'none'}", flush=True)
    # fp32: nvlink (with ECHO) against the exact alltoall path, outputs and gradients
    grads = {}
    for backend, copies, chunks in (("alltoall", "kernel", 1), ("nvlink", "kernel", 1), ("nvlink_ce", "copy_engine", 1),
                                    ("nvlink_c3", "kernel", 3), ("nvlink_ce_c2", "copy_engine", 2),
                                    ("nvlink_c2_ends", "kernel", 2), ("alltoall_fp8", "kernel", 1),
                                    ("nvlink_fp8", "kernel", 1), ("nvlink_ce_fp8", "copy_engine", 1),
                                    ("nvlink_c2_fp8", "kernel", 2)):
        layer = copy.deepcopy(ref)
        layer.expert_bias[:2] = 0.5
        apply_expert_parallel(layer, mesh, MoEEchoConfig(dispatcher=backend.split("_")[0], capacity_factor=float(world),
                                                         echo=True, nvlink_copy=copies, overlap_chunks=chunks,
                                                         shared_experts_stream="ends" if "ends" in backend else "auto",
                                                         dispatch_precision="fp8" if "fp8" in backend else "bf16"))
        x = x_all[rank:rank + 1].clone().requires_grad_()
        y = layer(x)
        (y * torch.linspace(-1, 1, y.numel(), device=dev).view_as(y)).sum().backward()
        grads[backend] = [y.detach(), x.grad] + [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                                                  for p in layer.parameters()]

    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    for name, ref_name, n in (("nvlink", "alltoall", None), ("nvlink_ce", "alltoall", None),
                              ("nvlink_c3", "alltoall", None), ("nvlink_ce_c2", "alltoall", None),
                              ("nvlink_c2_ends", "alltoall", None), ("nvlink_fp8", "alltoall_fp8", 1),
                              ("nvlink_ce_fp8", "nvlink_fp8", None), ("nvlink_c2_fp8", "nvlink_fp8", None)):
        for a, b in zip(grads[ref_name][:n], grads[name][:n]):
            assert rel(a, b) < 1e-5, f"fp32 {name} vs {ref_name}: rel err {rel(a, b)}"
    wire_gap = rel(grads["alltoall_fp8"][0], grads["alltoall"][0])
    assert wire_gap > 1e-4, f"the fp8 wire did not quantise: {wire_gap}"  # so the fp8 comparisons are not bf16's
    grad_gap = max(rel(a, b) for a, b in zip(grads["nvlink_fp8"][1:], grads["alltoall"][1:]))
    assert grad_gap < 0.1, f"fp8 wire gradients vs the exact ones: rel err {grad_gap}"
    if rank == 0:
        print(f"fp32 nvlink (kernels, copy engines, 3 chunks, copy engines in 2 chunks, 2 chunks with the shared "
              f"experts at the pipeline's ends) == alltoall (outputs, input and {len(grads['nvlink']) - 2} parameter grads); "
              f"fp8 wire: outputs == alltoall's fp8 wire (vs bf16 wire: {wire_gap:.1e}), copy engines and 2 chunks == "
              f"kernels; its gradients vs the exact ones: {grad_gap:.1e}",
              flush=True)
    fp8_rows_check(mesh, dev, rank, world, x_all)
    fp8_echo_copies_check(mesh, dev, rank, world, x_all)
    dist.barrier()
    if rank == 0:
        print("GPU-EP-OK", flush=True)
    dist.destroy_process_group()


def _fwd_bwd(layer, x, dev) -> list:
    """The layer's output, x's gradient and its parameters' (local shards) after one bf16-autocast forward and a
    backward of a fixed weighting of the output."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    (y.float() * torch.linspace(-1, 1, y.numel(), device=dev).view_as(y)).sum().backward()
    return [y.detach(), x.grad] + [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                                   for p in layer.parameters()]


def _sync_free(layer, x) -> None:
    """Another forward and backward with device-to-host syncs raising."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            layer(x).float().pow(2).mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def fp8_rows_check(mesh, dev, rank: int, world: int, x_all: torch.Tensor) -> None:
    """5.: FP8 experts over nvlink, the dispatcher's FP8 rows on (with and without bf16 rows beside them) and off,
    bitwise."""
    import components.moe_echo.fp8_experts as fe

    quantised, real = [], fe.quant_rows
    fe.quant_rows = lambda x, *a: quantised.append(tuple(x.shape)) or real(x, *a)
    try:
        for wire, chunks in (("bf16", 1), ("fp8", 1), ("bf16", 2)):
            runs = []
            for fp8_rows, plain in ((False, True), (True, True), (True, False)):
                cfg = MoEEchoConfig(dispatcher="nvlink", capacity_factor=float(world), expert_precision="fp8",
                                    dispatch_precision=wire, overlap_chunks=chunks)
                layer = make(dev, cfg)
                layer.expert_bias[:2] = 0.5  # two hot experts on rank 0
                apply_expert_parallel(layer, mesh, cfg)
                assert layer.dispatcher.fp8_rows and not layer.dispatcher.fp8_plain  # what the config builds
                layer.dispatcher.fp8_rows, layer.dispatcher.fp8_plain = fp8_rows, plain
                quantised.clear()
                x = x_all[rank:rank + 1].clone().requires_grad_()
                runs.append(_fwd_bwd(layer, x, dev))
                rows = [s for s in quantised if s[1] == x.shape[-1]]  # x_ND and dy_ND: [N, D]
                assert len(rows) == (0 if fp8_rows else 2 * chunks), (wire, chunks, fp8_rows, quantised)
                _sync_free(layer, x)
            for run in runs[1:]:
                for i, (a, b) in enumerate(zip(runs[0], run)):
                    assert a is not None and torch.equal(a, b), f"fp8 rows ({wire} wire, {chunks} chunks): tensor {i}"
            if rank == 0:
                print(f"FP8 experts over nvlink, {wire} wire, {chunks} chunk(s): the dispatcher's FP8 rows == the "
                      f"experts' own quantisation (output and {len(runs[0]) - 1} gradients, bitwise); sync-free",
                      flush=True)
    finally:
        fe.quant_rows = real


def fp8_echo_copies_check(mesh, dev, rank: int, world: int, x_all: torch.Tensor) -> None:
    """6.: FP8 experts over nvlink with ECHO, the clones from the FP8 copies against the per-call cast, bitwise (the
    copies' path taken with either chunk count: one fetch of the clones' FP8 bytes per forward)."""
    from components.moe_echo import echo

    fetches, clone_fp8 = [], echo.clone_fp8_weights_

    def counted(*args, **kwargs):
        fetches.append(1)
        return clone_fp8(*args, **kwargs)
    echo.clone_fp8_weights_ = counted
    for chunks in (1, 2):
        runs = []
        for copies in (False, True):
            cfg = MoEEchoConfig(dispatcher="nvlink", capacity_factor=float(world), expert_precision="fp8", echo=True,
                                overlap_chunks=chunks)
            layer = make(dev, cfg)
            layer.expert_bias[:2] = 0.5  # two hot experts on rank 0, so ECHO clones
            apply_expert_parallel(layer, mesh, cfg)
            if copies:
                layer.enable_fp8_copies()
                assert layer.experts.fp8_copies.slots == layer.echo.S
            x = x_all[rank:rank + 1].clone().requires_grad_()
            fetches.clear()
            runs.append(_fwd_bwd(layer, x, dev))
            assert len(fetches) == int(copies), f"{chunks} chunks, copies={copies}: {len(fetches)} fetches of FP8 clones"
            assert float(layer.echo_stats[2]) >= 1, "ECHO made no clone"
            _sync_free(layer, x)
        for i, (a, b) in enumerate(zip(*runs)):
            assert a is not None and torch.equal(a, b), f"ECHO from FP8 copies ({chunks} chunks): tensor {i} differs"
        if rank == 0:
            print(f"FP8 experts over nvlink with ECHO, {chunks} chunk(s): clones from the FP8 copies == the extended "
                  f"weights cast per call (output and {len(runs[0]) - 1} gradients, bitwise); sync-free", flush=True)
    echo.clone_fp8_weights_ = clone_fp8


if __name__ == "__main__":
    main()
